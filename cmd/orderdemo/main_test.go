package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/internal/testdb"
	"github.com/pgsaga/pgsaga/internal/testout"
	"github.com/pgsaga/pgsaga/internal/testpg"
	"github.com/pgsaga/pgsaga/internal/testsample"
	"github.com/pgsaga/pgsaga/saga"
	"github.com/pgsaga/pgsaga/saga/orderpayment"
)

func TestMain(m *testing.M) {
	// A copy of the test binary started by a test runs the command itself,
	// signals included.
	if args, ok := os.LookupEnv("ORDERDEMO_ARGS"); ok {
		os.Exit(runWithSignals(strings.Fields(args), os.Stdout, os.Stderr))
	}
	// Its slow tests run the sample side by side (t.Parallel), on a server
	// of the package's own: two runs at once take connections the other
	// packages' tests need.
	testpg.MainOwnServer(m, testsample.Schemas()...)
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
	for _, want := range []string{"go run ./cmd/pgsaga", "completed", "compensated", "failed", "latency", "p50", "p99", "time taken", "invariants   all hold"} {
		assert.Contains(t, stdout.String(), want)
	}
}

func TestBadFlags(t *testing.T) {
	t.Parallel()
	for args, want := range map[string]string{
		"-orders -1":                           "-orders must not be negative",
		"-workers 0":                           "-workers must be between 1 and 16",
		"-timeout 0s":                          "-timeout must be positive",
		"-resume -orders 10":                   "-resume places no orders",
		"extra":                                "unexpected arguments",
		"-orders ten":                          "invalid value",
		"-payments-service http://127.0.0.1:1": "unknown broker URL",
		"-no-such-flag":                        "flag provided but not defined",
		"-workers 2 -orders 1e":                "invalid value",
		"-duplicate-rate 1.5":                  "-duplicate-rate must be between 0 and 1",
		"-crash-rate -0.1":                     "-crash-rate must be between 0 and 1",
		"-gateway-fault-rate 2":                "-gateway-fault-rate must be between 0 and 1",
		"-seed -1":                             "invalid value",
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

// The runner is killed with SIGKILL several times at random moments (the
// first run, then the resumes), under chaos; a last -resume finishes every
// saga with every invariant intact.
func TestKillAndResume(t *testing.T) {
	t.Parallel() // beside the package's other runs of the sample
	db := testdb.Fresh(t)
	seed := uint64(time.Now().UnixNano())
	t.Logf("seed %d", seed)
	rng := rand.New(rand.NewPCG(seed, 9))
	chaos := fmt.Sprintf("-duplicate-rate 0.2 -crash-rate 0.1 -gateway-fault-rate 0.05 -seed %d", seed)
	child := func(args string) (*exec.Cmd, *testout.Buffer) {
		cmd := exec.Command(os.Args[0], "-test.run=^$")
		cmd.Env = append(os.Environ(), "ORDERDEMO_ARGS="+args, "DATABASE_URL="+db.URL)
		out := &testout.Buffer{}
		cmd.Stdout, cmd.Stderr = out, out
		return cmd, out
	}
	sagas := func() (total, running int) {
		_ = db.SQL.QueryRow(`SELECT count(*), count(*) FILTER (WHERE status IN ('running', 'compensating')) FROM saga_instances`).Scan(&total, &running)
		return total, running
	}

	args := "-orders 120 -workers 2 " + chaos
	for kill := range 3 {
		_, runningBefore := sagas()
		cmd, out := child(args)
		require.NoError(t, cmd.Start())
		exited := make(chan struct{})
		go func() { _ = cmd.Wait(); close(exited) }()
		// Wait until this process has made progress (started sagas, or
		// finished some it resumed), then a random moment more. A resume
		// may finish everything before that: then there is nothing to kill.
		deadline := time.Now().Add(60 * time.Second)
	progress:
		for {
			total, running := sagas()
			if kill == 0 && total >= 10 && running > 0 || kill > 0 && running < runningBefore {
				break
			}
			select {
			case <-exited:
				break progress
			case <-time.After(5 * time.Millisecond):
			}
			require.True(t, time.Now().Before(deadline), "kill %d: no work in progress:\n%s", kill, out.String())
		}
		select {
		case <-exited:
			t.Logf("kill %d: the process finished first", kill+1)
		case <-time.After(time.Duration(rng.IntN(800)) * time.Millisecond):
			require.NoError(t, cmd.Process.Signal(syscall.SIGKILL))
			<-exited
			total, running := sagas()
			t.Logf("kill %d: %d sagas, %d running", kill+1, total, running)
		}
		args = "-resume " + chaos
	}

	resume, out := child("-resume -json -timeout 90s " + chaos)
	require.NoError(t, resume.Run(), "resume failed:\n%s", out.String())
	s := lastJSON(t, out.String())
	assert.True(t, s.Resumed)
	assert.True(t, s.InvariantsOK, "%v", s.Violations)
	assert.Zero(t, s.Unfinished)
	assert.NotNil(t, s.Chaos)

	r, err := orderpayment.Check(context.Background(), db.SQL, nil)
	require.NoError(t, err)
	assert.True(t, r.OK(), "%v", r.Violations)
	assert.Zero(t, r.Sagas[saga.StatusRunning]+r.Sagas[saga.StatusCompensating])
}

// A resume with nothing to do reports nothing, not every saga in the
// database.
func TestResumeWithNothingToDo(t *testing.T) {
	db := testdb.Fresh(t)
	t.Setenv("DATABASE_URL", db.URL)
	var stdout, stderr bytes.Buffer
	require.Equal(t, exitOK, run(context.Background(), []string{"-orders", "5", "-json"}, &stdout, &stderr), stderr.String())
	for _, args := range [][]string{{"-resume", "-json"}, {"-orders", "0", "-json"}} {
		stdout.Reset()
		require.Equal(t, exitOK, run(context.Background(), args, &stdout, &stderr), "%v: %s", args, stderr.String())
		s := lastJSON(t, stdout.String())
		assert.Zero(t, s.Sagas, "%v", args)
		assert.Zero(t, s.Completed+s.Compensated+s.Unfinished, "%v", args)
	}
}

// env is an environment for runEnv: the databases it names (kv: name,
// value, …; the others unset), and the process's for everything else.
func env(kv ...string) func(string) string {
	vars := map[string]string{"DATABASE_URL": "", paymentsDatabaseEnv: ""}
	for i := 0; i+1 < len(kv); i += 2 {
		vars[kv[i]] = kv[i+1]
	}
	return func(name string) string {
		if v, ok := vars[name]; ok {
			return v
		}
		return os.Getenv(name)
	}
}
