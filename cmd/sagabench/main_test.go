package main

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/internal/testdb"
	"github.com/pgsaga/pgsaga/internal/testnats"
	"github.com/pgsaga/pgsaga/internal/testpg"
	"github.com/pgsaga/pgsaga/internal/testsample"
)

func TestMain(m *testing.M) {
	// A copy of the test binary started by a test runs the command itself,
	// signals included.
	if spec, ok := os.LookupEnv(workerEnv); ok {
		os.Exit(runWorkerProcess(spec, os.Stdout, os.Stderr))
	}
	if name, ok := os.LookupEnv(panicEnv); ok {
		panicInGoroutine(name)
	}
	if args, ok := os.LookupEnv("SAGABENCH_ARGS"); ok {
		os.Exit(runWithSignals(strings.Fields(args), os.Stdout, os.Stderr))
	}
	testpg.MainOwnServer(m, testsample.Schemas()...) // its runs take most of a server
}

// A small run reports every figure of the JSON contract, with every
// invariant checked, and drops its database.
func TestSmallRun(t *testing.T) {
	// It takes most of the server's connections and CPU for a while.
	list := filepath.Join(t.TempDir(), "statements.tsv")
	args := []string{"-sagas", "120", "-inflight", "40", "-rate", "40", "-duration", "1s",
		"-baseline", "300ms", "-idle", "500ms", "-lanes", "2", "-batch", "20", "-statement-list", list}
	takeTurn(t, args)
	db := testdb.Shared(t)
	t.Setenv("DATABASE_URL", db.URL)
	var stdout, stderr bytes.Buffer
	code := run(context.Background(), args, &stdout, &stderr)
	require.Equal(t, exitOK, code, "stdout:\n%s\nstderr:\n%s", stdout.String(), stderr.String())

	lines := strings.Split(strings.TrimSpace(stdout.String()), "\n")
	var raw map[string]any
	require.NoError(t, json.Unmarshal([]byte(lines[len(lines)-1]), &raw), "last line: %q", lines[len(lines)-1])
	for _, field := range []string{"ok", "sagas", "sagas_per_s", "steps_per_s", "p50_ms", "p95_ms", "p99_ms", "commit_tps",
		"cpu_s_per_1k_sagas", "idle_cpu_pct", "invariants_ok", "violations", "config", "machine"} {
		assert.Contains(t, raw, field)
	}
	assertDocumented(t, helpText(t), jsonKeys(t, []byte(lines[len(lines)-1])))
	var r result
	require.NoError(t, json.Unmarshal([]byte(lines[len(lines)-1]), &r))
	assert.True(t, r.OK)
	assert.True(t, r.InvariantsOK)
	assert.Equal(t, 120, r.Sagas)
	assert.Equal(t, 40, r.LatencySagas)
	assert.Equal(t, 160, r.Completed+r.Compensated)
	assert.Positive(t, r.Compensated, "a tenth of the customers have no money")
	assert.Positive(t, r.SagasPerS)
	assert.InDelta(t, 5, r.StepsPerSaga, 0.01, "trigger, charge, reply, confirm or cancel, reply")
	assert.Positive(t, r.P50Ms)
	assert.GreaterOrEqual(t, r.P95Ms, r.P50Ms)
	assert.GreaterOrEqual(t, r.P99Ms, r.P95Ms)
	assert.Positive(t, r.CommitTPS)
	assert.Positive(t, r.CPUPer1kSagas.Process)
	// Five steps of a few statements each, the gateway's and the
	// transport's: a count that works finds dozens.
	assert.Contains(t, []string{"pg_stat_statements", "client"}, r.StatementsSource)
	assert.Greater(t, r.StatementsPerSaga, 20.0)
	assert.Greater(t, r.ClientStatementsPerSaga, 20.0)
	// Each owner sends some, and together they are the count.
	sum := 0.0
	for _, o := range owners {
		assert.Positive(t, r.StatementsByOwner[o], o)
		sum += r.StatementsByOwner[o]
	}
	assert.InDelta(t, r.StatementsPerSaga, sum, 0.05)
	// Placing the order and the reservation for every saga, the capture
	// for those charged, and the batches' own (a batch's held charges
	// share one); fewer than the statements.
	assert.GreaterOrEqual(t, r.CommitsPerSaga, 2.0)
	assert.Less(t, r.CommitsPerSaga, r.StatementsPerSaga)
	assert.Positive(t, r.GatewayCommitsPerSaga, "the gateway records each call")
	// A round trip carries one statement or more, and each commit needs
	// one, with more before it.
	assert.Greater(t, r.RoundTripsPerSaga, r.CommitsPerSaga)
	assert.LessOrEqual(t, r.RoundTripsPerSaga, r.ClientStatementsPerSaga)
	if r.StatementsSource == "client" {
		assert.Contains(t, stdout.String(), "does not preload pg_stat_statements", "said once")
		assert.Equal(t, 1, strings.Count(stdout.String(), "does not preload pg_stat_statements"))
	}
	listed, err := os.ReadFile(list)
	require.NoError(t, err)
	assert.Regexp(t, `(?m)^\d+\.\d\d\tengine\tSELECT .* FROM saga_instances`, string(listed))
	assert.Equal(t, 20, r.Config.Batch)
	assert.Equal(t, 2, r.Config.Consumers)

	name := regexp.MustCompile(`pgsaga_bench_[0-9a-f]+`).FindString(stderr.String())
	require.NotEmpty(t, name, stderr.String())
	var exists bool
	require.NoError(t, db.SQL.QueryRow(`SELECT EXISTS (SELECT FROM pg_database WHERE datname = $1)`, name).Scan(&exists))
	assert.False(t, exists, "the benchmark database is dropped")
}

// With -worker-processes the sagas are driven by workers in separate
// processes (copies of the program): none runs in this one, so the run
// finishes only if they work, and they drain when it ends.
func TestWorkerProcesses(t *testing.T) {
	args := []string{"-sagas", "60", "-inflight", "20", "-rate", "0", "-baseline", "0", "-idle", "0",
		"-consumers", "1", "-batch", "10", "-worker-processes", "2", "-timeout", "2m", "-metrics-addr", "127.0.0.1:0"}
	takeTurn(t, args)
	db := testdb.Shared(t)
	t.Setenv("DATABASE_URL", db.URL)
	var stdout, stderr bytes.Buffer
	code := run(context.Background(), args, &stdout, &stderr)
	require.Equal(t, exitOK, code, "stdout:\n%s\nstderr:\n%s", stdout.String(), stderr.String())
	assert.Regexp(t, `metrics: serving http://127\.0\.0\.1:\d+/metrics\n`, stderr.String())
	assert.Len(t, regexp.MustCompile(`metrics: worker process \d+ serving http://127\.0\.0\.1:\d+/metrics\n`).FindAllString(stderr.String(), -1), 2,
		"each worker process serves its own")
	lines := strings.Split(strings.TrimSpace(stdout.String()), "\n")
	var r result
	require.NoError(t, json.Unmarshal([]byte(lines[len(lines)-1]), &r))
	assert.True(t, r.OK)
	assert.Equal(t, 2, r.Config.WorkerProcesses)
	assert.Equal(t, 60, r.Completed+r.Compensated)
	// The workers' statements are seen only by pg_stat_statements; a
	// server that does not preload it leaves the figure unavailable rather
	// than wrong.
	if r.StatementsSource == "pg_stat_statements" {
		assert.Greater(t, r.StatementsPerSaga, 20.0)
	} else {
		assert.Equal(t, "unavailable", r.StatementsSource)
		assert.Zero(t, r.StatementsPerSaga)
	}
}

// takeTurn makes a test that runs the benchmark with args wait for its
// server-wide turn, then for the connections the run checks it has: the
// other packages' tests of the run use connections too, for a while.
func takeTurn(t *testing.T, args []string) (need int) {
	t.Helper()
	testdb.ServerWide(t)
	o, err := parseFlags(args, io.Discard)
	require.NoError(t, err)
	_, need = o.connections()
	need += 2 // the run's own admin pool counts first
	// And a few to spare: the other packages' tests open connections
	// between this wait and the run's own count (68 needed, 65 free, in a
	// clean CI run with none to spare).
	testdb.FreeConnections(t, need+4)
	return need
}

func TestBadFlags(t *testing.T) {
	t.Parallel()
	for args, want := range map[string]string{
		"-sagas -1":                    "-sagas must be between 0 and 1000000",
		"-inflight 0":                  "-inflight must be positive",
		"-rate -5":                     "-rate must be between 0 and 10000",
		"-duration 0s":                 "-duration must be positive",
		"-consumers 0":                 "-consumers must be between 1 and 64",
		"-lanes 65":                    "-consumers must be between 1 and 64",
		"-workers 17":                  "-workers must be between 1 and 16",
		"-worker-processes 17":         "-worker-processes must be between 0 and 16",
		"-batch 0":                     "-batch must be between 1 and 1000",
		"-gateway-delay 2s":            "-gateway-delay must be between 0 and 1s",
		"-payments-service http://x:1": "unknown broker URL",
		"-payments-service nats://x:1 -worker-processes 2": "cannot be combined with -worker-processes",
		"-idle -1s":           "must not be negative",
		"-timeout 0s":         "-timeout must be positive",
		"-sagas 0 -rate 0":    "nothing to measure",
		"extra":               "unexpected arguments",
		"-no-such-flag":       "flag provided but not defined",
		"-log-format xml":     `-log-format must be text or json, got "xml"`,
		"-log-level loud":     `-log-level must be debug, info, warn or error, got "loud"`,
		"-v -log-level debug": "-v is short for -log-level info",
		"-metrics-addr 9090":  `-metrics-addr "9090": want host:port`,
	} {
		var stdout, stderr bytes.Buffer
		code := run(context.Background(), strings.Fields(args), &stdout, &stderr)
		assert.Equal(t, exitUsage, code, args)
		assert.Contains(t, stderr.String(), want, args)
	}
	var stdout, stderr bytes.Buffer
	assert.Equal(t, exitOK, run(context.Background(), []string{"-h"}, &stdout, &stderr))
	assert.Contains(t, stderr.String(), "Usage: sagabench")
}

// With -payments-service the payment step runs as a service of its own on
// a second fresh database, over the broker (a NATS server of the test's
// own: the sample's subjects are fixed); every saga finishes, every
// invariant holds across the two databases, and both are dropped.
func TestPaymentsService(t *testing.T) {
	srv := testnats.Private(t)
	args := []string{"-sagas", "100", "-inflight", "8", "-rate", "20", "-duration", "1s", "-baseline", "0", "-idle", "0",
		"-consumers", "1", "-batch", "10", "-timeout", "2m", "-payments-service", srv.URL()}
	takeTurn(t, args)
	db := testdb.Shared(t)
	t.Setenv("DATABASE_URL", db.URL)
	var stdout, stderr bytes.Buffer
	code := run(context.Background(), args, &stdout, &stderr)
	require.Equal(t, exitOK, code, "stdout:\n%s\nstderr:\n%s", stdout.String(), stderr.String())
	lines := strings.Split(strings.TrimSpace(stdout.String()), "\n")
	var r result
	require.NoError(t, json.Unmarshal([]byte(lines[len(lines)-1]), &r))
	assert.True(t, r.OK)
	assert.True(t, r.InvariantsOK, "%v", r.Violations)
	assert.True(t, r.Config.PaymentsService)
	assert.Equal(t, 120, r.Completed+r.Compensated)
	assert.Positive(t, r.Compensated, "a tenth of the customers have no money")
	assert.Positive(t, r.P50Ms)
	name := regexp.MustCompile(`pgsaga_bench_[0-9a-f]+_payments`).FindString(stderr.String())
	require.NotEmpty(t, name, stderr.String())
	var exists bool
	require.NoError(t, db.SQL.QueryRow(`SELECT EXISTS (SELECT FROM pg_database WHERE datname = $1)`, name).Scan(&exists))
	assert.False(t, exists, "the payment service's database is dropped")
}
