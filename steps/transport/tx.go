package transport

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"io"
	"net"
	"strings"
	"sync"

	"github.com/jackc/pgx/v5/pgconn"
)

// Tx is what a step's statements run on: the subscriber's transaction, inside
// a savepoint of the current delivery attempt, or a transaction the caller
// opened itself. *sql.Tx, *sql.Conn and *sql.DB satisfy it, so code written
// against Tx runs unchanged in either mode and in tests.
type Tx interface {
	ExecContext(ctx context.Context, query string, args ...any) (sql.Result, error)
	QueryContext(ctx context.Context, query string, args ...any) (*sql.Rows, error)
	QueryRowContext(ctx context.Context, query string, args ...any) *sql.Row
}

type txKey struct{}

// ContextWithTx returns ctx carrying tx, for code that runs a step in a
// transaction of its own rather than in a router handler.
func ContextWithTx(ctx context.Context, tx Tx) context.Context {
	return context.WithValue(ctx, txKey{}, tx)
}

// TxFromContext returns the transaction of the delivery attempt running under
// ctx (inside a Router handler), or the one stored by ContextWithTx.
func TxFromContext(ctx context.Context) (Tx, bool) {
	tx, ok := ctx.Value(txKey{}).(Tx)
	return tx, ok
}

// ErrAttemptOver is returned by statements issued through an attempt's Tx
// after the attempt ended (the handler returned, or the router gave up on it
// while closing). Such a statement would otherwise land in the next message's
// work or in a transaction about to be committed without it.
var ErrAttemptOver = errors.New("transport: delivery attempt is over; its transaction can no longer be used")

// attemptTx is the Tx a handler sees: the subscriber's *sql.Tx, with
// statements that are not cancelled by the message context (bounds come from
// SET LOCAL statement_timeout instead), and that stop working once the attempt
// is over.
type attemptTx struct {
	raw *sql.Tx

	mu   sync.RWMutex // held shared by statements, exclusively by revoke
	over bool

	rowsMu sync.Mutex
	rows   []*sql.Rows // result sets to close when the attempt ends

	defMu    sync.Mutex
	deferred []deferredStmt  // see DeferExec
	notified map[string]bool // topics whose wake-up is queued
	flushErr error           // a failed send of queued statements: the attempt cannot be kept
}

var _ Tx = (*attemptTx)(nil)

func newAttemptTx(raw *sql.Tx) *attemptTx { return &attemptTx{raw: raw} }

func (a *attemptTx) ExecContext(ctx context.Context, query string, args ...any) (sql.Result, error) {
	a.mu.RLock()
	defer a.mu.RUnlock()
	if a.over {
		return nil, ErrAttemptOver
	}
	cmd := classify(query)
	if cmd == flushBefore {
		if err := a.flushDeferred(ctx); err != nil {
			return nil, err
		}
	}
	res, err := a.raw.ExecContext(context.WithoutCancel(ctx), query, args...)
	if err == nil && cmd == discardAfter {
		a.takeDeferred()
	}
	return res, err
}

func (a *attemptTx) QueryContext(ctx context.Context, query string, args ...any) (*sql.Rows, error) {
	a.mu.RLock()
	defer a.mu.RUnlock()
	if a.over {
		return nil, ErrAttemptOver
	}
	cmd := classify(query)
	if cmd == flushBefore {
		if err := a.flushDeferred(ctx); err != nil {
			return nil, err
		}
	}
	rows, err := a.raw.QueryContext(context.WithoutCancel(ctx), query, args...)
	if err == nil && cmd == discardAfter {
		a.takeDeferred()
	}
	if err == nil {
		a.rowsMu.Lock()
		a.rows = append(a.rows, rows)
		a.rowsMu.Unlock()
	}
	return rows, err
}

// QueryRowContext after the attempt is over returns a row whose Scan fails
// with context.Canceled: database/sql offers no other way to build a failed
// *sql.Row.
func (a *attemptTx) QueryRowContext(ctx context.Context, query string, args ...any) *sql.Row {
	a.mu.RLock()
	defer a.mu.RUnlock()
	if a.over {
		dead, cancel := context.WithCancel(ctx)
		cancel()
		return a.raw.QueryRowContext(dead, query, args...)
	}
	// A savepoint command has no place in a QueryRow: queued statements are
	// sent first all the same (a failure makes the attempt fail), and a
	// rollback takes them back whatever it returns.
	switch classify(query) {
	case flushBefore:
		_ = a.flushDeferred(ctx)
	case discardAfter:
		a.takeDeferred()
	}
	return a.raw.QueryRowContext(context.WithoutCancel(ctx), query, args...)
}

// revoke ends the attempt: it waits for a running statement, closes result
// sets the handler left open (an open result set keeps the connection busy
// and would make the savepoint statements fail), and refuses any later
// statement.
func (a *attemptTx) revoke() {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.over = true
	a.rowsMu.Lock()
	defer a.rowsMu.Unlock()
	for _, r := range a.rows {
		_ = r.Close()
	}
	a.rows = nil
}

// doomed reports whether a statement that failed with err leaves its
// transaction unable to commit: PostgreSQL aborts a transaction block on any
// error it reports, a lost connection cannot commit, and a finished
// transaction commits nothing more.
func doomed(err error) bool {
	if err == nil {
		return false
	}
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		return true
	}
	return errors.Is(err, sql.ErrTxDone) || connectionLost(err)
}

// connectionLost reports whether err means the connection to the server is gone.
func connectionLost(err error) bool {
	if errors.Is(err, driver.ErrBadConn) || errors.Is(err, io.EOF) ||
		errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, net.ErrClosed) {
		return true
	}
	var netErr net.Error
	if errors.As(err, &netErr) {
		return true
	}
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		return pgErr.Severity == "FATAL" || pgErr.Severity == "PANIC" || strings.HasPrefix(pgErr.Code, "08")
	}
	return false
}
