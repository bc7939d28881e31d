package telemetry_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	dto "github.com/prometheus/client_model/go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"

	"github.com/pgsaga/pgsaga/internal/metadata"
	"github.com/pgsaga/pgsaga/internal/telemetry"
)

func TestNilMetricsRecordNothing(t *testing.T) {
	var m *telemetry.Metrics
	assert.NotPanics(t, func() {
		m.SagaStarted("s")
		m.SagaFinished("s", "completed", time.Second)
		m.CommandResent("s", "step")
		m.StepAttempt("step", telemetry.StepCompleted, time.Millisecond, 1)
		m.DeadLettered("t", "h")
		m.Retrying("t", "h")
	})
}

// Two transports of one process given one registerer count into the same
// metrics; a registry holding another metric of the same name refuses.
func TestNewMetricsSharesARegistry(t *testing.T) {
	_, err := telemetry.NewMetrics(nil)
	require.Error(t, err)
	reg := prometheus.NewRegistry()
	a, err := telemetry.NewMetrics(reg)
	require.NoError(t, err)
	b, err := telemetry.NewMetrics(reg)
	require.NoError(t, err, "a second set on one registry shares the first's")
	a.DeadLettered("t", "h")
	b.DeadLettered("t", "h")
	fams, err := reg.Gather()
	require.NoError(t, err)
	var got float64
	for _, f := range fams {
		if f.GetName() == "pgsaga_dead_letters_total" {
			for _, m := range f.GetMetric() {
				got += m.GetCounter().GetValue()
			}
		}
	}
	assert.Equal(t, 2.0, got, "both sets count into one series")

	other := prometheus.NewRegistry()
	other.MustRegister(prometheus.NewGauge(prometheus.GaugeOpts{Name: "pgsaga_dead_letters_total", Help: "not ours"}))
	_, err = telemetry.NewMetrics(other)
	require.ErrorContains(t, err, "registering metrics", "a metric of another kind under our name is refused")
}

// A metric registered already under our name with the same labels in
// another order is refused (sharing it would put values under the wrong
// labels), and so is a typed nil registry (it would panic); a refused
// NewMetrics leaves the registry as it was.
func TestNewMetricsRefusesWhatItCannotShare(t *testing.T) {
	reg := prometheus.NewRegistry()
	swapped := prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: "pgsaga", Name: "sagas_finished_total",
		Help: "Saga instances this process brought to a terminal state, by outcome (completed, compensated, failed: parked for an operator). A parked saga retried by an operator counts again when it ends.",
	}, []string{"outcome", "saga"})
	reg.MustRegister(swapped)
	_, err := telemetry.NewMetrics(reg)
	require.ErrorContains(t, err, "registering metrics")
	swapped.WithLabelValues("completed", "order").Inc()
	fams, err := reg.Gather()
	require.NoError(t, err)
	var names []string
	for _, f := range fams {
		names = append(names, f.GetName())
	}
	assert.Equal(t, []string{"pgsaga_sagas_finished_total"}, names, "what the refused call registered is gone")

	var nilRegistry *prometheus.Registry
	assert.NotPanics(t, func() {
		_, err = telemetry.NewMetrics(nilRegistry)
	})
	require.Error(t, err)
}

// A replayed step counts as a replay and an attempt of that outcome, but
// not in the attempts histogram (it ran nothing).
func TestStepAttemptOutcomes(t *testing.T) {
	reg := prometheus.NewRegistry()
	m, err := telemetry.NewMetrics(reg)
	require.NoError(t, err)
	m.StepAttempt("charge", telemetry.StepCompleted, time.Millisecond, 2)
	m.StepAttempt("charge", telemetry.StepReplayed, time.Millisecond, 1)
	m.StepAttempt("charge", telemetry.StepError, time.Millisecond, 1)
	n, err := testutil.GatherAndCount(reg, "pgsaga_idempotent_replays_total")
	require.NoError(t, err)
	assert.Equal(t, 1, n)
	require.NoError(t, testutil.GatherAndCompare(reg, strings.NewReader(`
# HELP pgsaga_idempotent_replays_total Duplicate commands answered from the idempotency store instead of running again.
# TYPE pgsaga_idempotent_replays_total counter
pgsaga_idempotent_replays_total{step="charge"} 1
`), "pgsaga_idempotent_replays_total"))
	fams, err := reg.Gather()
	require.NoError(t, err)
	var attempts *dto.MetricFamily
	for _, f := range fams {
		if f.GetName() == "pgsaga_step_attempts" {
			attempts = f
		}
	}
	require.NotNil(t, attempts, "the completed attempt was observed")
	require.Len(t, attempts.GetMetric(), 1)
	assert.Equal(t, uint64(1), attempts.GetMetric()[0].GetHistogram().GetSampleCount(), "only the completed attempt")
	assert.Equal(t, 2.0, attempts.GetMetric()[0].GetHistogram().GetSampleSum())
}

func TestTraceContextTravelsInMetadata(t *testing.T) {
	exp := tracetest.NewInMemoryExporter()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(exp))
	tr := telemetry.NewTracing(tp)
	ctx, span := tr.Start(context.Background(), "send", trace.SpanKindProducer)
	md := message.Metadata{}
	tr.Inject(ctx, md)
	span.End()
	require.NotEmpty(t, md[metadata.TraceParent])
	got := trace.SpanContextFromContext(tr.Extract(context.Background(), md))
	assert.Equal(t, span.SpanContext().TraceID(), got.TraceID())
	assert.Equal(t, span.SpanContext().SpanID(), got.SpanID())
	assert.True(t, got.IsRemote())
	assert.Equal(t, md[metadata.TraceParent], tr.TraceParent(ctx))

	// No span, nothing written; garbage read as no parent.
	empty := message.Metadata{}
	tr.Inject(context.Background(), empty)
	assert.Empty(t, empty)
	for _, bad := range []string{"garbage", "00-00000000000000000000000000000000-0000000000000000-01", "\x00\xff"} {
		sc := trace.SpanContextFromContext(tr.Extract(context.Background(), message.Metadata{metadata.TraceParent: bad}))
		assert.False(t, sc.IsValid(), "%q", bad)
		assert.False(t, trace.SpanContextFromContext(tr.ContextWithRemote(context.Background(), bad, "")).IsValid())
	}
}

// With tracing off (a no-op provider), a trace context that arrives is
// passed on unchanged: tracing on in one process and off in the next
// still joins the first's spans to the third's.
func TestNoopTracingPassesTheContextOn(t *testing.T) {
	tr := telemetry.NewTracing(noop.NewTracerProvider())
	in := message.Metadata{metadata.TraceParent: "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}
	ctx, span := tr.Start(tr.Extract(context.Background(), in), "process", trace.SpanKindConsumer)
	defer span.End()
	out := message.Metadata{}
	tr.Inject(ctx, out)
	assert.Equal(t, in[metadata.TraceParent], out[metadata.TraceParent])
}
