package finddb

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"

	"github.com/pgsaga/pgsaga/internal/flock"
	"github.com/pgsaga/pgsaga/internal/pgdb"
)

// The embedded server of pgsaga's own tests.
const (
	testProbeURL = "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable"
	testPort     = 54330
	testDir      = "test-postgres"
)

// TestServer starts the embedded server of pgsaga's own tests, or finds it
// running, and returns its admin URL (testpg's fallback): its data apart
// from the sample's, on a port of its own.
func TestServer(ctx context.Context) (string, error) {
	cache, err := os.UserCacheDir()
	if err != nil {
		cache = os.TempDir()
	}
	dir := filepath.Join(cache, "pgsaga", testDir)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return "", fmt.Errorf("creating %s for an embedded PostgreSQL: %w", dir, err)
	}
	// Every test package runs in a process of its own, most at once: one
	// starts the server while the others wait, then find it running.
	unlock, err := flock.Lock(filepath.Join(dir, "start.lock"))
	if err != nil {
		return "", err
	}
	defer unlock()
	found, err := Find(ctx, Config{
		Getenv:       func(string) string { return "" },
		ProbeURL:     testProbeURL,
		Database:     "postgres",
		EmbeddedDir:  dir,
		EmbeddedPort: testPort,
		Logger:       slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn})),
	})
	if err != nil {
		return "", fmt.Errorf("%w (the tests look for TEST_DATABASE_URL, then DATABASE_URL, then %s, then start an embedded PostgreSQL)", err, pgdb.Describe(testProbeURL))
	}
	// Never closed: the server outlives this process for the other test
	// packages of the run and for later runs.
	// One line, in every package: go test shows it only for packages that
	// fail, and then it matters.
	fmt.Fprintf(os.Stderr, "testdb: no PostgreSQL at 127.0.0.1:5432; testing on an embedded one (%s, port %d), left running for later runs; stop it with `pg_ctl stop -D %s`; its password is in %s\n",
		found.Detail, testPort, filepath.Join(dir, "data"), filepath.Join(dir, "data", "pgsaga-superuser-password"))
	return found.URL, nil
}
