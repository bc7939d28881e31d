package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/internal/testdb"
)

// limitedRole creates a role that may hold at most limit connections at
// once, owning a fresh empty database, and returns a URL for that database
// as that role. Both go when the test ends.
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
	_, err = admin.Exec(ctx, fmt.Sprintf("CREATE ROLE %s LOGIN CONNECTION LIMIT %d", pgx.Identifier{role}.Sanitize(), limit))
	require.NoError(t, err)
	t.Cleanup(func() {
		if _, err := admin.Exec(context.Background(), "DROP ROLE "+pgx.Identifier{role}.Sanitize()); err != nil {
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
