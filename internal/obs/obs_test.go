package obs_test

import (
	"bytes"
	"context"
	"io"
	"log/slog"
	"net/http"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel"

	"github.com/pgsaga/pgsaga/internal/obs"
)

func TestServeMetrics(t *testing.T) {
	quiet := slog.New(slog.NewTextHandler(io.Discard, nil))
	for _, bad := range []string{"nonsense", "127.0.0.1", ":notaport"} {
		_, err := obs.ServeMetrics(bad, prometheus.NewRegistry(), quiet)
		assert.Error(t, err, bad)
	}
	reg := obs.NewRegistry()
	c := prometheus.NewCounter(prometheus.CounterOpts{Name: "obs_test_total", Help: "A test counter."})
	reg.MustRegister(c)
	c.Add(3)
	s, err := obs.ServeMetrics("127.0.0.1:0", reg, quiet)
	require.NoError(t, err)
	resp, err := http.Get("http://" + s.Addr() + "/metrics")
	require.NoError(t, err)
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	assert.Contains(t, string(body), "obs_test_total 3")
	assert.Contains(t, string(body), "go_goroutines")
	_, err = obs.ServeMetrics(s.Addr(), reg, quiet)
	assert.Error(t, err, "an address in use is refused at once")
	require.NoError(t, s.Close())
}

// Tracing installs nothing unless the environment asks; it refuses what
// it cannot do, with a sentence saying what it can.
func TestTracingFromTheEnvironment(t *testing.T) {
	ctx := context.Background()
	before := otel.GetTracerProvider()
	for _, env := range []map[string]string{{}, {"OTEL_TRACES_EXPORTER": "none"}} {
		for k, v := range env {
			t.Setenv(k, v)
		}
		stop, err := obs.Tracing(ctx, "test", io.Discard)
		require.NoError(t, err)
		require.NoError(t, stop(ctx))
		assert.Equal(t, before, otel.GetTracerProvider(), "nothing installed for %v", env)
	}
	t.Setenv("OTEL_TRACES_EXPORTER", "zipkin")
	_, err := obs.Tracing(ctx, "test", io.Discard)
	assert.ErrorContains(t, err, "use otlp, console or none")
	t.Setenv("OTEL_TRACES_EXPORTER", "otlp")
	t.Setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
	_, err = obs.Tracing(ctx, "test", io.Discard)
	assert.ErrorContains(t, err, "use http/protobuf")

	t.Setenv("OTEL_TRACES_EXPORTER", "console")
	t.Setenv("OTEL_SERVICE_NAME", "from-env")
	var out bytes.Buffer
	stop, err := obs.Tracing(ctx, "test", &out)
	require.NoError(t, err)
	t.Cleanup(func() { otel.SetTracerProvider(before) })
	_, span := otel.Tracer("t").Start(ctx, "a span")
	span.End()
	require.NoError(t, stop(ctx))
	assert.Contains(t, out.String(), `"Name":"a span"`)
	assert.Contains(t, out.String(), "from-env", "OTEL_SERVICE_NAME wins over the program's name")
}
