package main

import (
	"context"
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
)

// A run whose role may open too few connections ends at once with the
// cause, exit 1 or 3 depending on which step hit the limit first (usually a
// worker's start, or placing the orders); it used to wait forever for a
// worker that could not start, deaf to SIGTERM and -timeout.
func TestTooFewConnectionsEndTheRun(t *testing.T) {
	t.Setenv("DATABASE_URL", testdb.LimitedRole(t, 3))
	var stdout, stderr testout.Buffer
	done := make(chan int, 1)
	start := time.Now()
	go func() {
		done <- run(context.Background(), []string{"-orders", "5", "-timeout", "1m"}, &stdout, &stderr)
	}()
	bound, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	select {
	case code := <-done:
		t.Logf("exit %d after %s: %s", code, time.Since(start).Round(time.Millisecond), lastLine(stderr.String(), "orderdemo:"))
		assert.Contains(t, []int{exitFailed, exitNoService}, code)
		assert.Contains(t, lastLine(stderr.String(), "orderdemo:"), "too many connections for role", "the cause is named")
	case <-bound.Done():
		t.Fatalf("run did not return within 30s:\nstdout:\n%s\nstderr:\n%s", stdout.String(), testout.Tail(stderr.String(), 5))
	}
}

// lastLine is the last line of s that starts with prefix.
func lastLine(s, prefix string) string {
	lines := strings.Split(s, "\n")
	for i := len(lines) - 1; i >= 0; i-- {
		if strings.HasPrefix(lines[i], prefix) {
			return lines[i]
		}
	}
	return ""
}

// SIGTERM stops a run as SIGINT does, while it waits for the sagas (the
// workers stop, the report says what finished) or while it places the
// orders; either way the exit status is 1 and the output says to resume.
func TestSIGTERMStopsTheRun(t *testing.T) {
	t.Parallel() // beside the package's other runs of the sample
	for name, c := range map[string]struct{ args, when, says string }{
		"waiting": {"-orders 400 -timeout 2m", "sagas 400:", "invariants"},
		"placing": {"-orders 5000 -timeout 2m", "placing 5000 orders", "interrupted while placing the orders"},
	} {
		t.Run(name, func(t *testing.T) {
			db := testdb.Fresh(t)
			cmd := exec.Command(os.Args[0], "-test.run=^$")
			cmd.Env = append(os.Environ(), "ORDERDEMO_ARGS="+c.args, "DATABASE_URL="+db.URL)
			out := &testout.Buffer{}
			cmd.Stdout, cmd.Stderr = out, out
			require.NoError(t, cmd.Start())
			exited := make(chan error, 1)
			go func() { exited <- cmd.Wait() }()

			bound, cancel := context.WithTimeout(context.Background(), 60*time.Second)
			defer cancel()
			out.WaitFor(bound, t, c.when)
			require.NoError(t, cmd.Process.Signal(syscall.SIGTERM))
			sent := time.Now()
			stopBound, cancelStop := context.WithTimeout(context.Background(), 15*time.Second)
			defer cancelStop()
			select {
			case err := <-exited:
				t.Logf("exited %s after SIGTERM", time.Since(sent).Round(time.Millisecond))
				var exit *exec.ExitError
				require.ErrorAs(t, err, &exit, "output:\n%s", out.String())
				assert.Equal(t, exitFailed, exit.ExitCode(), "output:\n%s", out.String())
				assert.Contains(t, out.String(), "interrupted")
				assert.Contains(t, out.String(), c.says)
				assert.Contains(t, out.String(), "-resume")
				assert.NotContains(t, out.String(), "context canceled", "an interruption is no failure")
			case <-stopBound.Done():
				_ = cmd.Process.Kill()
				t.Fatalf("still running 15s after SIGTERM:\n%s", testout.Tail(out.String(), 10))
			}
		})
	}
}

// Nothing the program prints shows the database password, whatever form
// the connection string takes, in a run or in a failure. (Each run's role
// has the password shown: a server that checks passwords accepts it, one
// that trusts local connections ignores it.)
func TestNoPasswordInOutput(t *testing.T) {
	plain := testdb.Role(t, -1, "s3cr3t")
	quoted := testdb.Role(t, -1, `pa55 w'0rd`)
	for name, c := range map[string]struct {
		url    string
		args   []string
		code   int
		secret []string
	}{
		"url userinfo":   {plain, []string{"-orders", "1"}, exitOK, []string{"s3cr3t"}},
		"url query":      {testdb.WithoutPassword(t, plain) + "&password=s3cr3t", []string{"-orders", "1", "-v"}, exitOK, []string{"s3cr3t"}},
		"keyword plain":  {testdb.Keywords(t, plain) + " password=s3cr3t", []string{"-orders", "1", "-json"}, exitOK, []string{"s3cr3t"}},
		"keyword quoted": {testdb.Keywords(t, quoted) + ` password='pa55 w\'0rd'`, []string{"-orders", "1"}, exitOK, []string{"pa55", "0rd"}},
		"bad port":       {`host=127.0.0.1 port=notaport user=postgres password='pa55 w\'0rd'`, []string{"-orders", "1"}, exitNoService, []string{"pa55", "0rd"}},
		"refused":        {`host=127.0.0.1 port=1 user=postgres password='pa55 w\'0rd' connect_timeout=2`, []string{"-orders", "1"}, exitNoService, []string{"pa55", "0rd"}},
		"unparsable":     {`host=127.0.0.1 user=postgres password='pa55 w\'0rd`, []string{"-orders", "1"}, exitNoService, []string{"pa55", "0rd"}},
	} {
		t.Run(name, func(t *testing.T) {
			t.Setenv("DATABASE_URL", c.url)
			var stdout, stderr testout.Buffer // with -v, Watermill logs "Subscriber stopped" after its Close returns
			code := run(context.Background(), c.args, &stdout, &stderr)
			all := stdout.String() + stderr.String()
			assert.Equal(t, c.code, code, all)
			for _, s := range c.secret {
				assert.NotContains(t, all, s)
			}
			t.Logf("%s", testout.Tail(all, 2))
		})
	}
}

// cancelOn cancels a run's context the moment its output holds a line with
// want, before the run writes anything more.
type cancelOn struct {
	testout.Buffer
	want   string
	cancel context.CancelFunc
}

func (c *cancelOn) Write(p []byte) (int, error) {
	n, err := c.Buffer.Write(p)
	if strings.Contains(string(p), c.want) {
		c.cancel()
	}
	return n, err
}

// An interruption that comes between two orders, while no order is being
// placed, is still an interruption while placing: the run used to count
// the orders it never placed as placed, wait for sagas that do not exist
// and report them as "never started", a broken invariant.
func TestInterruptedBetweenOrders(t *testing.T) {
	t.Setenv("DATABASE_URL", testdb.Fresh(t).URL)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	stdout := &cancelOn{want: "placing 50 orders", cancel: cancel}
	var stderr testout.Buffer
	code := run(ctx, []string{"-orders", "50", "-timeout", "1m"}, stdout, &stderr)
	all := stdout.String() + stderr.String()
	assert.Equal(t, exitFailed, code, all)
	assert.Contains(t, all, "interrupted while placing the orders", all)
	assert.NotContains(t, all, "invariants", "no report for orders never placed")
	assert.NotContains(t, all, "never started")
}
