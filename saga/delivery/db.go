package delivery

import (
	"context"
	"database/sql"
)

// DBTX runs statements: what *sql.Tx, *sql.Conn and *sql.DB have in
// common. A step's transaction (steps.Tx), the idempotency store's and the
// event store's …Tx methods, and the test kit's inspections all take one,
// so one value passes through every package.
type DBTX interface {
	ExecContext(ctx context.Context, query string, args ...any) (sql.Result, error)
	QueryContext(ctx context.Context, query string, args ...any) (*sql.Rows, error)
	QueryRowContext(ctx context.Context, query string, args ...any) *sql.Row
}
