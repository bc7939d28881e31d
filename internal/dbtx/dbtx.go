// Package dbtx holds the one database interface pgsaga's packages take:
// what *sql.Tx, *sql.Conn and *sql.DB have in common. The public packages
// name it by aliases (transport.Tx, idempotency.DBTX, events.DBTX), so
// one value passes through all of them.
package dbtx

import (
	"context"
	"database/sql"
)

// DBTX runs statements: a transaction, a connection or a pool.
type DBTX interface {
	ExecContext(ctx context.Context, query string, args ...any) (sql.Result, error)
	QueryContext(ctx context.Context, query string, args ...any) (*sql.Rows, error)
	QueryRowContext(ctx context.Context, query string, args ...any) *sql.Row
}
