// Package testout holds what tests need of output: a run's, read while it
// runs, and their own logs.
package testout

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"os"
	"os/exec"
	"strings"
	"sync"
	"testing"
	"time"
)

// Buffer is a buffer a run (or a child process) writes while the test
// reads it.
type Buffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

// Write appends p.
func (l *Buffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

// String is everything written so far.
func (l *Buffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// WaitFor waits until the buffer holds want, or fails the test when ctx
// ends.
func (l *Buffer) WaitFor(ctx context.Context, t testing.TB, want string) {
	t.Helper()
	tick := time.NewTicker(10 * time.Millisecond)
	defer tick.Stop()
	for !strings.Contains(l.String(), want) {
		select {
		case <-ctx.Done():
			t.Fatalf("no %q in the output:\n%s", want, l.String())
		case <-tick.C:
		}
	}
}

// DoOn is a Buffer that runs Do, once, the moment a write holds Want,
// before the run that writes goes on: a test acts at a stage of a run it
// reads.
type DoOn struct {
	Buffer
	Want string
	Do   func()
	once sync.Once
}

// Write appends p, then runs Do if p holds Want for the first time.
func (d *DoOn) Write(p []byte) (int, error) {
	n, err := d.Buffer.Write(p)
	if strings.Contains(string(p), d.Want) {
		d.once.Do(d.Do)
	}
	return n, err
}

// Tail is the last n lines of s.
func Tail(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	return strings.Join(lines[max(0, len(lines)-n):], "\n")
}

// Logger is the logger a test hands to what it runs: silent, or, with
// PGSAGA_TEST_LOG set, everything down to Debug on stderr.
func Logger() *slog.Logger {
	if os.Getenv("PGSAGA_TEST_LOG") != "" {
		return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug}))
	}
	return slog.New(slog.DiscardHandler)
}

// Program runs a copy of the test binary, with env added to the
// environment, as the program under test (the package's TestMain runs the
// program when env says so: ORDERDEMO_ARGS=…, say), and returns its exit
// status and all it wrote to stdout and stderr. It gives the program a
// minute.
func Program(t testing.TB, env ...string) (code int, output string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), env...)
	out, err := cmd.CombinedOutput()
	var exit *exec.ExitError
	if err != nil && !errors.As(err, &exit) {
		t.Fatalf("running the program: %v\n%s", err, out)
	}
	return cmd.ProcessState.ExitCode(), string(out)
}

// Hides fails the test for each of secrets that something shown holds:
// a string (output, a description) or an error's message (a nil error
// shows nothing).
func Hides(t testing.TB, secrets []string, shown ...any) {
	t.Helper()
	for _, v := range shown {
		var text string
		switch v := v.(type) {
		case string:
			text = v
		case error:
			text = v.Error()
		case nil:
			continue
		default:
			t.Fatalf("testout.Hides: a %T is no string or error", v)
		}
		for _, s := range secrets {
			if strings.Contains(text, s) {
				t.Errorf("%q shows %q", text, s)
			}
		}
	}
}
