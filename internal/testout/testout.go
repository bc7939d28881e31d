// Package testout holds what tests of the programs need to read a run's
// output while it runs.
package testout

import (
	"bytes"
	"context"
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

// Tail is the last n lines of s.
func Tail(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	return strings.Join(lines[max(0, len(lines)-n):], "\n")
}
