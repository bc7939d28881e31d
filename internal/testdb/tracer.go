package testdb

import (
	"context"

	"github.com/jackc/pgx/v5"
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
