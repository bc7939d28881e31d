package main

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"net/http"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/internal/cmdlog"
	"github.com/pgsaga/pgsaga/internal/testdb"
	"github.com/pgsaga/pgsaga/internal/testout"
)

// A worker process outlives no parent: when the parent's end of its stdin
// closes (as it does however the parent dies), it drains and exits 0.
func TestWorkerProcessStopsWhenItsParentGoes(t *testing.T) {
	t.Parallel()
	db := testdb.Fresh(t)
	p, err := startWorkerProcess(context.Background(), workerSpec{URL: db.URL, GatewayURL: "http://127.0.0.1:1",
		Consumers: 1, Batch: 10, MaxConns: 16}, cmdlog.Synced(io.Discard))
	require.NoError(t, err)
	require.NoError(t, p.stdin.Close())
	select {
	case <-p.stopped:
	case <-time.After(time.Minute):
		_ = p.cmd.Process.Kill()
		t.Fatal("the worker process still runs a minute after its parent's end of stdin closed")
	}
	var exit *exec.ExitError
	require.False(t, errors.As(p.err, &exit), "it drained and exited 0, got %v", p.err)
}

// A worker process logs as the parent's -log-level and -log-format say:
// with json, every line on its stderr is one JSON object (its pid
// included); at debug, Watermill's router chatter shows, at info it does
// not.
func TestWorkerProcessLogsAsAsked(t *testing.T) {
	t.Parallel()
	db := testdb.Fresh(t)
	logs := func(level slog.Level, format string) string {
		t.Helper()
		out := &testout.Buffer{}
		p, err := startWorkerProcess(context.Background(), workerSpec{URL: db.URL, GatewayURL: "http://127.0.0.1:1",
			Consumers: 1, Batch: 10, MaxConns: 16, LogLevel: level.String(), LogFormat: format}, cmdlog.Synced(out))
		require.NoError(t, err)
		require.NoError(t, p.stdin.Close())
		select {
		case <-p.stopped: // its stderr is all copied once it has
		case <-time.After(time.Minute):
			_ = p.cmd.Process.Kill()
			t.Fatal("the worker process still runs a minute after its parent's end of stdin closed")
		}
		return out.String()
	}

	debug := logs(slog.LevelDebug, cmdlog.FormatJSON)
	lines := strings.Split(strings.TrimSpace(debug), "\n")
	for _, line := range lines {
		var rec map[string]any
		require.NoError(t, json.Unmarshal([]byte(line), &rec), "not a JSON line: %q", line)
		for _, key := range []string{"time", "level", "msg", "worker_pid"} {
			assert.Contains(t, rec, key, line)
		}
	}
	assert.Contains(t, debug, `"msg":"Starting handler"`)

	info := logs(slog.LevelInfo, cmdlog.FormatText)
	assert.NotContains(t, info, "level=DEBUG")
	assert.NotContains(t, info, `msg="Starting handler"`)
}

// A worker process that cannot start says why, and start-up fails.
func TestWorkerProcessThatCannotStart(t *testing.T) {
	t.Parallel()
	_, err := startWorkerProcess(context.Background(), workerSpec{URL: "postgres://nobody@127.0.0.1:1/none?connect_timeout=1",
		GatewayURL: "http://127.0.0.1:1", Consumers: 1, Batch: 10, MaxConns: 4}, cmdlog.Synced(io.Discard))
	require.ErrorContains(t, err, "did not start")
}

// Statements per saga: the server's count when there is one; else this
// process's, unless workers ran elsewhere and it saw only part.
func TestStatementsPerSagaSource(t *testing.T) {
	t.Parallel()
	from := statementCount{server: 100, serverOK: true, client: 10}
	to := statementCount{server: 700, serverOK: true, client: 40}
	f := perSaga(from, to, 10, true)
	require.Equal(t, []any{60.0, 3.0, "pg_stat_statements"}, []any{f.perSaga, f.clientPerSaga, f.source})
	from.serverOK = false
	f = perSaga(from, to, 10, false)
	require.Equal(t, []any{3.0, 3.0, "client"}, []any{f.perSaga, f.clientPerSaga, f.source})
	f = perSaga(from, to, 10, true)
	require.Equal(t, []any{0.0, "unavailable"}, []any{f.perSaga, f.source})
	assert.Nil(t, f.byOwner, "nothing to split")
	assert.Zero(t, f.commitsPerSaga, "the workers' commits were not seen")
}

// With Metrics, a worker process serves what it counts on a free port of
// 127.0.0.1 and announces the address before it is ready.
func TestWorkerProcessServesItsMetrics(t *testing.T) {
	t.Parallel()
	db := testdb.Fresh(t)
	p, err := startWorkerProcess(context.Background(), workerSpec{URL: db.URL, GatewayURL: "http://127.0.0.1:1",
		Consumers: 1, Batch: 10, MaxConns: 16, Metrics: true}, cmdlog.Synced(io.Discard))
	require.NoError(t, err)
	defer func() { assert.NoError(t, p.stop()) }()
	require.Regexp(t, `^http://127\.0\.0\.1:\d+/metrics$`, p.metricsURL)
	resp, err := http.Get(p.metricsURL)
	require.NoError(t, err)
	body, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	require.NoError(t, err)
	assert.Equal(t, http.StatusOK, resp.StatusCode)
	assert.Contains(t, string(body), "go_goroutines")
}
