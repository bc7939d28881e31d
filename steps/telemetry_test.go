package steps_test

import (
	"context"
	"strings"
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
	db := testdb.Shared(t)
	exp := tracetest.NewInMemoryExporter()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(exp))
	reg := prometheus.NewRegistry()
	tr, err := transport.New(transport.Config{DB: db.SQL, Logger: logger(), Metrics: reg, TracerProvider: tp,
		Retry: transport.RetryPolicy{MaxAttempts: 3, InitialBackoff: time.Millisecond}})
	require.NoError(t, err)
	store, err := idempotency.NewStore(idempotency.Config{DB: db.SQL})
	require.NoError(t, err)
	rt, err := stepsrt.New(stepsrt.Config{Transport: tr, Store: store, Logger: logger()})
	require.NoError(t, err)
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
	assert.Equal(t, map[string]uint64{telemetry.StepError: 1, telemetry.StepCompleted: 1}, outcomes)
}
