package sagatest_test

import (
	"context"
	"log/slog"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/saga/sagatest"
)

// recordingTB is a test whose log lines and cleanups the test reads.
type recordingTB struct {
	testing.TB
	logs     []string
	cleanups []func()
}

func (r *recordingTB) Helper()           {}
func (r *recordingTB) Log(args ...any)   { r.logs = append(r.logs, args[0].(string)) }
func (r *recordingTB) Cleanup(fn func()) { r.cleanups = append(r.cleanups, fn) }
func (r *recordingTB) runCleanups() {
	for i := len(r.cleanups) - 1; i >= 0; i-- {
		r.cleanups[i]()
	}
}

// The kit's logger keeps Info out of a test's log, puts warnings in it,
// and drops what comes once the test is over (t.Log would panic then).
func TestLoggerIsQuietUntilSomethingGoesWrong(t *testing.T) {
	t.Setenv(sagatest.LogEnv, "")
	rt := &recordingTB{TB: t}
	log := sagatest.Logger(rt)
	log.Info("worker started", "consumers", 2)
	log.Debug("claimed a batch")
	log.Warn("delivery failed", "attempt", 1)
	require.Len(t, rt.logs, 1, "only the warning: %v", rt.logs)
	assert.Contains(t, rt.logs[0], `msg="delivery failed" attempt=1`)
	rt.runCleanups()
	log.Error("stopping a worker", "err", "context canceled")
	assert.Len(t, rt.logs, 1, "nothing is logged to a test that is over")
}

// With PGSAGA_TEST_LOG set, everything is printed, down to Debug.
func TestLoggerPrintsEverythingWhenAsked(t *testing.T) {
	t.Setenv(sagatest.LogEnv, "1")
	log := sagatest.Logger(t)
	assert.True(t, log.Enabled(context.Background(), slog.LevelDebug))
	t.Setenv(sagatest.LogEnv, "")
	assert.False(t, sagatest.Logger(t).Enabled(context.Background(), slog.LevelInfo))
}
