// Package testlost loses connections on cue, for tests of code that must
// ride a lost connection out: a backend terminated while its statement
// waits (Terminated), and a connection cut right after it sent a message,
// so that the server carries the message out (a COMMIT commits) while the
// client never hears back (Cuttable).
package testlost

import (
	"bytes"
	"context"
	"encoding/binary"
	"io"
	"net"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"

	"github.com/pgsaga/pgsaga/internal/testdb"
)

// Terminated runs call and, once a statement of call waits for the lock
// that hold (a statement with args) takes in a transaction of the test's
// own, terminates that statement's backend, as pg_terminate_backend or a
// server's fast shutdown does; then it ends the holding transaction (rolled
// back) and returns call's error. Run a call that retries and it takes the
// lock, and goes on, once the holder is gone.
func Terminated(t testing.TB, db *testdb.DB, hold string, args []any, call func() error) error {
	t.Helper()
	ctx := context.Background()
	holder, err := db.SQL.BeginTx(ctx, nil)
	if err != nil {
		t.Fatalf("testlost: %v", err)
	}
	defer holder.Rollback() //nolint:errcheck // ends the hold
	var holderPID int
	if err := holder.QueryRowContext(ctx, `SELECT pg_backend_pid()`).Scan(&holderPID); err != nil {
		t.Fatalf("testlost: %v", err)
	}
	if _, err := holder.ExecContext(ctx, hold, args...); err != nil {
		t.Fatalf("testlost: holding the lock: %v", err)
	}
	done := make(chan error, 1)
	go func() { done <- call() }()
	var victim int
	wait(t, func() bool {
		err := db.SQL.QueryRowContext(ctx, `SELECT pid FROM pg_stat_activity WHERE $1 = ANY (pg_blocking_pids(pid)) LIMIT 1`, holderPID).Scan(&victim)
		return err == nil
	}, "a statement waiting for the lock")
	var ok bool
	if err := db.SQL.QueryRowContext(ctx, `SELECT pg_terminate_backend($1)`, victim).Scan(&ok); err != nil || !ok {
		t.Fatalf("testlost: terminating backend %d: %v", victim, err)
	}
	wait(t, func() bool {
		var n int
		return db.SQL.QueryRowContext(ctx, `SELECT count(*) FROM pg_stat_activity WHERE pid = $1`, victim).Scan(&n) == nil && n == 0
	}, "the terminated backend to exit")
	_ = holder.Rollback()
	select {
	case err := <-done:
		return err
	case <-time.After(time.Minute):
		t.Fatalf("testlost: the call did not return within a minute of its backend's termination")
		return nil
	}
}

// wait polls cond until it holds, failing the test after 30 seconds.
func wait(t testing.TB, cond func() bool, what string) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("testlost: waited 30s for %s", what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// The ways COMMIT is sent, for CutAfter: Commit as pgx sends it (a
// simple query message, database/sql's Commit), PipelinedCommit as a
// dbtx.Pipe sends it (the unnamed statement of a pipeline's Parse).
const (
	Commit          = "Q\x00\x00\x00\x0bcommit\x00"
	PipelinedCommit = "\x00commit\x00"
)

// Commits are the markers of every way COMMIT is sent.
var Commits = []string{Commit, PipelinedCommit}

// Cuttable is a pool over a test database whose connections can be cut;
// DB plugs into what takes a *testdb.DB.
type Cuttable struct {
	DB    *testdb.DB
	armed atomic.Pointer[[][]byte]
}

// OpenCuttable opens a pool of maxConns over db's database, closed when
// the test ends.
func OpenCuttable(t testing.TB, db *testdb.DB, maxConns int32) *Cuttable {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(db.URL)
	if err != nil {
		t.Fatalf("testlost: %v", err)
	}
	cfg.MaxConns = maxConns
	c := &Cuttable{}
	cfg.ConnConfig.DialFunc = func(ctx context.Context, network, addr string) (net.Conn, error) {
		nc, err := (&net.Dialer{}).DialContext(ctx, network, addr)
		if err != nil {
			return nil, err
		}
		return &cutConn{Conn: nc, c: c}, nil
	}
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatalf("testlost: %v", err)
	}
	sqlDB := stdlib.OpenDBFromPool(pool)
	t.Cleanup(func() {
		_ = sqlDB.Close()
		pool.Close()
	})
	c.DB = &testdb.DB{Name: db.Name, URL: db.URL, Pool: pool, SQL: sqlDB}
	return c
}

// CutAfter arms the cut: the next connection to send a message holding
// one of markers (such as Commits) closes once the server has carried it
// out, without the client hearing back.
func (c *Cuttable) CutAfter(markers ...string) {
	m := make([][]byte, len(markers))
	for i, s := range markers {
		m[i] = []byte(s)
	}
	c.armed.Store(&m)
}

// Cut reports whether the armed cut happened.
func (c *Cuttable) Cut() bool { return c.armed.Load() == nil }

type cutConn struct {
	net.Conn
	c   *Cuttable
	cut atomic.Bool
}

// Write sends p; if p holds the armed marker, it waits for the server's
// answer to it (ReadyForQuery: the message was carried out), drops it and
// closes the connection, so that the client's next read fails.
func (n *cutConn) Write(p []byte) (int, error) {
	m := n.c.armed.Load()
	if m == nil || !slices.ContainsFunc(*m, func(marker []byte) bool { return bytes.Contains(p, marker) }) || !n.c.armed.CompareAndSwap(m, nil) {
		return n.Conn.Write(p)
	}
	n.cut.Store(true)
	written, err := n.Conn.Write(p)
	if err == nil {
		err = untilReady(n.Conn)
	}
	_ = n.Conn.Close()
	return written, err
}

func (n *cutConn) Read(p []byte) (int, error) {
	if n.cut.Load() {
		return 0, net.ErrClosed
	}
	return n.Conn.Read(p)
}

// untilReady reads the server's messages up to ReadyForQuery.
func untilReady(c net.Conn) error {
	if err := c.SetReadDeadline(time.Now().Add(30 * time.Second)); err != nil {
		return err
	}
	header := make([]byte, 5)
	for {
		if _, err := io.ReadFull(c, header); err != nil {
			return err
		}
		if _, err := io.CopyN(io.Discard, c, int64(binary.BigEndian.Uint32(header[1:]))-4); err != nil {
			return err
		}
		if header[0] == 'Z' {
			return nil
		}
	}
}
