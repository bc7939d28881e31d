package pgerr_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"net"
	"testing"
	"time"

	"github.com/jackc/pgerrcode"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/internal/pgdb"
	"github.com/pgsaga/pgsaga/internal/pgerr"
	"github.com/pgsaga/pgsaga/internal/testdb"
	"github.com/pgsaga/pgsaga/internal/testpg"
)

func TestMain(m *testing.M) { testpg.Main(m) }

// connect opens a pgx connection of the test's own to db.
func connect(t *testing.T, url string) *pgx.Conn {
	t.Helper()
	c, err := pgx.Connect(context.Background(), url)
	require.NoError(t, err)
	t.Cleanup(func() { _ = c.Close(context.Background()) })
	return c
}

// terminate ends backend pid as pg_terminate_backend does (what an operator
// or a fast shutdown does to every session), and waits until it is gone.
func terminate(t *testing.T, admin *sql.DB, pid uint32) {
	t.Helper()
	var ok bool
	require.NoError(t, admin.QueryRow(`SELECT pg_terminate_backend($1)`, pid).Scan(&ok))
	require.True(t, ok, "backend %d", pid)
	gone(t, admin, pid)
}

// gone waits until backend pid has exited.
func gone(t *testing.T, admin *sql.DB, pid uint32) {
	t.Helper()
	require.Eventually(t, func() bool {
		var n int
		require.NoError(t, admin.QueryRow(`SELECT count(*) FROM pg_stat_activity WHERE pid = $1`, pid).Scan(&n))
		return n == 0
	}, 30*time.Second, 10*time.Millisecond, "backend %d still there", pid)
}

// sleeping starts a long statement on c and returns once the server runs
// it; the channel gets the statement's error.
func sleeping(t *testing.T, admin *sql.DB, c *pgx.Conn) <-chan error {
	t.Helper()
	done := make(chan error, 1)
	go func() { _, err := c.Exec(context.Background(), "SELECT pg_sleep(60)"); done <- err }()
	require.Eventually(t, func() bool {
		var running bool
		require.NoError(t, admin.QueryRow(`SELECT EXISTS (SELECT FROM pg_stat_activity WHERE pid = $1 AND query = 'SELECT pg_sleep(60)' AND state = 'active')`,
			c.PgConn().PID()).Scan(&running))
		return running
	}, 30*time.Second, 10*time.Millisecond)
	return done
}

// The errors a lost connection really produces, from a real server, are
// told apart from those that leave the session up or that no new
// connection cures.
func TestConnectionLost(t *testing.T) {
	db := testdb.Shared(t)
	ctx := context.Background()
	for name, c := range map[string]struct {
		lost bool
		err  func(t *testing.T) error
	}{
		"backend terminated while idle": {true, func(t *testing.T) error {
			c := connect(t, db.URL)
			terminate(t, db.SQL, c.PgConn().PID())
			_, err := c.Exec(ctx, "SELECT 1")
			return err
		}},
		"backend terminated mid-statement": {true, func(t *testing.T) error {
			c := connect(t, db.URL)
			done := sleeping(t, db.SQL, c)
			terminate(t, db.SQL, c.PgConn().PID())
			return <-done
		}},
		// pgx closed the connection on the first error; what follows is
		// never sent ("conn closed", pgconn.SafeToRetry).
		"statement after the termination was seen": {true, func(t *testing.T) error {
			c := connect(t, db.URL)
			terminate(t, db.SQL, c.PgConn().PID())
			_, _ = c.Exec(ctx, "SELECT 1")
			_, err := c.Exec(ctx, "SELECT 1")
			return err
		}},
		"commit of a transaction whose backend was terminated": {true, func(t *testing.T) error {
			pool := openPool(t, db.URL)
			tx, err := pool.SQL.BeginTx(ctx, nil)
			require.NoError(t, err)
			defer tx.Rollback() //nolint:errcheck
			var pid uint32
			require.NoError(t, tx.QueryRowContext(ctx, "SELECT pg_backend_pid()").Scan(&pid))
			terminate(t, db.SQL, pid)
			_, _ = tx.ExecContext(ctx, "SELECT 1")
			return tx.Commit()
		}},
		// database/sql hands out a connection it keeps for the caller
		// (sql.Conn) and cannot swap: driver.ErrBadConn.
		"database/sql connection after the termination was seen": {true, func(t *testing.T) error {
			pool := openPool(t, db.URL)
			conn, err := pool.SQL.Conn(ctx)
			require.NoError(t, err)
			defer conn.Close()
			var pid uint32
			require.NoError(t, conn.QueryRowContext(ctx, "SELECT pg_backend_pid()").Scan(&pid))
			terminate(t, db.SQL, pid)
			_, _ = conn.ExecContext(ctx, "SELECT 1")
			_, err = conn.ExecContext(ctx, "SELECT 1")
			return err
		}},
		// The server ends a session idle in a transaction too long: FATAL
		// 25P03, the session is gone.
		"session ended by idle_in_transaction_session_timeout": {true, func(t *testing.T) error {
			c := connect(t, db.URL)
			_, err := c.Exec(ctx, "SET idle_in_transaction_session_timeout = '50ms'")
			require.NoError(t, err)
			tx, err := c.Begin(ctx)
			require.NoError(t, err)
			gone(t, db.SQL, c.PgConn().PID())
			_, err = tx.Exec(ctx, "SELECT 1")
			return err
		}},
		// A server restarting refuses connections for a while.
		"connection refused": {true, func(t *testing.T) error {
			_, err := pgx.Connect(ctx, "postgres://postgres@127.0.0.1:1/postgres?sslmode=disable&connect_timeout=5")
			return err
		}},
		// A server process that dies (or a proxy between) closes the
		// socket without a word.
		"socket closed by the other end": {true, func(t *testing.T) error {
			l, err := net.Listen("tcp", "127.0.0.1:0")
			require.NoError(t, err)
			defer l.Close()
			go func() {
				if c, err := l.Accept(); err == nil {
					_ = c.Close()
				}
			}()
			_, err = pgx.Connect(ctx, "postgres://postgres@"+l.Addr().String()+"/postgres?sslmode=disable")
			return err
		}},
		"socket closed by this end": {true, func(t *testing.T) error {
			c := connect(t, db.URL)
			require.NoError(t, c.PgConn().Conn().Close())
			_, err := c.Exec(ctx, "SELECT 1")
			return err
		}},

		// The session is up: a cancelled statement (a statement_timeout,
		// pg_cancel_backend) would time out again, or was stopped on
		// purpose.
		"statement_timeout": {false, func(t *testing.T) error {
			c := connect(t, db.URL)
			_, err := c.Exec(ctx, "SET statement_timeout = '50ms'; SELECT pg_sleep(60)")
			return err
		}},
		"pg_cancel_backend": {false, func(t *testing.T) error {
			c := connect(t, db.URL)
			done := sleeping(t, db.SQL, c)
			var cancelled bool
			require.NoError(t, db.SQL.QueryRow(`SELECT pg_cancel_backend($1)`, c.PgConn().PID()).Scan(&cancelled))
			require.True(t, cancelled)
			return <-done
		}},
		// Refusals to connect that waiting does not cure.
		"database does not exist": {false, func(t *testing.T) error {
			url, err := pgdb.WithDatabase(db.URL, "pgsaga_no_such_database")
			require.NoError(t, err)
			_, err = pgx.Connect(ctx, url)
			return err
		}},
		"role over its connection limit": {false, func(t *testing.T) error {
			_, err := pgx.Connect(ctx, testdb.LimitedRole(t, 0))
			return err
		}},
		// pgconn.SafeToRetry says the request was not sent, which is not
		// the same: these two are, on a connection that is fine.
		"connection in use by another statement (conn busy)": {false, func(t *testing.T) error {
			c := connect(t, db.URL)
			rows, err := c.Query(ctx, "SELECT generate_series(1, 3)")
			require.NoError(t, err)
			defer rows.Close()
			_, err = c.Exec(ctx, "SELECT 1")
			require.True(t, pgconn.SafeToRetry(err), "%v", err)
			return err
		}},
		"context cancelled before the statement": {false, func(t *testing.T) error {
			c := connect(t, db.URL)
			cctx, cancel := context.WithCancel(ctx)
			cancel()
			_, err := c.Exec(cctx, "SELECT 1")
			require.True(t, pgconn.SafeToRetry(err), "%v", err)
			return err
		}},
		"unique violation": {false, func(t *testing.T) error {
			c := connect(t, db.URL)
			_, err := c.Exec(ctx, "CREATE TEMP TABLE u (x int PRIMARY KEY); INSERT INTO u VALUES (1), (1)")
			require.True(t, pgerr.Is(err, pgerrcode.UniqueViolation), "%v", err)
			return err
		}},
	} {
		t.Run(name, func(t *testing.T) {
			err := c.err(t)
			require.Error(t, err)
			t.Logf("%T: %v", err, err)
			assert.Equal(t, c.lost, pgerr.ConnectionLost(err), "%v", err)
			assert.Equal(t, c.lost, pgerr.ConnectionLost(fmt.Errorf("wrapped: %w", err)), "wrapped")
		})
	}
}

// The SQLSTATEs of classes 08 and 57 that a test cannot easily provoke on
// the shared server (a crash, a server starting up).
func TestConnectionLostBySQLState(t *testing.T) {
	t.Parallel()
	for code, lost := range map[string]bool{
		pgerrcode.ConnectionFailure:    true,
		pgerrcode.AdminShutdown:        true,
		pgerrcode.CrashShutdown:        true,
		pgerrcode.CannotConnectNow:     true,
		pgerrcode.IdleSessionTimeout:   true,
		pgerrcode.OperatorIntervention: true,
		pgerrcode.QueryCanceled:        false,
		pgerrcode.DatabaseDropped:      false,
		pgerrcode.UniqueViolation:      false,
	} {
		assert.Equal(t, lost, pgerr.ConnectionLost(&pgconn.PgError{Severity: "ERROR", Code: code}), code)
	}
	assert.False(t, pgerr.ConnectionLost(nil))
	assert.False(t, pgerr.ConnectionLost(context.Canceled))
	assert.False(t, pgerr.ConnectionLost(errors.New("some error")))
}

func openPool(t *testing.T, url string) *pgdb.DB {
	t.Helper()
	db, err := pgdb.Open(context.Background(), pgdb.Config{URL: url, MaxConns: 2})
	require.NoError(t, err)
	t.Cleanup(db.Close)
	return db
}
