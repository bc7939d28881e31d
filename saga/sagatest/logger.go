package sagatest

import (
	"log/slog"
	"os"
	"sync"
	"testing"
)

// LogEnv names the environment variable that makes Logger print
// everything, down to Debug, on stderr: PGSAGA_TEST_LOG=1 go test ….
const LogEnv = "PGSAGA_TEST_LOG"

// Logger returns the logger to give what a test runs (the client's
// ClientConfig.Logger, a churn's, an injector's): it keeps a passing test
// quiet and a failing one explained. Warnings and errors go to t's log,
// which go test prints only for a test that fails (or with -v); Info and
// Debug are dropped, unless LogEnv is set, when everything goes to
// stderr. Records logged once the test is over (a worker still
// stopping) are dropped.
func Logger(t testing.TB) *slog.Logger {
	if os.Getenv(LogEnv) != "" {
		return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug}))
	}
	w := &testWriter{t: t}
	t.Cleanup(w.end) // registered first, so it runs last: after the workers stop
	return slog.New(slog.NewTextHandler(w, &slog.HandlerOptions{Level: slog.LevelWarn}))
}

// testWriter writes lines to a test's log until the test ends.
type testWriter struct {
	mu   sync.Mutex
	t    testing.TB
	done bool
}

func (w *testWriter) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if !w.done {
		w.t.Helper()
		w.t.Log(string(trimNewline(p)))
	}
	return len(p), nil
}

func (w *testWriter) end() {
	w.mu.Lock()
	w.done = true
	w.mu.Unlock()
}

func trimNewline(p []byte) []byte {
	if n := len(p); n > 0 && p[n-1] == '\n' {
		return p[:n-1]
	}
	return p
}
