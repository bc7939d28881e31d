package main

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/internal/testdb"
	"github.com/pgsaga/pgsaga/internal/testout"
)

// A run whose role may not open the connections it needs ends at once,
// saying so. With 14 it used to seed the customers, then wait forever for
// a worker that could not start, deaf to SIGTERM and -timeout.
func TestTooFewConnectionsEndTheRun(t *testing.T) {
	for _, limit := range []int{3, 14} {
		t.Run(fmt.Sprintf("limit %d", limit), func(t *testing.T) {
			args := []string{"-sagas", "100", "-rate", "0", "-baseline", "0", "-idle", "0", "-timeout", "1m"}
			// The server must have the connections the run needs, so that
			// the role's limit is what stops it: with other packages'
			// tests holding connections, the server's own shortage was
			// named instead (one clean CI run).
			need := takeTurn(t, args)
			t.Setenv("DATABASE_URL", testdb.LimitedRole(t, limit))
			// Tests of other packages (and checkouts) may still take the
			// spare connections between the turn's count and the run's
			// own: the run then names the server's shortage, not the
			// role's, and runs again once they are free (a -count=3 run of
			// ./..., 56 free of the 68 needed).
			for attempt := 1; ; attempt++ {
				code, last := runBounded(t, args, 30*time.Second)
				if strings.Contains(last, "connections but the server has") && attempt < 5 {
					testdb.FreeConnections(t, need+4)
					continue
				}
				assert.Equal(t, exitNoService, code)
				assert.Regexp(t, `CONNECTION LIMIT|too many connections for role`, last, "the cause is named")
				break
			}
		})
	}
}

// runBounded runs the program with args, failing the test if it has not
// returned within bound, and returns its exit status and the last line of
// its stderr.
func runBounded(t *testing.T, args []string, bound time.Duration) (code int, last string) {
	t.Helper()
	var stdout, stderr testout.Buffer
	done := make(chan int, 1)
	start := time.Now()
	go func() {
		done <- run(context.Background(), args, &stdout, &stderr)
	}()
	select {
	case code = <-done:
	case <-time.After(bound):
		t.Fatalf("run did not return within %s:\nstderr:\n%s", bound, testout.Tail(stderr.String(), 5))
	}
	last = testout.Tail(stderr.String(), 1)
	t.Logf("exit %d after %s: %s", code, time.Since(start).Round(time.Millisecond), last)
	return code, last
}

// SIGTERM stops a run as SIGINT does: the phase stops, the workers stop,
// the figures so far are printed and the exit status is 1.
func TestSIGTERMStopsTheRun(t *testing.T) {
	const args = "-sagas 100000 -inflight 16 -consumers 1 -rate 0 -baseline 0 -idle 0"
	takeTurn(t, strings.Fields(args))
	db := testdb.Shared(t)
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), "SAGABENCH_ARGS="+args, "DATABASE_URL="+db.URL)
	out := &testout.Buffer{}
	cmd.Stdout, cmd.Stderr = out, out
	require.NoError(t, cmd.Start())
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()

	bound, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	out.WaitFor(bound, t, "placed ") // the throughput phase's progress
	require.NoError(t, cmd.Process.Signal(syscall.SIGTERM))
	sent := time.Now()
	stopBound, cancelStop := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancelStop()
	select {
	case err := <-exited:
		t.Logf("exited %s after SIGTERM", time.Since(sent).Round(time.Millisecond))
		var exit *exec.ExitError
		require.ErrorAs(t, err, &exit, "output:\n%s", out.String())
		assert.Equal(t, exitFailed, exit.ExitCode(), "output:\n%s", testout.Tail(out.String(), 10))
		assert.Contains(t, out.String(), "interrupted")
		assert.Contains(t, out.String(), `"ok":false`, "the figures are printed")
	case <-stopBound.Done():
		_ = cmd.Process.Kill()
		t.Fatalf("still running 30s after SIGTERM:\n%s", testout.Tail(out.String(), 10))
	}
	name := regexp.MustCompile(`pgsaga_bench_[0-9a-f]+`).FindString(out.String())
	var exists bool
	require.NoError(t, db.SQL.QueryRow(`SELECT EXISTS (SELECT FROM pg_database WHERE datname = $1)`, name).Scan(&exists))
	assert.False(t, exists, "the benchmark database is dropped")
}

// A -cpuprofile that cannot be written is a bad flag, found before any
// work: it used to surface after the seeding, as a failed run.
func TestUnwritableProfileIsAUsageError(t *testing.T) {
	t.Setenv("DATABASE_URL", testdb.Shared(t).URL)
	dir := t.TempDir()
	for _, args := range [][]string{
		{"-cpuprofile", filepath.Join(dir, "no-such-dir", "cpu.prof")},
		{"-cpuprofile", dir}, // a directory
		{"-cpuprofile", filepath.Join(dir, "cpu.prof"), "-sagas", "0", "-rate", "10"}, // nothing to profile
	} {
		var stdout, stderr bytes.Buffer
		start := time.Now()
		small := []string{"-sagas", "10", "-rate", "0", "-baseline", "0", "-idle", "0"} // args come later and win
		code := run(context.Background(), append(small, args...), &stdout, &stderr)
		assert.Equal(t, exitUsage, code, "%v: %s", args, stderr.String())
		assert.Contains(t, stderr.String(), "-cpuprofile", args)
		assert.NotContains(t, stderr.String(), "seeding", "%v: found before any work", args)
		assert.Less(t, time.Since(start), 5*time.Second, args)
	}
	// A writable path is left as it was found: no file yet.
	var stderr bytes.Buffer
	path := filepath.Join(dir, "cpu.prof")
	_, err := parseFlags([]string{"-cpuprofile", path}, &stderr)
	require.NoError(t, err)
	assert.NoFileExists(t, path)
}

// A flag that does not parse costs one line naming it and pointing at -h,
// not the whole usage.
func TestFlagErrorIsOneLine(t *testing.T) {
	t.Parallel()
	for args, flag := range map[string]string{
		"-no-such-flag": "-no-such-flag",
		"-sagas many":   "-sagas",
		"-keep=maybe":   "-keep",
	} {
		var stdout, stderr bytes.Buffer
		assert.Equal(t, exitUsage, run(context.Background(), strings.Fields(args), &stdout, &stderr), args)
		msg := stderr.String()
		assert.Equal(t, 1, strings.Count(msg, "\n"), "%s: %q", args, msg)
		assert.Contains(t, msg, flag, args)
		assert.Contains(t, msg, "sagabench -h", args)
	}
}
