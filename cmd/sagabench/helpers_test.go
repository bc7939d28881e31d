package main

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/internal/testdb"
)

// limitedRole creates a role that may create databases and hold at most
// limit connections at once, owning a fresh empty database, and returns a
// URL for that database as that role. The role goes when the test ends,
// with every database it owns.
func limitedRole(t *testing.T, limit int) string {
	t.Helper()
	ctx := context.Background()
	server := testdb.ServerURL()
	admin, err := pgx.Connect(ctx, server)
	require.NoError(t, err)
	t.Cleanup(func() { _ = admin.Close(context.Background()) })
	suffix := make([]byte, 4)
	_, _ = rand.Read(suffix)
	role := "pgsaga_test_limited_" + hex.EncodeToString(suffix)
	_, err = admin.Exec(ctx, fmt.Sprintf("CREATE ROLE %s LOGIN CREATEDB CONNECTION LIMIT %d", pgx.Identifier{role}.Sanitize(), limit))
	require.NoError(t, err)
	t.Cleanup(func() {
		ctx := context.Background()
		rows, _ := admin.Query(ctx, `SELECT datname FROM pg_database WHERE datdba = (SELECT oid FROM pg_roles WHERE rolname = $1)`, role)
		owned, _ := pgx.CollectRows(rows, pgx.RowTo[string])
		for _, db := range owned {
			_, _ = admin.Exec(ctx, "DROP DATABASE IF EXISTS "+pgx.Identifier{db}.Sanitize()+" WITH (FORCE)")
		}
		if _, err := admin.Exec(ctx, "DROP ROLE "+pgx.Identifier{role}.Sanitize()); err != nil {
			t.Errorf("dropping role %s: %v", role, err)
		}
	})
	db := testdb.Empty(t) // dropped before the role: cleanups run last first
	_, err = admin.Exec(ctx, "ALTER DATABASE "+pgx.Identifier{db.Name}.Sanitize()+" OWNER TO "+pgx.Identifier{role}.Sanitize())
	require.NoError(t, err)
	cfg, err := pgx.ParseConfig(server)
	require.NoError(t, err)
	return fmt.Sprintf("postgres://%s@%s:%d/%s?sslmode=disable", role, cfg.Host, cfg.Port, db.Name)
}

// lockedBuffer is a buffer a run writes while the test reads it.
type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// tail is the last n lines of s.
func tail(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	return strings.Join(lines[max(0, len(lines)-n):], "\n")
}

// waitFor waits until out holds want, or fails the test when ctx ends.
func waitFor(ctx context.Context, t *testing.T, out *lockedBuffer, want string) {
	t.Helper()
	tick := time.NewTicker(10 * time.Millisecond)
	defer tick.Stop()
	for !strings.Contains(out.String(), want) {
		select {
		case <-ctx.Done():
			t.Fatalf("no %q in the output:\n%s", want, out.String())
		case <-tick.C:
		}
	}
}
