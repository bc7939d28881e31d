package dbtx_test

import (
	"context"
	"database/sql"
	"net"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/internal/dbtx"
	"github.com/pgsaga/pgsaga/internal/testdb"
)

// roundTrips counts what a connection sends: the client writes once a
// round trip (pgx buffers each message group, a pipeline included).
type roundTrips struct {
	net.Conn
	n *atomic.Int64
}

func (r roundTrips) Write(b []byte) (int, error) {
	r.n.Add(1)
	return r.Conn.Write(b)
}

// pipeConn connects to db with a round-trip counter and creates table
// pipe_probe (n int unique) for the test.
func pipeConn(t *testing.T) (*pgx.Conn, *atomic.Int64, *testdb.DB) {
	t.Helper()
	db := testdb.Fresh(t)
	cfg, err := pgx.ParseConfig(db.URL)
	require.NoError(t, err)
	rt := &atomic.Int64{}
	dial := cfg.DialFunc
	cfg.DialFunc = func(ctx context.Context, network, addr string) (net.Conn, error) {
		c, err := dial(ctx, network, addr)
		if err != nil {
			return nil, err
		}
		return roundTrips{Conn: c, n: rt}, nil
	}
	conn, err := pgx.ConnectConfig(context.Background(), cfg)
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close(context.Background()) })
	_, err = db.SQL.Exec(`CREATE TABLE pipe_probe (n int UNIQUE)`)
	require.NoError(t, err)
	rt.Store(0)
	return conn, rt, db
}

func probeRows(t *testing.T, db *sql.DB) []int {
	t.Helper()
	rows, err := db.Query(`SELECT n FROM pipe_probe ORDER BY n`)
	require.NoError(t, err)
	defer rows.Close()
	var out []int
	for rows.Next() {
		var n int
		require.NoError(t, rows.Scan(&n))
		out = append(out, n)
	}
	require.NoError(t, rows.Err())
	return out
}

// BEGIN goes with the first statement, queued writes with the next
// statement, and the last of them with COMMIT: a transaction of two
// statements and three queued writes is three round trips.
func TestAPipeSendsWhatItCanTogether(t *testing.T) {
	t.Parallel()
	conn, rt, db := pipeConn(t)
	ctx := context.Background()
	run := func() {
		p := dbtx.BeginPipe(conn)
		require.NoError(t, p.QueueExec("first", `INSERT INTO pipe_probe VALUES (1)`))
		var n int
		require.NoError(t, p.QueryRowContext(ctx, `SELECT count(*) FROM pipe_probe`).Scan(&n))
		assert.Equal(t, 1, n, "a statement sees the writes queued before it")
		require.NoError(t, p.QueueExec("second", `INSERT INTO pipe_probe VALUES ($1)`, 2))
		res, err := p.ExecContext(ctx, `INSERT INTO pipe_probe SELECT generate_series(3, 4)`)
		require.NoError(t, err)
		affected, err := res.RowsAffected()
		require.NoError(t, err)
		assert.EqualValues(t, 2, affected)
		require.NoError(t, p.QueueExec("third", `INSERT INTO pipe_probe VALUES (5)`))
		assert.Empty(t, probeRows(t, db.SQL), "nothing is committed before the commit")
		require.NoError(t, p.Commit(ctx))
		assert.Equal(t, []int{1, 2, 3, 4, 5}, probeRows(t, db.SQL))
		assert.Equal(t, byte('I'), conn.PgConn().TxStatus())
		_, err = p.ExecContext(ctx, `SELECT 1`)
		assert.ErrorIs(t, err, dbtx.ErrPipeEnded)
	}
	run() // the connection prepares each statement once, a round trip each
	_, err := db.SQL.Exec(`DELETE FROM pipe_probe`)
	require.NoError(t, err)
	rt.Store(0)
	run()
	assert.EqualValues(t, 3, rt.Load(), "round trips")
}

// A queued write that fails fails the statement it went with, names
// itself, and nothing of the transaction commits.
func TestAFailedQueuedWriteFailsTheTransaction(t *testing.T) {
	t.Parallel()
	conn, _, db := pipeConn(t)
	ctx := context.Background()
	p := dbtx.BeginPipe(conn)
	_, err := p.ExecContext(ctx, `INSERT INTO pipe_probe VALUES (1)`)
	require.NoError(t, err)
	require.NoError(t, p.QueueExec("inserting a duplicate", `INSERT INTO pipe_probe VALUES (1)`))
	require.NoError(t, p.QueueExec("inserting two", `INSERT INTO pipe_probe VALUES (2)`))
	var n int
	err = p.QueryRowContext(ctx, `SELECT 1`).Scan(&n)
	require.ErrorContains(t, err, "inserting a duplicate")
	require.ErrorContains(t, err, "23505")
	_, err = p.ExecContext(ctx, `SELECT 1`)
	require.ErrorContains(t, err, "inserting a duplicate", "the transaction stays failed")
	require.Error(t, p.Commit(ctx))
	assert.Empty(t, probeRows(t, db.SQL))
	assert.Equal(t, byte('I'), conn.PgConn().TxStatus(), "rolled back")
}

// A failed transaction's queued COMMIT is not a commit: the error of the
// statement before it is returned and nothing is kept.
func TestACommitAfterAFailedWriteKeepsNothing(t *testing.T) {
	t.Parallel()
	conn, _, db := pipeConn(t)
	ctx := context.Background()
	p := dbtx.BeginPipe(conn)
	require.NoError(t, p.QueueExec("inserting one", `INSERT INTO pipe_probe VALUES (1)`))
	require.NoError(t, p.QueueExec("inserting a duplicate", `INSERT INTO pipe_probe VALUES (1)`))
	err := p.Commit(ctx)
	require.ErrorContains(t, err, "inserting a duplicate")
	assert.Empty(t, probeRows(t, db.SQL))
	assert.Equal(t, byte('I'), conn.PgConn().TxStatus(), "rolled back")
}

// A transaction rolled back before anything left sends nothing.
func TestARollbackOfUnsentWorkSendsNothing(t *testing.T) {
	t.Parallel()
	conn, rt, db := pipeConn(t)
	p := dbtx.BeginPipe(conn)
	require.NoError(t, p.QueueExec("inserting", `INSERT INTO pipe_probe VALUES (1)`))
	require.NoError(t, p.Rollback(context.Background()))
	assert.Zero(t, rt.Load())
	assert.Empty(t, probeRows(t, db.SQL))
	require.NoError(t, p.Rollback(context.Background()), "a second rollback is a no-op")
}

// A savepoint undoes its function's writes, queued or sent, and the
// transaction goes on; one whose function sent nothing cost no round
// trip of its own.
func TestAPipeSavepointUndoesItsWrites(t *testing.T) {
	t.Parallel()
	conn, rt, db := pipeConn(t)
	ctx := context.Background()
	p := dbtx.BeginPipe(conn)
	require.NoError(t, p.QueueExec("one", `INSERT INTO pipe_probe VALUES (1)`))

	refused := assert.AnError
	// Nothing of it left: its queue is dropped.
	err := p.Savepoint(ctx, "sp", func() error {
		require.NoError(t, p.QueueExec("two", `INSERT INTO pipe_probe VALUES (2)`))
		return refused
	})
	require.ErrorIs(t, err, refused)
	assert.Zero(t, rt.Load(), "nothing sent yet")

	// It sent a statement: rolled back on the server.
	err = p.Savepoint(ctx, "sp", func() error {
		_, err := p.ExecContext(ctx, `INSERT INTO pipe_probe VALUES (3)`)
		require.NoError(t, err)
		require.NoError(t, p.QueueExec("four", `INSERT INTO pipe_probe VALUES (4)`))
		return refused
	})
	require.ErrorIs(t, err, refused)

	// A statement of its own failed: rolled back, the transaction usable.
	err = p.Savepoint(ctx, "sp", func() error {
		_, err := p.ExecContext(ctx, `INSERT INTO pipe_probe VALUES (1)`)
		return err
	})
	require.ErrorContains(t, err, "23505")

	// A write it queued fails when it ends: undone, the transaction usable.
	err = p.Savepoint(ctx, "sp", func() error {
		return p.QueueExec("a duplicate", `INSERT INTO pipe_probe VALUES (1)`)
	})
	require.ErrorContains(t, err, "a duplicate")

	// One that succeeds keeps its writes.
	require.NoError(t, p.Savepoint(ctx, "sp", func() error {
		return p.QueueExec("five", `INSERT INTO pipe_probe VALUES (5)`)
	}))
	require.NoError(t, p.Commit(ctx))
	assert.Equal(t, []int{1, 5}, probeRows(t, db.SQL))
}

// A savepoint cannot hide a failure that came before it.
func TestAPipeSavepointAfterAFailureFails(t *testing.T) {
	t.Parallel()
	conn, _, db := pipeConn(t)
	ctx := context.Background()
	p := dbtx.BeginPipe(conn)
	require.NoError(t, p.QueueExec("one", `INSERT INTO pipe_probe VALUES (1)`))
	require.NoError(t, p.QueueExec("a duplicate", `INSERT INTO pipe_probe VALUES (1)`))
	err := p.Savepoint(ctx, "sp", func() error {
		_, err := p.ExecContext(ctx, `SELECT 1`)
		return err
	})
	require.ErrorContains(t, err, "a duplicate")
	require.Error(t, p.Commit(ctx))
	assert.Empty(t, probeRows(t, db.SQL))
}

// Rows read in a round trip with queued writes scan as database/sql's.
func TestAPipeScansAsDatabaseSQLDoes(t *testing.T) {
	t.Parallel()
	conn, _, db := pipeConn(t)
	ctx := context.Background()
	stdTx, err := db.SQL.BeginTx(ctx, nil)
	require.NoError(t, err)
	defer stdTx.Rollback() //nolint:errcheck
	p := dbtx.BeginPipe(conn)
	defer p.Rollback(ctx) //nolint:errcheck

	rows, err := stdTx.QueryContext(ctx, probeSQL, 7, 3, []int{1, 3})
	want := scanAll(t, rows, err)
	require.NoError(t, p.QueueExec("probe", `INSERT INTO pipe_probe VALUES (1)`))
	rows, err = p.QueryContext(ctx, probeSQL, 7, 3, []int{1, 3})
	got := scanAll(t, rows, err)
	assertSameProbe(t, want, got)

	odd := `SELECT '2024-01-02 03:04:05+00'::timestamptz, '2024-01-02'::date, '2024-01-02 03:04:05'::timestamp,
    'infinity'::timestamptz, '-infinity'::date, '\x00ff10'::bytea, 1.1::float4, 0.1::float8 + 0.2::float8, '42'::xid, '<a/>'::xml,
    '1 day 2 hours'::interval, '10.0.0.1'::inet, ARRAY[1, 2]::int[], $1::int`
	collect := func(rows *sql.Rows, err error) [][]any {
		require.NoError(t, err)
		defer rows.Close()
		var out [][]any
		for rows.Next() {
			vals := make([]any, 14)
			ptrs := make([]any, len(vals))
			for i := range vals {
				ptrs[i] = &vals[i]
			}
			require.NoError(t, rows.Scan(ptrs...))
			out = append(out, vals)
		}
		require.NoError(t, rows.Err())
		return out
	}
	require.NoError(t, p.QueueExec("probe", `INSERT INTO pipe_probe VALUES (2)`))
	assert.Equal(t, collect(stdTx.QueryContext(ctx, odd, 7)), collect(p.QueryContext(ctx, odd, 7)))
	var n int
	require.ErrorIs(t, p.QueryRowContext(ctx, `SELECT 1 WHERE false`).Scan(&n), sql.ErrNoRows)
}

// A savepoint whose statements cannot even be sent (its context is
// cancelled) fails, and so does the transaction: what was queued before
// it was lost with them.
func TestAPipeSavepointThatCannotSendFailsTheTransaction(t *testing.T) {
	t.Parallel()
	conn, _, db := pipeConn(t)
	ctx := context.Background()
	p := dbtx.BeginPipe(conn)
	require.NoError(t, p.QueueExec("one", `INSERT INTO pipe_probe VALUES (1)`))
	cancelled, cancel := context.WithCancel(ctx)
	cancel()
	err := p.Savepoint(cancelled, "sp", func() error {
		_, err := p.ExecContext(cancelled, `INSERT INTO pipe_probe VALUES (2 + 0 * length('never prepared'))`)
		return err
	})
	require.ErrorIs(t, err, context.Canceled)
	require.Error(t, p.Commit(ctx))
	assert.Empty(t, probeRows(t, db.SQL))
}

// What waits for the commit runs after it, and never for work taken back
// (a savepoint undone, a rollback).
func TestAPipesCommitHooks(t *testing.T) {
	t.Parallel()
	conn, _, _ := pipeConn(t)
	ctx := context.Background()
	var ran []string
	hook := func(name string) func() { return func() { ran = append(ran, name) } }

	p := dbtx.BeginPipe(conn)
	p.OnCommit(hook("kept"))
	require.Error(t, p.Savepoint(ctx, "sp", func() error {
		p.OnCommit(hook("undone"))
		return assert.AnError
	}))
	require.ErrorContains(t, p.Savepoint(ctx, "sp", func() error {
		p.OnCommit(hook("failed at its release"))
		return p.QueueExec("a bad write", `INSERT INTO pipe_probe VALUES ('x')`)
	}), "a bad write")
	require.NoError(t, p.Savepoint(ctx, "sp", func() error {
		p.OnCommit(hook("released"))
		return nil
	}))
	assert.Empty(t, ran, "nothing before the commit")
	require.NoError(t, p.Commit(ctx))
	assert.Equal(t, []string{"kept", "released"}, ran)

	ran = nil
	p = dbtx.BeginPipe(conn)
	_, err := p.ExecContext(ctx, `SELECT 1`)
	require.NoError(t, err)
	p.OnCommit(hook("rolled back"))
	require.NoError(t, p.Rollback(ctx))
	assert.Empty(t, ran)
}
