// Package obs is what pgsaga's programs share to be observed: the
// /metrics endpoint (-metrics-addr) and the tracer provider configured
// from the standard OpenTelemetry environment variables. (Their logging
// flags are internal/cmdlog's.)
package obs

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"
	"go.opentelemetry.io/otel/exporters/stdout/stdouttrace"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
)

// NewRegistry returns a registry with the Go runtime's and the process's
// collectors, for a program's metrics.
func NewRegistry() *prometheus.Registry {
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	return reg
}

// MetricsServer serves a registry's metrics at /metrics.
type MetricsServer struct {
	srv  *http.Server
	addr string
	done chan error
}

// ServeMetrics listens on addr (host:port; port 0 picks one) and serves
// g's metrics at /metrics until Close. A bad address, or one in use, is
// an error at once.
func ServeMetrics(addr string, g prometheus.Gatherer, log *slog.Logger) (*MetricsServer, error) {
	if err := CheckMetricsAddr(addr); err != nil {
		return nil, err
	}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("metrics: %w", err)
	}
	mux := http.NewServeMux()
	mux.Handle("GET /metrics", promhttp.HandlerFor(g, promhttp.HandlerOpts{ErrorLog: slogPrinter{log}, ErrorHandling: promhttp.ContinueOnError}))
	s := &MetricsServer{srv: &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}, addr: ln.Addr().String(), done: make(chan error, 1)}
	go func() { s.done <- s.srv.Serve(ln) }()
	return s, nil
}

// CheckMetricsAddr checks a -metrics-addr value: host:port, the port a
// number (0 picks a free one).
func CheckMetricsAddr(addr string) error {
	_, port, err := net.SplitHostPort(addr)
	if err == nil {
		_, err = net.LookupPort("tcp", port)
	}
	if err != nil {
		return fmt.Errorf("-metrics-addr %q: want host:port, e.g. 127.0.0.1:9090 (%w)", addr, err)
	}
	return nil
}

// Addr is the address it listens on.
func (s *MetricsServer) Addr() string { return s.addr }

// Close stops serving, waiting up to a few seconds for scrapes under way.
func (s *MetricsServer) Close() error {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	err := s.srv.Shutdown(ctx)
	if serr := <-s.done; !errors.Is(serr, http.ErrServerClosed) {
		err = errors.Join(err, serr)
	}
	return err
}

type slogPrinter struct{ log *slog.Logger }

func (p slogPrinter) Println(v ...any) { p.log.Error("serving metrics", "err", fmt.Sprint(v...)) }

// Tracing is how the programs trace: from the standard OpenTelemetry
// environment variables, nothing unless asked.
//
//   - OTEL_TRACES_EXPORTER: "otlp" (OTLP over HTTP/protobuf, configured by
//     the OTEL_EXPORTER_OTLP_* variables), "console" (spans as JSON on
//     stderr), or "none". Unset, it is "otlp" if an OTLP endpoint is set
//     (OTEL_EXPORTER_OTLP_ENDPOINT or OTEL_EXPORTER_OTLP_TRACES_ENDPOINT),
//     else "none".
//   - OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES name the process;
//     OTEL_TRACES_SAMPLER and its argument choose what is sampled.
//
// It installs the provider as the global one (pgsaga's transport uses the
// global provider unless given another) and returns a function that
// flushes and stops it; with nothing asked it installs nothing and the
// function does nothing.
func Tracing(ctx context.Context, service string, stderr io.Writer) (shutdown func(context.Context) error, err error) {
	nothing := func(context.Context) error { return nil }
	exporter := strings.ToLower(strings.TrimSpace(os.Getenv("OTEL_TRACES_EXPORTER")))
	if exporter == "" && (os.Getenv("OTEL_EXPORTER_OTLP_ENDPOINT") != "" || os.Getenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") != "") {
		exporter = "otlp"
	}
	var exp sdktrace.SpanExporter
	switch exporter {
	case "", "none":
		return nothing, nil
	case "otlp":
		proto := os.Getenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
		if proto == "" {
			proto = os.Getenv("OTEL_EXPORTER_OTLP_PROTOCOL")
		}
		if proto != "" && proto != "http/protobuf" {
			return nothing, fmt.Errorf("tracing: OTLP protocol %q is not supported; use http/protobuf", proto)
		}
		exp, err = otlptracehttp.New(ctx)
	case "console":
		exp, err = stdouttrace.New(stdouttrace.WithWriter(stderr))
	default:
		return nothing, fmt.Errorf("tracing: OTEL_TRACES_EXPORTER=%q is not supported; use otlp, console or none", exporter)
	}
	if err != nil {
		return nothing, fmt.Errorf("tracing: %w", err)
	}
	res, err := resource.Merge(resource.Default(), resource.NewSchemaless(attribute.String("service.name", service)))
	if err != nil {
		return nothing, fmt.Errorf("tracing: %w", err)
	}
	if env, rerr := resource.New(ctx, resource.WithFromEnv()); rerr == nil {
		if merged, merr := resource.Merge(res, env); merr == nil {
			res = merged
		}
	}
	tp := sdktrace.NewTracerProvider(sdktrace.WithBatcher(exp), sdktrace.WithResource(res))
	otel.SetTracerProvider(tp)
	otel.SetTextMapPropagator(propagation.NewCompositeTextMapPropagator(propagation.TraceContext{}, propagation.Baggage{}))
	return tp.Shutdown, nil
}
