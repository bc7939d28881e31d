package main

import (
	"bytes"
	"net/url"
	"os/exec"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/internal/testdb"
	"github.com/pgsaga/pgsaga/migrations"
)

// noDatabaseConfigured clears every way of naming a database, and points
// the user's cache (where a running sample's embedded server would be
// found) at an empty directory.
func noDatabaseConfigured(t *testing.T) {
	t.Helper()
	t.Setenv("DATABASE_URL", "")
	for _, v := range libpqEnv {
		t.Setenv(v, "")
	}
	t.Setenv("XDG_CACHE_HOME", t.TempDir())
}

// With no database configured (no flag, no DATABASE_URL, no PG*
// variable, no running sample), a command says so and how to name one,
// and exits 1: it neither probes the local server nor creates a database
// on it, though one listens here on 127.0.0.1:5432.
func TestNoDatabaseConfiguredCreatesNothing(t *testing.T) {
	noDatabaseConfigured(t)
	for _, args := range [][]string{{"sagas"}, {"migrate"}, {"migrate", "--dry-run"}, {"version"}} {
		code, out, errOut := pgsaga(t, args...)
		assert.Equal(t, exitFailed, code, "%v: %s", args, out)
		assert.Contains(t, errOut, "no database configured", "%v", args)
		assert.Contains(t, errOut, "--database-url", "%v", args)
		assert.Contains(t, errOut, "DATABASE_URL", "%v", args)
		assert.Contains(t, errOut, "PGHOST", "%v", args)
	}
}

// --database-url names the database, ahead of DATABASE_URL.
func TestDatabaseURLFlagComesFirst(t *testing.T) {
	empty := emptyDatabase(t)
	t.Setenv("DATABASE_URL", "postgres://postgres@127.0.0.1:1/nowhere?sslmode=disable&connect_timeout=2")
	code, out, errOut := pgsaga(t, "--database-url", empty, "version")
	require.Equal(t, exitOK, code, errOut)
	assert.Contains(t, out, "run pgsaga migrate")
	code, _, errOut = pgsaga(t, "version", "--database-url", empty) // after the command too
	require.Equal(t, exitOK, code, errOut)

	code, _, errOut = pgsaga(t, "version")
	assert.Equal(t, exitFailed, code, "DATABASE_URL without the flag")
	assert.Contains(t, errOut, "named by DATABASE_URL")
}

// Without --database-url or DATABASE_URL, the PG* variables name the
// database, as they do for libpq (psql, pg_dump).
func TestPGVariablesNameTheDatabase(t *testing.T) {
	noDatabaseConfigured(t)
	u, err := url.Parse(emptyDatabase(t))
	require.NoError(t, err)
	t.Setenv("PGHOST", u.Hostname())
	t.Setenv("PGPORT", u.Port())
	t.Setenv("PGUSER", u.User.Username())
	if pw, ok := u.User.Password(); ok {
		t.Setenv("PGPASSWORD", pw)
	}
	t.Setenv("PGDATABASE", strings.TrimPrefix(u.Path, "/"))
	t.Setenv("PGSSLMODE", "disable")
	code, out, errOut := pgsaga(t, "migrate")
	require.Equal(t, exitOK, code, errOut)
	assert.Contains(t, out, "applied")
	current, known, err := migrations.Version(t.Context(), testdb.Open(t, u.String(), 2).SQL)
	require.NoError(t, err)
	assert.Equal(t, known, current, "migrated the database the PG* variables name")
}

// A command that needs pgsaga's tables, on a database without them, says
// so and leaves the database as it was: not even the version table is
// created.
func TestReadingAnEmptyDatabaseCreatesNothing(t *testing.T) {
	empty := emptyDatabase(t)
	for _, args := range [][]string{{"sagas"}, {"version"}, {"dead-letters"}} {
		code, _, errOut := pgsaga(t, append([]string{"--database-url", empty}, args...)...)
		if args[0] == "version" {
			assert.Equal(t, exitOK, code, errOut)
		} else {
			assert.Equal(t, exitFailed, code, "%v", args)
			assert.Contains(t, errOut, "holds no pgsaga schema", "%v", args)
		}
	}
	assert.Zero(t, tablesIn(t, empty), "nothing created")
}

// migrate --dry-run --show-sql on an empty database prints every pending
// migration's SQL, in order, with the bookkeeping that records it, and
// creates nothing; migrate --show-sql prints what it applies.
func TestMigrateDryRunShowsTheSQLAndCreatesNothing(t *testing.T) {
	empty := emptyDatabase(t)
	code, out, errOut := pgsaga(t, "--database-url", empty, "migrate", "--dry-run", "--show-sql")
	require.Equal(t, exitOK, code, errOut)
	assert.Zero(t, tablesIn(t, empty), "a dry run creates nothing")
	assert.Contains(t, out, "CREATE TABLE idempotency_keys")
	assert.Contains(t, out, "CREATE TABLE IF NOT EXISTS "+migrations.VersionTable)
	assert.Contains(t, out, "CREATE INDEX CONCURRENTLY")
	first, last := strings.Index(out, "00001_idempotency_keys.sql"), strings.Index(out, "00018_concurrent_indexes.sql")
	assert.True(t, first >= 0 && last > first, "every migration, in order")
	assert.NotContains(t, out, "+goose", "goose's annotations are not SQL")
	assert.NotContains(t, out, "DROP INDEX CONCURRENTLY IF EXISTS saga_requests_done_idx", "no Down section")

	code, out, errOut = pgsaga(t, "--database-url", empty, "migrate", "--dry-run")
	require.Equal(t, exitOK, code, errOut)
	assert.Contains(t, out, "would apply")
	assert.NotContains(t, out, "CREATE TABLE")
	assert.Zero(t, tablesIn(t, empty))

	code, out, errOut = pgsaga(t, "--database-url", empty, "migrate", "--show-sql")
	require.Equal(t, exitOK, code, errOut)
	assert.Contains(t, out, "CREATE TABLE idempotency_keys", "shown as applied")
	assert.Contains(t, out, "applied")
	code, out, errOut = pgsaga(t, "--database-url", empty, "migrate", "--dry-run", "--show-sql")
	require.Equal(t, exitOK, code, errOut)
	assert.Contains(t, out, "up to date")
	assert.NotContains(t, out, "CREATE")
}

// The SQL migrate --dry-run --show-sql prints, applied by a team's own
// tool (psql here), leaves the database as migrate would: up to date, so
// that pgsaga and its workers find nothing to apply.
func TestTheShownSQLAppliedByAnotherToolIsUpToDate(t *testing.T) {
	psql, err := exec.LookPath("psql")
	if err != nil {
		t.Skip("psql is not installed")
	}
	empty := emptyDatabase(t)
	code, shown, errOut := pgsaga(t, "--database-url", empty, "migrate", "--dry-run", "--show-sql")
	require.Equal(t, exitOK, code, errOut)
	cmd := exec.Command(psql, "-X", "-q", "-v", "ON_ERROR_STOP=1", "-d", empty, "-f", "-")
	cmd.Stdin = strings.NewReader(shown)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	require.NoError(t, cmd.Run(), stderr.String())

	current, known, err := migrations.Version(t.Context(), testdb.Open(t, empty, 2).SQL)
	require.NoError(t, err)
	assert.Equal(t, known, current)
	code, out, errOut := pgsaga(t, "--database-url", empty, "migrate")
	require.Equal(t, exitOK, code, errOut)
	assert.Contains(t, out, "up to date")
}

// A PG* variable that only says how to connect (PGSSLMODE, PGAPPNAME,
// PGPASSWORD, often set in a profile) names no database: pgsaga does not
// connect to libpq's defaults for it, and says no database is configured.
func TestAPGVariableThatNamesNoDatabaseIsNotOne(t *testing.T) {
	noDatabaseConfigured(t)
	for _, v := range []string{"PGAPPNAME", "PGPASSWORD"} {
		t.Setenv(v, "x")
	}
	t.Setenv("PGSSLMODE", "disable")
	t.Setenv("PGCONNECT_TIMEOUT", "2")
	code, _, errOut := pgsaga(t, "version")
	assert.Equal(t, exitFailed, code, errOut)
	assert.Contains(t, errOut, "no database configured")
}

// A database missing a version below its newest (a row deleted, a
// migration added out of order) is refused by migrate; its dry run and
// its SQL refuse it too, instead of listing what migrate would not apply.
func TestTheDryRunRefusesWhatMigrateRefuses(t *testing.T) {
	db := emptyDatabase(t)
	code, _, errOut := pgsaga(t, "--database-url", db, "migrate")
	require.Equal(t, exitOK, code, errOut)
	_, err := testdb.Open(t, db, 2).SQL.Exec(`DELETE FROM ` + migrations.VersionTable + ` WHERE version_id = 3`)
	require.NoError(t, err)
	for _, args := range [][]string{{"migrate", "--dry-run"}, {"migrate", "--dry-run", "--show-sql"}, {"migrate"}} {
		code, out, errOut := pgsaga(t, append([]string{"--database-url", db}, args...)...)
		assert.Equal(t, exitFailed, code, "%v: %s", args, out)
		assert.Contains(t, errOut, "version 3", "%v", args)
	}
}

// The shown SQL, applied as the help says (psql -v ON_ERROR_STOP=1), on a
// database where one migration fails, stops there: nothing after it is
// recorded as applied (the NO TRANSACTION migration's row included), so
// that migrate, once the cause is fixed, applies the rest.
func TestTheShownSQLStopsAtAFailedMigration(t *testing.T) {
	psql, err := exec.LookPath("psql")
	if err != nil {
		t.Skip("psql is not installed")
	}
	db := emptyDatabase(t)
	sqlDB := testdb.Open(t, db, 2).SQL
	_, err = sqlDB.Exec(`CREATE TABLE saga_requests (x int)`) // migration 12 fails on it
	require.NoError(t, err)
	code, shown, errOut := pgsaga(t, "--database-url", db, "migrate", "--dry-run", "--show-sql")
	require.Equal(t, exitOK, code, errOut)
	cmd := exec.Command(psql, "-X", "-q", "-v", "ON_ERROR_STOP=1", "-d", db)
	cmd.Stdin = strings.NewReader(shown)
	out, err := cmd.CombinedOutput()
	require.Error(t, err, "psql stops at the failed migration: %s", out)
	var newest int64
	require.NoError(t, sqlDB.QueryRow(`SELECT max(version_id) FROM `+migrations.VersionTable).Scan(&newest))
	assert.Equal(t, int64(11), newest, "recorded up to the last migration that applied")
}

// A connection that fails prints one line a person reads: pgx's error
// spreads over lines (":\n\t" before each address tried), and those line
// breaks are spaces on the line, not escapes.
func TestAFailedConnectionIsOneReadableLine(t *testing.T) {
	noDatabaseConfigured(t)
	t.Setenv("PGHOST", "127.0.0.1")
	t.Setenv("PGPORT", "1")
	t.Setenv("PGCONNECT_TIMEOUT", "2")
	code, _, errOut := pgsaga(t, "sagas")
	assert.Equal(t, exitFailed, code, errOut)
	assert.Contains(t, errOut, "connection refused")
	assert.NotContains(t, errOut, `\n`, "no escaped line break")
	assert.NotContains(t, errOut, `\t`, "no escaped tab")
	assert.Equal(t, 1, strings.Count(strings.TrimRight(errOut, "\n"), "\n")+1, "one line: %q", errOut)
}
