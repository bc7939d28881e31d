package main

import (
	"context"
	"errors"
	"io"
	"os/exec"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/internal/testdb"
)

// A worker process outlives no parent: when the parent's end of its stdin
// closes (as it does however the parent dies), it drains and exits 0.
func TestWorkerProcessStopsWhenItsParentGoes(t *testing.T) {
	t.Parallel()
	db := testdb.Fresh(t)
	p, err := startWorkerProcess(context.Background(), workerSpec{URL: db.URL, GatewayURL: "http://127.0.0.1:1",
		Consumers: 1, Batch: 10, MaxConns: 16}, &syncWriter{w: io.Discard})
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

// A worker process that cannot start says why, and start-up fails.
func TestWorkerProcessThatCannotStart(t *testing.T) {
	t.Parallel()
	_, err := startWorkerProcess(context.Background(), workerSpec{URL: "postgres://nobody@127.0.0.1:1/none?connect_timeout=1",
		GatewayURL: "http://127.0.0.1:1", Consumers: 1, Batch: 10, MaxConns: 4}, &syncWriter{w: io.Discard})
	require.ErrorContains(t, err, "did not start")
}

// Statements per saga: the server's count when there is one; else this
// process's, unless workers ran elsewhere and it saw only part.
func TestStatementsPerSagaSource(t *testing.T) {
	t.Parallel()
	from := statementCount{server: 100, serverOK: true, client: 10}
	to := statementCount{server: 700, serverOK: true, client: 40}
	per, client, source := perSaga(from, to, 10, true)
	require.Equal(t, []any{60.0, 3.0, "pg_stat_statements"}, []any{per, client, source})
	from.serverOK = false
	per, client, source = perSaga(from, to, 10, false)
	require.Equal(t, []any{3.0, 3.0, "client"}, []any{per, client, source})
	per, _, source = perSaga(from, to, 10, true)
	require.Equal(t, []any{0.0, "unavailable"}, []any{per, source})
}
