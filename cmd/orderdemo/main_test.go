package main

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/internal/testdb"
	"github.com/pgsaga/pgsaga/saga/orderpayment"
)

func TestMain(m *testing.M) {
	// A copy of the test binary started by a test runs the command itself.
	if args, ok := os.LookupEnv("ORDERDEMO_ARGS"); ok {
		os.Exit(run(context.Background(), strings.Fields(args), os.Stdout, os.Stderr))
	}
	testdb.Main(m)
}

// lastJSON decodes the last line of stdout.
func lastJSON(t *testing.T, out string) summary {
	t.Helper()
	lines := strings.Split(strings.TrimSpace(out), "\n")
	var s summary
	require.NoError(t, json.Unmarshal([]byte(lines[len(lines)-1]), &s), "last line: %q", lines[len(lines)-1])
	return s
}

func TestRunPlacesOrdersAndReports(t *testing.T) {
	db := testdb.Fresh(t)
	t.Setenv("DATABASE_URL", db.URL)
	var stdout, stderr bytes.Buffer
	code := run(context.Background(), []string{"-orders", "30", "-json"}, &stdout, &stderr)
	require.Equal(t, exitOK, code, "stdout:\n%s\nstderr:\n%s", stdout.String(), stderr.String())
	s := lastJSON(t, stdout.String())
	assert.Equal(t, 30, s.Sagas)
	assert.Equal(t, 30, s.Completed+s.Compensated)
	assert.Zero(t, s.Failed)
	assert.Zero(t, s.Unfinished)
	assert.True(t, s.InvariantsOK)
	assert.Empty(t, s.Violations)
	assert.Positive(t, s.P50Millis)
	assert.GreaterOrEqual(t, s.P99Millis, s.P50Millis)
	assert.Positive(t, s.Completed, "some orders are paid")
	assert.Positive(t, s.Compensated, "some are refused or cancelled")
	assert.Contains(t, stderr.String(), "sagas 30:", "progress goes to stderr with -json")
	assert.Equal(t, 1, strings.Count(stdout.String(), "\n"), "stdout holds the JSON line only")

	// The table form.
	stdout.Reset()
	code = run(context.Background(), []string{"-orders", "5"}, &stdout, &stderr)
	require.Equal(t, exitOK, code)
	for _, want := range []string{"completed", "compensated", "failed", "latency", "p50", "p99", "time taken", "invariants   all hold"} {
		assert.Contains(t, stdout.String(), want)
	}
}

func TestBadFlags(t *testing.T) {
	t.Parallel()
	for args, want := range map[string]string{
		"-orders -1":            "-orders must not be negative",
		"-workers 0":            "-workers must be between 1 and 16",
		"-timeout 0s":           "-timeout must be positive",
		"-resume -orders 10":    "-resume places no orders",
		"extra":                 "unexpected arguments",
		"-orders ten":           "invalid value",
		"-no-such-flag":         "flag provided but not defined",
		"-workers 2 -orders 1e": "invalid value",
	} {
		var stdout, stderr bytes.Buffer
		code := run(context.Background(), strings.Fields(args), &stdout, &stderr)
		assert.Equal(t, exitUsage, code, args)
		assert.Contains(t, stderr.String(), want, args)
	}
	var stdout, stderr bytes.Buffer
	assert.Equal(t, exitOK, run(context.Background(), []string{"-h"}, &stdout, &stderr))
	assert.Contains(t, stderr.String(), "Usage: orderdemo")
}

// The runner is killed with SIGKILL in the middle of a run, then run again
// with -resume: it finishes every saga and every invariant holds.
func TestKillAndResume(t *testing.T) {
	db := testdb.Fresh(t)
	child := func(args string) *exec.Cmd {
		cmd := exec.Command(os.Args[0], "-test.run=^$")
		cmd.Env = append(os.Environ(), "ORDERDEMO_ARGS="+args, "DATABASE_URL="+db.URL)
		return cmd
	}

	first := child("-orders 120 -workers 2")
	out := &lockedBuffer{}
	first.Stdout, first.Stderr = out, out
	require.NoError(t, first.Start())
	// Kill it once some sagas have started and most are still going.
	deadline := time.Now().Add(60 * time.Second)
	for {
		var n int
		_ = db.SQL.QueryRow(`SELECT count(*) FROM saga_instances`).Scan(&n)
		if n >= 10 {
			break
		}
		require.True(t, time.Now().Before(deadline), "no saga started:\n%s", out.String())
		time.Sleep(5 * time.Millisecond)
	}
	require.NoError(t, first.Process.Signal(syscall.SIGKILL))
	err := first.Wait()
	require.Error(t, err, "killed")
	var running int
	require.NoError(t, db.SQL.QueryRow(`SELECT count(*) FROM saga_instances WHERE status IN ('running', 'compensating')`).Scan(&running))
	t.Logf("killed with %d sagas running", running)

	resume := child("-resume -json -timeout 90s")
	var rout, rerr bytes.Buffer
	resume.Stdout, resume.Stderr = &rout, &rerr
	err = resume.Run()
	require.NoError(t, err, "resume failed:\nstdout:\n%s\nstderr:\n%s", rout.String(), rerr.String())
	s := lastJSON(t, rout.String())
	assert.True(t, s.Resumed)
	assert.True(t, s.InvariantsOK, "%v", s.Violations)
	assert.Zero(t, s.Unfinished)

	// Every order placed before the kill has a terminal saga, and the
	// invariants hold over all of them.
	r, err := orderpayment.Check(context.Background(), db.SQL, nil)
	require.NoError(t, err)
	assert.True(t, r.OK(), "%v", r.Violations)
	var orphans int
	require.NoError(t, db.SQL.QueryRow(`SELECT count(*) FROM domain_events e WHERE e.event_type = 'orders.placed'
		AND NOT EXISTS (SELECT FROM saga_instances s WHERE s.data->>'order_id' = e.payload->>'order_id' AND s.status IN ('completed', 'compensated'))`).Scan(&orphans))
	assert.Zero(t, orphans, "every placed order's saga finished")
}

// lockedBuffer is a buffer a child process writes while the test reads it.
type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}
