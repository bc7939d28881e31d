package transport

import (
	"context"
	"database/sql"

	"github.com/pgsaga/pgsaga/internal/dbtx"
)

// A *sql.Row holds its statement's result open until it is scanned, and a
// handler that returns without scanning one would leave its attempt's
// connection busy, so that the attempt could neither be kept nor rolled
// back. An attempt therefore reads the row at once, closes the result, and
// hands the handler a *sql.Row that replays it (dbtx.Result): same values,
// same conversions at Scan (database/sql's), same error (sql.ErrNoRows for
// no row, or what stopped the statement).

// replayed is one row, read, or the error in its place.
type replayed = dbtx.Result

// replayRow returns a *sql.Row that yields r. A row never scanned holds a
// connection of the replay handle until ctx is done; then database/sql
// closes it.
func replayRow(ctx context.Context, r replayed) *sql.Row { return r.Row(ctx) }

// readRow reads the first row of rows, and closes them.
func readRow(rows *sql.Rows, err error) replayed { return dbtx.Read(rows, err, 1) }
