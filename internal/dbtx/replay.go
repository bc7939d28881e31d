package dbtx

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"io"
)

// database/sql builds *sql.Rows and *sql.Row only from a query of a
// driver's. A result read elsewhere (a row read at once so that it holds no
// connection, a pgx query) is handed on as database/sql's by replaying it:
// a query on an in-memory driver that yields the same values, with the
// same conversions at Scan and the same error.

// Result is a query's result, read: its columns and rows, or the error
// that stopped it.
type Result struct {
	Columns []string
	Values  [][]driver.Value // a row each
	Err     error
}

// replayDB serves replayed results.
var replayDB = NewReplayDB()

// NewReplayDB returns a database/sql handle that replays Results (see
// Result.RowsOn).
func NewReplayDB() *sql.DB { return sql.OpenDB(replayConnector{}) }

// Rows returns *sql.Rows that yield r.
func (r Result) Rows(ctx context.Context) (*sql.Rows, error) { return r.RowsOn(ctx, replayDB) }

// RowsOn is Rows on db, a NewReplayDB.
func (r Result) RowsOn(ctx context.Context, db *sql.DB) (*sql.Rows, error) {
	return db.QueryContext(ctx, "", r)
}

// Row returns a *sql.Row that yields r's first row (sql.ErrNoRows if it
// has none). A row never scanned holds a connection of the replay handle
// until ctx is done; then database/sql closes it.
func (r Result) Row(ctx context.Context) *sql.Row { return r.RowOn(ctx, replayDB) }

// RowOn is Row on db, a NewReplayDB.
func (r Result) RowOn(ctx context.Context, db *sql.DB) *sql.Row {
	return db.QueryRowContext(ctx, "", r)
}

// Read reads rows (at most limit; 0: all) and closes them; err is the
// query's error, if it failed.
func Read(rows *sql.Rows, err error, limit int) Result {
	if err != nil {
		return Result{Err: err}
	}
	defer rows.Close()
	cols, err := rows.Columns()
	if err != nil {
		return Result{Err: err}
	}
	r := Result{Columns: cols}
	for (limit == 0 || len(r.Values) < limit) && rows.Next() {
		vals := make([]any, len(cols))
		ptrs := make([]any, len(cols))
		for i := range vals {
			ptrs[i] = &vals[i]
		}
		if err := rows.Scan(ptrs...); err != nil {
			return Result{Err: err}
		}
		row := make([]driver.Value, len(cols))
		for i, v := range vals {
			row[i] = v
		}
		r.Values = append(r.Values, row)
	}
	if err := rows.Close(); err != nil {
		return Result{Err: err}
	}
	if err := rows.Err(); err != nil {
		return Result{Err: err}
	}
	return r
}

type replayConnector struct{}

func (replayConnector) Connect(context.Context) (driver.Conn, error) { return replayConn{}, nil }
func (replayConnector) Driver() driver.Driver                        { return replayDriver{} }

type replayDriver struct{}

func (replayDriver) Open(string) (driver.Conn, error) { return replayConn{}, nil }

type replayConn struct{}

var errReplayOnly = errors.New("dbtx: the replay connection only replays results")

func (replayConn) Prepare(string) (driver.Stmt, error) { return nil, errReplayOnly }
func (replayConn) Close() error                        { return nil }
func (replayConn) Begin() (driver.Tx, error)           { return nil, errReplayOnly }

// CheckNamedValue lets the replayed result through as the query's argument.
func (replayConn) CheckNamedValue(*driver.NamedValue) error { return nil }

func (replayConn) QueryContext(_ context.Context, _ string, args []driver.NamedValue) (driver.Rows, error) {
	if len(args) != 1 {
		return nil, errReplayOnly
	}
	r, ok := args[0].Value.(Result)
	if !ok {
		return nil, errReplayOnly
	}
	if r.Err != nil {
		return nil, r.Err
	}
	return &replayRows{r: r}, nil
}

type replayRows struct {
	r    Result
	next int
}

func (rr *replayRows) Columns() []string { return rr.r.Columns }
func (rr *replayRows) Close() error      { return nil }

func (rr *replayRows) Next(dest []driver.Value) error {
	if rr.next >= len(rr.r.Values) {
		return io.EOF
	}
	copy(dest, rr.r.Values[rr.next])
	rr.next++
	return nil
}
