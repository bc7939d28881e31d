package migrations_test

import (
	"context"
	"io/fs"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/internal/pgdb"
	"github.com/pgsaga/pgsaga/internal/testdb"
	"github.com/pgsaga/pgsaga/migrations"
)

type sqlDB = pgdb.DB

func sqlOpen(url string) (*pgdb.DB, error) {
	return pgdb.Open(context.Background(), pgdb.Config{URL: url, MaxConns: 4, ApplicationName: "pgsaga-migrations-test"})
}

// schemaFingerprint lists every column and index of the public schema.
func schemaFingerprint(t *testing.T, db *testdb.DB) string {
	t.Helper()
	rows, err := db.SQL.Query(`
		SELECT table_name || '.' || column_name || ':' || data_type
		FROM information_schema.columns WHERE table_schema = 'public'
		UNION ALL
		SELECT indexdef FROM pg_indexes WHERE schemaname = 'public'
		ORDER BY 1`)
	require.NoError(t, err)
	defer rows.Close()
	var b strings.Builder
	for rows.Next() {
		var s string
		require.NoError(t, rows.Scan(&s))
		b.WriteString(s + "\n")
	}
	require.NoError(t, rows.Err())
	return b.String()
}

// assertEachVersionOnce fails if any migration version was recorded twice.
func assertEachVersionOnce(t *testing.T, db *testdb.DB) {
	t.Helper()
	var dup int
	require.NoError(t, db.SQL.QueryRow(`
		SELECT count(*) FROM (
			SELECT version_id FROM `+migrations.VersionTable+`
			WHERE is_applied GROUP BY version_id HAVING count(*) > 1
		) d`).Scan(&dup))
	require.Zero(t, dup, "a migration version was recorded more than once")
}

func countSources(t *testing.T) int {
	t.Helper()
	names, err := fs.Glob(migrations.FS(), "*.sql")
	require.NoError(t, err)
	return len(names)
}
