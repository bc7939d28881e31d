// Package ownserver tests testdb.MainOwnServer from a package that uses it.
package ownserver

import (
	"context"
	"os"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/internal/pgbin"
	"github.com/pgsaga/pgsaga/internal/testdb"
	"github.com/pgsaga/pgsaga/internal/testpg"
)

func TestMain(m *testing.M) { testpg.MainOwnServer(m) }

// runServer connects to the server the other packages of the run test on,
// found as testdb finds it, or skips where that is an embedded one.
func runServer(t *testing.T) *pgx.Conn {
	t.Helper()
	url := testdb.DefaultURL
	for _, env := range []string{"TEST_DATABASE_URL", "DATABASE_URL"} {
		if v := os.Getenv(env); v != "" {
			url = v
			break
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		t.Skipf("the run's server is not one this test can reach: %v", err)
	}
	t.Cleanup(func() { _ = conn.Close(context.Background()) })
	return conn
}

// A server-wide turn in a package on a server of its own waits for no test
// of another package: here one holds a share of the run's server
// throughout. On the run's server the turn waited for it (the package's
// runs and the sample's tests took turns, and outlasted go test's ten
// minutes at -count=3).
func TestATurnWaitsForNoOtherPackage(t *testing.T) {
	if pgbin.Find() == "" {
		t.Skip("no PostgreSQL server binaries: MainOwnServer tests on the run's server")
	}
	other := runServer(t)
	var own string
	require.NoError(t, other.QueryRow(context.Background(), `SELECT current_setting('port')`).Scan(&own))
	db := testdb.Shared(t)
	var port string
	require.NoError(t, db.SQL.QueryRow(`SELECT current_setting('port')`).Scan(&port))
	require.NotEqual(t, own, port, "the package's database is on a server of its own")

	// Another package's test holds its share of the run's server (the
	// lock testdb's shares take, serverWideLockID).
	_, err := other.Exec(context.Background(), `SELECT pg_advisory_lock_shared($1)`, int64(0x7067736167610004))
	require.NoError(t, err)
	released := false
	release := func() {
		if !released {
			released = true
			_, err := other.Exec(context.Background(), `SELECT pg_advisory_unlock_shared($1)`, int64(0x7067736167610004))
			require.NoError(t, err)
		}
	}
	defer release()

	took := make(chan struct{})
	done := make(chan bool)
	go func() {
		done <- t.Run("turn", func(t *testing.T) {
			testdb.ServerWide(t)
			close(took)
		})
	}()
	select {
	case <-took:
	case <-time.After(time.Minute):
		release() // lets the waiting turn end the subtest
		<-done
		t.Fatal("the turn waited a minute for another package's test")
	}
	require.True(t, <-done)
}
