package steps_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/codes"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/pgsaga/pgsaga/idempotency"
	"github.com/pgsaga/pgsaga/internal/stepsrt"
	"github.com/pgsaga/pgsaga/internal/telemetry"
	"github.com/pgsaga/pgsaga/internal/testdb"
	"github.com/pgsaga/pgsaga/internal/transport"
	"github.com/pgsaga/pgsaga/steps"
)

// A step whose handler panics fails its attempt: the attempt is counted as
// an error and its spans (the delivery's and the step's) end, failed; the
// retry that follows completes.
func TestPanickingStepIsCountedAndTraced(t *testing.T) {
	t.Parallel()
	rt, exp, reg := observedRuntime(t, logger())
	name := "panicky-" + uuid.NewString()[:8]
	var calls atomic.Int32
	step := steps.Define(name, "cmds_"+name, func(ctx context.Context, tx *steps.Tx, cmd addCmd) (steps.Message, error) {
		if calls.Add(1) == 1 {
			panic("boom")
		}
		return added{Account: cmd.Account}, nil
	})
	msg, err := steps.NewMessage(addCmd{Account: "a", Amount: 1}, steps.Envelope{ID: uuid.NewString(), Key: uuid.NewString()})
	require.NoError(t, err)
	require.NoError(t, rt.Execute(context.Background(), step, msg))

	var stepSpans, failed []string
	for _, s := range exp.GetSpans() {
		if s.Name == "step "+name || s.Name == "process cmds_"+name {
			stepSpans = append(stepSpans, s.Name)
			if s.Status.Code == codes.Error {
				failed = append(failed, s.Name+": "+s.Status.Description)
			}
		}
	}
	assert.Len(t, stepSpans, 4, "two attempts, each a delivery span and a step span, all ended")
	require.Len(t, failed, 2, "the first attempt's two spans failed")
	for _, f := range failed {
		assert.True(t, strings.Contains(f, "panicked") && strings.Contains(f, "boom"), f)
	}
	outcomes := stepOutcomes(t, reg)
	assert.Equal(t, map[string]uint64{telemetry.StepError: 1, telemetry.StepCompleted: 1}, outcomes)
}

// A step that awaits a call is not failing: its attempt is counted as
// awaiting, not as an error, and its spans end without an error status;
// its run after the call completes.
func TestAnAwaitingStepIsNotAnError(t *testing.T) {
	t.Parallel()
	rt, exp, reg := observedRuntime(t, logger())
	name := "awaiting-" + uuid.NewString()[:8]
	step := steps.Define(name, "cmds_"+name, func(ctx context.Context, tx *steps.Tx, cmd addCmd) (steps.Message, error) {
		if !steps.Awaited(ctx) {
			return nil, steps.Await(time.Minute, func(context.Context) error { return nil })
		}
		return added{Account: cmd.Account}, nil
	})
	msg, err := steps.NewMessage(addCmd{Account: "a", Amount: 1}, steps.Envelope{ID: uuid.NewString(), Key: uuid.NewString()})
	require.NoError(t, err)
	require.NoError(t, rt.Execute(context.Background(), step, msg))

	spans := 0
	for _, s := range exp.GetSpans() {
		if s.Name == "step "+name || s.Name == "process cmds_"+name {
			spans++
			assert.NotEqual(t, codes.Error, s.Status.Code, "%s: %s", s.Name, s.Status.Description)
		}
	}
	assert.Equal(t, 4, spans, "two runs, each a delivery span and a step span")
	outcomes := stepOutcomes(t, reg)
	assert.Equal(t, map[string]uint64{telemetry.StepAwaiting: 1, telemetry.StepCompleted: 1}, outcomes)
}

// stepOutcomes counts the step attempts reg saw, by outcome.
func stepOutcomes(t *testing.T, reg *prometheus.Registry) map[string]uint64 {
	t.Helper()
	fams, err := reg.Gather()
	require.NoError(t, err)
	outcomes := map[string]uint64{}
	for _, f := range fams {
		if f.GetName() != "pgsaga_step_duration_seconds" {
			continue
		}
		for _, mm := range f.GetMetric() {
			for _, l := range mm.GetLabel() {
				if l.GetName() == "outcome" {
					outcomes[l.GetValue()] += mm.GetHistogram().GetSampleCount()
				}
			}
		}
	}
	return outcomes
}

// observedRuntime is a step runtime whose spans go to exp, metrics to reg
// and step logs to log; failed attempts are retried at once, three in all.
func observedRuntime(t *testing.T, log *slog.Logger) (rt stepsrt.Runtime, exp *tracetest.InMemoryExporter, reg *prometheus.Registry) {
	t.Helper()
	db := testdb.Shared(t)
	exp = tracetest.NewInMemoryExporter()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(exp))
	reg = prometheus.NewRegistry()
	tr, err := transport.New(transport.Config{DB: db.SQL, Logger: logger(), Metrics: reg, TracerProvider: tp,
		Retry: transport.RetryPolicy{MaxAttempts: 3, InitialBackoff: time.Millisecond}})
	require.NoError(t, err)
	store, err := idempotency.NewStore(idempotency.Config{DB: db.SQL})
	require.NoError(t, err)
	rt, err = stepsrt.New(stepsrt.Config{Transport: tr, Store: store, Logger: log})
	require.NoError(t, err)
	return rt, exp, reg
}

// A step's log line, written under its span, names the span's trace and
// itself (trace_id, span_id), and its duration in milliseconds (took_ms).
func TestAStepsLogLineNamesItsTrace(t *testing.T) {
	t.Parallel()
	var buf bytes.Buffer
	var mu sync.Mutex
	log := slog.New(slog.NewJSONHandler(lockedWriter{&mu, &buf}, nil))
	rt, exp, _ := observedRuntime(t, log)
	name := "logged-" + uuid.NewString()[:8]
	step := steps.Define(name, "cmds_"+name, func(ctx context.Context, tx *steps.Tx, cmd addCmd) (steps.Message, error) {
		return added{Account: cmd.Account}, nil
	})
	msg, err := steps.NewMessage(addCmd{Account: "a", Amount: 1}, steps.Envelope{ID: uuid.NewString(), Key: uuid.NewString()})
	require.NoError(t, err)
	require.NoError(t, rt.Execute(context.Background(), step, msg))

	var stepSpan tracetest.SpanStub
	for _, s := range exp.GetSpans() {
		if s.Name == "step "+name {
			stepSpan = s
		}
	}
	require.True(t, stepSpan.SpanContext.IsValid(), "the step's span")
	mu.Lock()
	defer mu.Unlock()
	var line map[string]any
	for _, l := range strings.Split(strings.TrimSpace(buf.String()), "\n") {
		var rec map[string]any
		require.NoError(t, json.Unmarshal([]byte(l), &rec), l)
		if rec["msg"] == "step completed" && rec["step"] == name {
			line = rec
		}
	}
	require.NotNil(t, line, buf.String())
	assert.Equal(t, stepSpan.SpanContext.TraceID().String(), line["trace_id"])
	assert.Equal(t, stepSpan.SpanContext.SpanID().String(), line["span_id"])
	assert.IsType(t, float64(0), line["took_ms"])
	assert.NotContains(t, line, "took")
}

// lockedWriter serializes writes to w.
type lockedWriter struct {
	mu *sync.Mutex
	w  io.Writer
}

func (l lockedWriter) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.w.Write(p)
}

// An awaited call that fails is an error of its step: it is counted as one
// (the attempt that awaited it as awaiting) and has a span of its own,
// "await <step>", a child of the attempt's, with an error status; a
// command whose calls always fail ends dead-lettered.
func TestAFailingAwaitedCallIsAnError(t *testing.T) {
	t.Parallel()
	rt, exp, reg := observedRuntime(t, logger())
	name := "failing-call-" + uuid.NewString()[:8]
	step := steps.Define(name, "cmds_"+name, func(ctx context.Context, tx *steps.Tx, cmd addCmd) (steps.Message, error) {
		return nil, steps.Await(time.Minute, func(context.Context) error { return errors.New("gateway down") })
	})
	msg, err := steps.NewMessage(addCmd{Account: "a", Amount: 1}, steps.Envelope{ID: uuid.NewString(), Key: uuid.NewString()})
	require.NoError(t, err)
	require.Error(t, rt.Execute(context.Background(), step, msg), "the command failed for good")

	outcomes := stepOutcomes(t, reg)
	assert.Positive(t, outcomes[telemetry.StepError], "the failed calls count as errors: %v", outcomes)
	assert.Equal(t, outcomes[telemetry.StepAwaiting], outcomes[telemetry.StepError], "one error a call, one awaiting attempt each")
	attempts := map[trace.SpanID]bool{}
	for _, s := range exp.GetSpans() {
		if s.Name == "step "+name {
			attempts[s.SpanContext.SpanID()] = true
		}
	}
	calls := 0
	for _, s := range exp.GetSpans() {
		if s.Name == "await "+name {
			calls++
			assert.Equal(t, codes.Error, s.Status.Code)
			assert.Contains(t, s.Status.Description, "gateway down")
			assert.True(t, attempts[s.Parent.SpanID()], "a child of its attempt's span")
		}
	}
	assert.Equal(t, int(outcomes[telemetry.StepError]), calls, "a span for each call")
}
