package main

import (
	"context"
	"fmt"
	"regexp"
	"strconv"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/internal/testdb"
	"github.com/pgsaga/pgsaga/internal/testout"
	"github.com/pgsaga/pgsaga/saga/orderpayment"
)

// terminateAll ends every session on database name but the caller's, as
// an operator's pg_terminate_backend does (or a server's fast shutdown,
// before it comes back).
func terminateAll(t *testing.T, name string) {
	t.Helper()
	conn, err := pgx.Connect(context.Background(), testdb.ServerURL())
	require.NoError(t, err)
	defer conn.Close(context.Background())
	var n int
	require.NoError(t, conn.QueryRow(context.Background(), `SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
		WHERE datname = $1 AND pid <> pg_backend_pid()`, name).Scan(&n))
	t.Logf("terminated %d sessions of %s", n, name)
}

// Every session of the database terminated once while the orders are
// placed (the workers', the gateway's, the clients'): the run rides it
// out. It used to end with "placing orders: 7 failed … bad connection"
// and hundreds of sagas left running.
func TestRidesOutTerminatedSessions(t *testing.T) {
	t.Parallel() // beside the package's other runs of the sample
	db := testdb.Fresh(t)
	getenv := env("DATABASE_URL", db.URL)
	var stdout testout.Buffer
	stderr := &testout.DoOn{Want: "placing 200 orders", Do: func() { terminateAll(t, db.Name) }} // progress, with -json
	code := runEnv(context.Background(), getenv, []string{"-orders", "200", "-json", "-timeout", "2m"}, &stdout, stderr)
	require.Equal(t, exitOK, code, "stdout:\n%s\nstderr:\n%s", stdout.String(), testout.Tail(stderr.String(), 20))
	s := lastJSON(t, stdout.String())
	assert.Equal(t, 200, s.Sagas)
	assert.Equal(t, 200, s.Completed+s.Compensated)
	assert.Zero(t, s.Unfinished)
	assert.True(t, s.InvariantsOK, "%v", s.Violations)
}

// A run that stops with sagas unfinished says how many, and the command
// that finishes them: it gives up waiting, it is interrupted, or placing
// the orders fails because the database stopped taking connections.
func TestStopSaysHowToFinish(t *testing.T) {
	t.Parallel() // beside the package's other runs of the sample
	const resume = "go run ./cmd/orderdemo -resume (with DATABASE_URL as for this run)"
	unfinished := func(t *testing.T, db *testdb.DB) int {
		var n int
		require.NoError(t, db.SQL.QueryRow(`SELECT count(*) FROM (`+unfinishedSQL+`) u`, orderpayment.Name).Scan(&n))
		return n
	}
	said := regexp.MustCompile(`(?m)^(\d+) sagas? (?:is|are) unfinished in this database; to finish, run: (.*)$`)

	t.Run("gives up waiting", func(t *testing.T) {
		db := testdb.Fresh(t)
		getenv := env("DATABASE_URL", db.URL)
		var stdout, stderr testout.Buffer
		code := runEnv(context.Background(), getenv, []string{"-orders", "300", "-timeout", "200ms"}, &stdout, &stderr)
		assert.Equal(t, exitFailed, code)
		m := said.FindStringSubmatch(stderr.String())
		require.NotNil(t, m, "stdout:\n%s\nstderr:\n%s", stdout.String(), stderr.String())
		assert.Equal(t, strconv.Itoa(unfinished(t, db)), m[1])
		assert.Equal(t, resume, m[2])
	})

	t.Run("interrupted while waiting", func(t *testing.T) {
		db := testdb.Fresh(t)
		getenv := env("DATABASE_URL", db.URL)
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		var stdout testout.Buffer
		stderr := &testout.DoOn{Want: "sagas 300:", Do: cancel} // progress, with -json
		code := runEnv(ctx, getenv, []string{"-orders", "300", "-json"}, &stdout, stderr)
		assert.Equal(t, exitFailed, code)
		m := said.FindStringSubmatch(stderr.String())
		require.NotNil(t, m, "stdout:\n%s\nstderr:\n%s", stdout.String(), stderr.String())
		assert.Equal(t, strconv.Itoa(unfinished(t, db)), m[1])
		assert.Equal(t, resume, m[2])
		assert.Equal(t, fmt.Sprint(lastJSON(t, stdout.String()).Unfinished), m[1], "as the summary says")
	})

	// The role may no longer log in: its sessions are ended and no new one
	// is let in, so placing fails and nothing can be counted.
	t.Run("the database stops taking connections while placing", func(t *testing.T) {
		url := testdb.Role(t, -1, "s3cr3t")
		getenv := env("DATABASE_URL", url)
		cfg, err := pgx.ParseConfig(url)
		require.NoError(t, err)
		stdout := &testout.DoOn{Want: "placing 200 orders", Do: func() {
			conn, err := pgx.Connect(context.Background(), testdb.ServerURL())
			require.NoError(t, err)
			defer conn.Close(context.Background())
			_, err = conn.Exec(context.Background(), `ALTER ROLE `+pgx.Identifier{cfg.User}.Sanitize()+` NOLOGIN`)
			require.NoError(t, err)
			terminateAll(t, cfg.Database)
		}}
		var stderr testout.Buffer
		code := runEnv(context.Background(), getenv, []string{"-orders", "200", "-timeout", "1m"}, stdout, &stderr)
		assert.Equal(t, exitFailed, code)
		assert.Regexp(t, `(?m)^could not count the unfinished sagas \(.*\); once the database takes connections again, finish them with: `+regexp.QuoteMeta(resume)+`$`,
			stderr.String(), "stdout:\n%s", stdout.String())
	})
}
