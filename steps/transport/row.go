package transport

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"io"
)

// A *sql.Row holds its statement's result open until it is scanned, and a
// handler that returns without scanning one would leave its attempt's
// connection busy, so that the attempt could neither be kept nor rolled
// back. An attempt therefore reads the row at once, closes the result, and
// hands the handler a *sql.Row that replays it: same values, same
// conversions at Scan (database/sql's), same error (sql.ErrNoRows for no
// row, or what stopped the statement). database/sql builds *sql.Row only
// from a query, so the replay is a query on an in-memory driver.

// replayDB serves replayed rows.
var replayDB = sql.OpenDB(replayConnector{})

// replayed is one row, read, or the error in its place.
type replayed struct {
	columns []string
	values  []driver.Value // nil: no row
	err     error
}

// replayRow returns a *sql.Row that yields r. A row never scanned holds a
// connection of replayDB until ctx is done; then database/sql closes it.
func replayRow(ctx context.Context, r replayed) *sql.Row { return replayRowOn(replayDB, ctx, r) }

func replayRowOn(db *sql.DB, ctx context.Context, r replayed) *sql.Row {
	return db.QueryRowContext(ctx, "", r)
}

// readRow reads the first row of rows, and closes them.
func readRow(rows *sql.Rows, err error) replayed {
	if err != nil {
		return replayed{err: err}
	}
	defer rows.Close()
	cols, err := rows.Columns()
	if err != nil {
		return replayed{err: err}
	}
	r := replayed{columns: cols}
	if rows.Next() {
		vals := make([]any, len(cols))
		ptrs := make([]any, len(cols))
		for i := range vals {
			ptrs[i] = &vals[i]
		}
		if err := rows.Scan(ptrs...); err != nil {
			return replayed{err: err}
		}
		r.values = make([]driver.Value, len(cols))
		for i, v := range vals {
			r.values[i] = v
		}
	}
	if err := rows.Close(); err != nil {
		return replayed{err: err}
	}
	if err := rows.Err(); err != nil {
		return replayed{err: err}
	}
	return r
}

type replayConnector struct{}

func (replayConnector) Connect(context.Context) (driver.Conn, error) { return replayConn{}, nil }
func (replayConnector) Driver() driver.Driver                        { return replayDriver{} }

type replayDriver struct{}

func (replayDriver) Open(string) (driver.Conn, error) { return replayConn{}, nil }

type replayConn struct{}

var errReplayOnly = errors.New("transport: the replay connection only replays rows")

func (replayConn) Prepare(string) (driver.Stmt, error) { return nil, errReplayOnly }
func (replayConn) Close() error                        { return nil }
func (replayConn) Begin() (driver.Tx, error)           { return nil, errReplayOnly }

// CheckNamedValue lets the replayed row through as the query's argument.
func (replayConn) CheckNamedValue(*driver.NamedValue) error { return nil }

func (replayConn) QueryContext(_ context.Context, _ string, args []driver.NamedValue) (driver.Rows, error) {
	r, ok := args[0].Value.(replayed)
	if !ok {
		return nil, errReplayOnly
	}
	if r.err != nil {
		return nil, r.err
	}
	return &replayRows{r: r}, nil
}

type replayRows struct {
	r    replayed
	done bool
}

func (rr *replayRows) Columns() []string { return rr.r.columns }
func (rr *replayRows) Close() error      { return nil }

func (rr *replayRows) Next(dest []driver.Value) error {
	if rr.done || rr.r.values == nil {
		return io.EOF
	}
	rr.done = true
	copy(dest, rr.r.values)
	return nil
}
