package main

import (
	"context"
	"database/sql"
	"sync/atomic"

	"github.com/jackc/pgx/v5"
)

// statementCounter counts the statements the benchmark's pools send: every
// query and exec, and every statement of a pipelined batch, BEGIN and
// COMMIT included (database/sql sends them as statements through pgx).
type statementCounter struct{ n atomic.Int64 }

var (
	_ pgx.QueryTracer = (*statementCounter)(nil)
	_ pgx.BatchTracer = (*statementCounter)(nil)
)

func (c *statementCounter) TraceQueryStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryStartData) context.Context {
	c.n.Add(1)
	return ctx
}

func (*statementCounter) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

func (*statementCounter) TraceBatchStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceBatchStartData) context.Context {
	return ctx
}

func (c *statementCounter) TraceBatchQuery(context.Context, *pgx.Conn, pgx.TraceBatchQueryData) {
	c.n.Add(1)
}

func (*statementCounter) TraceBatchEnd(context.Context, *pgx.Conn, pgx.TraceBatchEndData) {}

// statementCount is a reading of both counts: the server's
// (pg_stat_statements, for this database, when the extension can be used)
// and the benchmark's own.
type statementCount struct {
	server   int64
	serverOK bool
	client   int64
}

// serverStatementsSQL sums the calls pg_stat_statements counted in this
// database. Statements sent inside a pipeline after the first are counted
// too; utility commands such as SAVEPOINT only if pg_stat_statements.track_utility is on.
const serverStatementsSQL = `SELECT coalesce(sum(calls), 0)::bigint FROM pg_stat_statements
WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())`

// enableStatementStats makes pg_stat_statements usable in the benchmark's
// database, if the server preloads it and the role may create it; without
// it statements_per_saga falls back to the benchmark's own count.
func enableStatementStats(ctx context.Context, db *sql.DB) bool {
	if _, err := db.ExecContext(ctx, `CREATE EXTENSION IF NOT EXISTS pg_stat_statements`); err != nil {
		return false
	}
	var n int64
	return db.QueryRowContext(ctx, serverStatementsSQL).Scan(&n) == nil
}

// countStatements reads both counts; admin is a connection of the
// benchmark's database that the counted pools do not use.
func (b *bench) countStatements(ctx context.Context) statementCount {
	c := statementCount{client: b.statements.n.Load()}
	if b.statementStats {
		c.serverOK = b.statsDB.QueryRowContext(ctx, serverStatementsSQL).Scan(&c.server) == nil
	}
	return c
}

// perSaga turns two readings into statements per saga and says where the
// figure comes from. elsewhere: workers ran in other processes, whose
// statements this process did not see, so its own count is no figure of
// the saga's.
func perSaga(from, to statementCount, sagas int, elsewhere bool) (perSaga, clientPerSaga float64, source string) {
	if sagas == 0 {
		return 0, 0, ""
	}
	clientPerSaga = round(float64(to.client-from.client) / float64(sagas))
	switch {
	case from.serverOK && to.serverOK:
		return round(float64(to.server-from.server) / float64(sagas)), clientPerSaga, "pg_stat_statements"
	case elsewhere:
		return 0, clientPerSaga, "unavailable"
	}
	return clientPerSaga, clientPerSaga, "client"
}
