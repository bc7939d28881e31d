package testdb

import (
	"bytes"
	"context"
	"net"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
)

// Tracer hands each statement a pool's connections send, alone or in a
// pipeline, to its function with its arguments (pgx's database/sql driver
// may put options of its own first): for tests that count statements
// (set it as pgdb.Config.Tracer or the pool's ConnConfig.Tracer).
type Tracer func(sql string, args []any)

var (
	_ pgx.QueryTracer = Tracer(nil)
	_ pgx.BatchTracer = Tracer(nil)
)

func (f Tracer) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	f(d.SQL, d.Args)
	return ctx
}

func (Tracer) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

func (Tracer) TraceBatchStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceBatchStartData) context.Context {
	return ctx
}

func (f Tracer) TraceBatchQuery(_ context.Context, _ *pgx.Conn, d pgx.TraceBatchQueryData) {
	f(d.SQL, d.Args)
}

func (Tracer) TraceBatchEnd(context.Context, *pgx.Conn, pgx.TraceBatchEndData) {}

// RoundTrips opens a pool over db's database (closed when the test ends)
// whose connections count their round trips: each write of a connection
// is one (pgx sends each group of messages, a pipeline included, in one
// write), pgx's database/sql driver's pings apart. n counts them; store 0
// in it to start over.
func RoundTrips(t testing.TB, db *DB) (counted *DB, n *atomic.Int64) {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(db.URL)
	if err != nil {
		t.Fatalf("testdb: %v", err)
	}
	n = &atomic.Int64{}
	cfg.ConnConfig.DialFunc = func(ctx context.Context, network, addr string) (net.Conn, error) {
		c, err := (&net.Dialer{}).DialContext(ctx, network, addr)
		if err != nil {
			return nil, err
		}
		return countingConn{Conn: c, n: n}, nil
	}
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatalf("testdb: %v", err)
	}
	sqlDB := stdlib.OpenDBFromPool(pool)
	t.Cleanup(func() {
		_ = sqlDB.Close()
		pool.Close()
	})
	return &DB{Name: db.Name, URL: db.URL, Pool: pool, SQL: sqlDB}, n
}

type countingConn struct {
	net.Conn
	n *atomic.Int64
}

func (c countingConn) Write(b []byte) (int, error) {
	if !bytes.Contains(b, []byte("-- ping")) {
		c.n.Add(1)
	}
	return c.Conn.Write(b)
}
