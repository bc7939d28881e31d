package transport

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"fmt"
	"reflect"
	"runtime/debug"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgerrcode"
	"github.com/jackc/pgx/v5"

	"github.com/pgsaga/pgsaga/internal/pgerr"

	"github.com/pgsaga/pgsaga/internal/dbtx"
)

// Tx is what a step's statements run on: the transaction of a delivery
// attempt, or a transaction the caller opened itself. *sql.Tx, *sql.Conn and
// *sql.DB satisfy it, so code written against Tx runs unchanged in either
// mode and in tests. Its methods are ExecContext, QueryContext and
// QueryRowContext; it is the same interface as delivery.DBTX.
type Tx = dbtx.DBTX

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

type attemptKey struct{}

// AttemptFromContext returns the number (1-based) of the delivery attempt
// running under ctx, or 0 outside one.
func AttemptFromContext(ctx context.Context) int {
	n, _ := ctx.Value(attemptKey{}).(int)
	return n
}

// Queuer is implemented by the Tx of a delivery attempt and by a
// dbtx.Pipe (see dbtx.Queuer). A statement queued with QueueExec on an
// attempt is sent, with every other statement queued, in one pipelined
// round trip at the end of the attempt, or before the handler's next
// statement, whichever comes first; either way inside the attempt, so it
// commits with the attempt or not at all, and a failure fails the attempt.
type Queuer = dbtx.Queuer

// Queue queues query on tx if tx is a Queuer (see Queuer), and runs it at
// once otherwise. It is how pgsaga writes what nobody reads back in the
// same attempt: published messages, completed keys, timelines.
func Queue(ctx context.Context, tx Tx, name, query string, args ...any) error {
	return dbtx.Queue(ctx, tx, name, query, args...)
}

// Savepoint runs fn inside a savepoint of tx: if fn returns an error (or
// panics), everything it did through tx, queued statements included, is
// rolled back, tx stays usable and the error is returned. It is the way to
// roll back part of a step: a handler must not run SAVEPOINT or ROLLBACK
// itself, or end its transaction.
func Savepoint(ctx context.Context, tx Tx, fn func(tx Tx) error) (err error) {
	// One name for every savepoint: nested ones shadow it, and RELEASE and
	// ROLLBACK TO take the innermost, which is this call's. A name of its
	// own for each call was a statement PostgreSQL had never seen: pgx
	// prepared it (a round trip of its own in a pipeline) and cached it,
	// and pg_stat_statements kept an entry for each.
	const name = "pgsaga_savepoint"
	if p, ok := tx.(*dbtx.Pipe); ok {
		// Its SAVEPOINT and RELEASE go with the statements around them.
		return p.Savepoint(ctx, name, func() (err error) {
			defer func() {
				if p := recover(); p != nil {
					err = Recovered("savepoint's function", p)
				}
			}()
			return fn(tx)
		})
	}
	a, isAttempt := tx.(*attemptTx)
	exec := func(query string) error {
		if isAttempt {
			return a.execSavepoint(ctx, query)
		}
		_, err := tx.ExecContext(ctx, query)
		return err
	}
	if err := exec("SAVEPOINT " + name); err != nil {
		return fmt.Errorf("transport: opening savepoint: %w", err)
	}
	var mark queueMark
	var before []batchedRow // the attempt's batched rows queued before it
	if isAttempt {
		mark = a.queued()
		before = a.batchedRows()
	}
	defer func() {
		if p := recover(); p != nil {
			err = Recovered("savepoint's function", p)
		}
		if err == nil {
			if rerr := exec("RELEASE SAVEPOINT " + name); rerr != nil {
				err = fmt.Errorf("transport: releasing savepoint: %w", rerr)
			}
			return
		}
		if isAttempt {
			a.dropQueued(mark)
			// A handler's own savepoint statement inside fn may have
			// written them (see before): the rollback undoes that.
			a.setBatched(before)
		}
		if rerr := exec("ROLLBACK TO SAVEPOINT " + name + "; RELEASE SAVEPOINT " + name); rerr != nil {
			err = errors.Join(err, fmt.Errorf("transport: rolling back to savepoint: %w", rerr))
		}
	}()
	return fn(tx)
}

// stmt is a statement the transport sends in a pipeline.
type stmt struct {
	name  string
	query string
	args  []any
}

// StatementError names the statement of a pipeline that failed.
type StatementError struct {
	Name string
	Err  error
}

// Error implements error.
func (e *StatementError) Error() string { return e.Name + ": " + e.Err.Error() }

// Unwrap returns the underlying error.
func (e *StatementError) Unwrap() error { return e.Err }

// errNotInTransaction: the connection's transaction has ended, so a
// statement sent now would run, and commit, on its own.
var errNotInTransaction = errors.New("transport: the delivery transaction has ended")

// send runs stmts in one round trip (a pgx pipeline, extended protocol) in
// the transaction open on c, and names the statement that failed. It holds
// the connection like a database/sql statement does, and refuses to send
// anything once the transaction has ended (a handler's COMMIT or ROLLBACK,
// a rollback at the transaction's deadline): outside a transaction every
// statement would commit on its own.
func (c *conn) send(ctx context.Context, stmts ...stmt) error {
	if len(stmts) == 0 {
		return nil
	}
	return c.sendReading(ctx, stmts, nil)
}

// sendReading is send, reading the rows of each statement whose index is
// a key of readers with its reader.
func (c *conn) sendReading(ctx context.Context, stmts []stmt, readers map[int]func(pgx.Rows) error) error {
	return c.sql.Raw(func(any) error {
		if c.pg.PgConn().TxStatus() == 'I' {
			return errNotInTransaction
		}
		b := &pgx.Batch{}
		for _, s := range stmts {
			b.Queue(s.query, s.args...)
		}
		br := c.pg.SendBatch(context.WithoutCancel(ctx), b)
		for i, s := range stmts {
			var err error
			if read, ok := readers[i]; ok {
				var rows pgx.Rows
				if rows, err = br.Query(); err == nil {
					err = read(rows)
					rows.Close()
					if err == nil {
						err = rows.Err()
					}
				}
			} else {
				_, err = br.Exec()
			}
			if err != nil {
				_ = br.Close()
				return &StatementError{Name: s.name, Err: err}
			}
		}
		return br.Close()
	})
}

// exec runs query, statements without parameters, in one round trip (the
// simple protocol) in the transaction open on c, refusing once it has
// ended, like send. It is for the transport's own savepoint commands, which
// must run in a failed transaction too, where the extended protocol cannot
// prepare them.
func (c *conn) exec(ctx context.Context, name, query string) error {
	return c.sql.Raw(func(any) error {
		if c.pg.PgConn().TxStatus() == 'I' {
			return errNotInTransaction
		}
		if _, err := c.pg.Exec(context.WithoutCancel(ctx), query); err != nil {
			return &StatementError{Name: name, Err: err}
		}
		return nil
	})
}

// txState is what the client knows of a connection's transaction.
type txState int

const (
	txOpen txState = iota // in a transaction (possibly failed)
	txIdle                // the transaction has ended; the connection works
	txGone                // the connection is closed
)

// state reports the state of c's transaction, as of the last message from
// the server.
func (c *conn) state() txState {
	st := txGone
	_ = c.sql.Raw(func(any) error {
		switch pc := c.pg.PgConn(); {
		case pc.IsClosed():
		case pc.TxStatus() == 'I':
			st = txIdle
		default:
			st = txOpen
		}
		return nil
	})
	return st
}

// aborted reports whether c's transaction has failed (a statement's error
// on the server): only a rollback (to a savepoint) is accepted then.
func (c *conn) aborted() bool {
	failed := false
	_ = c.sql.Raw(func(any) error {
		failed = c.pg.PgConn().TxStatus() == 'E'
		return nil
	})
	return failed
}

// busy reports whether c is in the middle of a statement: a result set the
// handler has not closed yet.
func (c *conn) busy() bool {
	busy := false
	_ = c.sql.Raw(func(any) error {
		busy = c.pg.PgConn().IsBusy()
		return nil
	})
	return busy
}

// cancelRunning asks the server to cancel the statement running on c.
func (c *conn) cancelRunning() {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	_ = c.pg.PgConn().CancelRequest(ctx)
}

// attemptTx is the Tx a handler sees during one attempt: the delivery
// transaction's statements, not cancelled by the message context (bounds
// come from statement_timeout), refused once the attempt is over or the
// handler has ended the transaction, and a queue of the transport's writes.
type attemptTx struct {
	c       *conn
	tx      *sql.Tx
	expired func() bool // the transaction's deadline has passed

	// rowsCtx is cancelled when the attempt ends: database/sql then closes
	// the replayed rows a handler never scanned (see QueryRowContext).
	rowsCtx    context.Context
	cancelRows context.CancelFunc

	mu      sync.Mutex // held by each statement and by revoke
	over    bool
	ended   bool  // the handler ended the transaction
	sendErr error // queued statements could not be sent: the attempt cannot be kept
	queue   []stmt
	// batched: rows of batched writes (see QueueBatched), handed to d
	// when the attempt is kept.
	batched []batchedRow
	d       *deliveryTx
	// queueID is the queue row of the message whose attempt this is (0
	// for an in-process delivery), for the batch's claims.
	queueID int64
	// touched: something of the attempt reached the server (a statement
	// of its handler, its queued writes, an in-process delivery); an
	// attempt that fails untouched has nothing to roll back.
	touched  atomic.Bool
	hooks    []func() // run once the attempt's work commits (OnCommit)
	traceCtx traceCtx // the span of its handler's attempt
	rows     []*sql.Rows
	inFlight atomic.Bool // a handler statement is running

	cut     chan struct{} // closed to cut the attempt off
	cutOnce sync.Once

	// In-process deliveries (see InProcess): the router's handlers that
	// take them, how deep this attempt is nested in its publisher's, when
	// it must end, and the one running inside it now.
	local *localRoutes
	first bool // the message's first attempt, or a delivery in process
	// brokenBy: an in-process delivery inside this attempt broke its
	// transaction (ErrInProcessBroke); not the handler's doing.
	brokenBy error
	// unwound: an in-process delivery inside this attempt failed after
	// writing (errUnwound): the attempt cannot be kept, and runs again
	// with plan.
	unwound error
	// plan says what the deliveries in process of the root attempt and
	// of those nested in it do differently when it runs again after an
	// unwound one; shared by them all.
	plan     *localPlan
	parent   *attemptTx // the attempt whose publish this one delivers in process
	depth    int
	deadline time.Time
	child    atomic.Pointer[attemptTx]
}

var (
	_ Tx     = (*attemptTx)(nil)
	_ Queuer = (*attemptTx)(nil)
)

func newAttemptTx(d *deliveryTx) *attemptTx {
	ctx, cancel := context.WithCancel(context.Background())
	return &attemptTx{c: d.c, tx: d.tx, d: d, expired: d.expired, rowsCtx: ctx, cancelRows: cancel, cut: make(chan struct{}), local: d.local}
}

// usable returns why no statement may run now, or nil. The caller holds mu.
func (a *attemptTx) usable() error {
	switch {
	case a.over:
		return ErrAttemptOver
	case a.sendErr != nil:
		return a.sendErr
	case a.ended:
		return ErrTransactionEnded
	case a.unwound != nil:
		return a.unwound
	}
	return a.check()
}

// errTransactionGone: the delivery transaction ended, and not by a
// statement of the handler (the connection was lost, or the transaction
// was rolled back at its deadline).
var errTransactionGone = errors.New("transport: the delivery transaction is gone")

// check returns nil if the transaction is open. If it has ended on a
// working connection before its deadline, a statement of the handler ended
// it (nothing else does, but an in-process delivery inside the attempt:
// then brokenBy): the attempt is marked ended, ErrTransactionEnded.
// Otherwise (the connection is lost, or the transaction was rolled back at
// its deadline) errTransactionGone. The caller holds mu.
func (a *attemptTx) check() error {
	switch a.c.state() {
	case txOpen:
		return nil
	case txIdle:
		if a.brokenBy == nil && a.child.Load() != nil {
			// The in-process delivery running inside the attempt ended it.
			a.brokenBy = fmt.Errorf("%w (it ended the transaction)", ErrInProcessBroke)
		}
		if a.brokenBy != nil {
			return a.brokenBy
		}
		if !a.expired() {
			a.ended = true
			return ErrTransactionEnded
		}
	}
	return errTransactionGone
}

// before gets a handler statement going: the attempt must be usable, and
// what is queued goes first, so the statement sees it and a rollback to a
// savepoint the handler set takes it back. Batched rows (see QueueBatched)
// wait for the batch's end, but not past a statement that may set, roll
// back to or release a savepoint of the handler's (query names one): they
// are written first, so that the savepoint means for them what it means
// for the rest. The caller holds mu.
func (a *attemptTx) before(ctx context.Context, query string) error {
	if err := a.usable(); err != nil {
		return err
	}
	a.touched.Store(true) // the statement, and what goes first, reach the server
	stmts := a.queue
	if len(a.batched) > 0 && mentionsSavepoint(query) {
		bs, err := batchedStatements(a.batched)
		if err != nil {
			return err
		}
		stmts = append(stmts, bs...)
		a.batched = nil
	}
	if len(stmts) == 0 {
		return nil
	}
	a.queue = nil
	if err := a.c.send(ctx, stmts...); err != nil {
		a.sendErr = fmt.Errorf("transport: sending queued statements: %w", err)
		return a.sendErr
	}
	return nil
}

// mentionsSavepoint reports whether query may set, roll back to or release
// a savepoint (ROLLBACK TO and RELEASE need not say SAVEPOINT). A false
// alarm costs only the early write of the attempt's batched rows.
func mentionsSavepoint(query string) bool {
	for _, word := range [...]string{"savepoint", "rollback", "release"} {
		if containsFold(query, word) {
			return true
		}
	}
	return false
}

// containsFold reports whether s contains word (lower-case ASCII) in any
// case, without copying s.
func containsFold(s, word string) bool {
	for i := 0; i+len(word) <= len(s); i++ {
		if s[i]|0x20 == word[0] && strings.EqualFold(s[i:i+len(word)], word) {
			return true
		}
	}
	return false
}

// execSavepoint runs one of Savepoint's own commands: like ExecContext,
// but the attempt's batched rows stay queued (Savepoint keeps count of
// them itself).
func (a *attemptTx) execSavepoint(ctx context.Context, query string) error {
	a.mu.Lock()
	defer a.mu.Unlock()
	if err := a.before(ctx, ""); err != nil {
		return err
	}
	a.inFlight.Store(true)
	defer a.after()
	_, err := a.tx.ExecContext(context.WithoutCancel(ctx), query)
	return err
}

// after notes whether the handler's statement ended the transaction (see
// check).
func (a *attemptTx) after() {
	a.inFlight.Store(false)
	_ = a.check()
}

func (a *attemptTx) ExecContext(ctx context.Context, query string, args ...any) (sql.Result, error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if err := a.before(ctx, query); err != nil {
		return nil, err
	}
	a.inFlight.Store(true)
	defer a.after()
	return a.tx.ExecContext(context.WithoutCancel(ctx), query, args...)
}

func (a *attemptTx) QueryContext(ctx context.Context, query string, args ...any) (*sql.Rows, error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if err := a.before(ctx, query); err != nil {
		return nil, err
	}
	a.inFlight.Store(true)
	defer a.inFlight.Store(false)
	rows, err := a.tx.QueryContext(context.WithoutCancel(ctx), query, args...)
	if err == nil {
		a.rows = append(a.rows, rows)
	}
	return rows, err
}

// QueryRowContext reads the row at once and returns a replay of it (see
// replayRow): a row the handler never scans cannot keep the connection
// busy. If the attempt cannot run statements, Scan returns the reason.
func (a *attemptTx) QueryRowContext(ctx context.Context, query string, args ...any) *sql.Row {
	a.mu.Lock()
	defer a.mu.Unlock()
	if err := a.before(ctx, query); err != nil {
		return replayRow(context.Background(), replayed{Err: err})
	}
	a.inFlight.Store(true)
	defer a.after()
	r := readRow(a.tx.QueryContext(context.WithoutCancel(ctx), query, args...))
	if r.Err != nil {
		return replayRow(context.Background(), r)
	}
	return replayRow(a.rowsCtx, r)
}

// QueueExec queues a statement; see Queuer.
func (a *attemptTx) QueueExec(name, query string, args ...any) error {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.over {
		return ErrAttemptOver
	}
	a.queue = append(a.queue, stmt{name: name, query: query, args: cloneArgs(args)})
	return nil
}

// cloneArgs copies byte slices (json.RawMessage and other named ones
// included) and slices of them: a queued statement is sent after the
// caller returns, and may reuse the memory by then.
func cloneArgs(args []any) []any {
	out := make([]any, len(args))
	for i, v := range args {
		out[i] = cloneBytes(v)
	}
	return out
}

func cloneBytes(v any) any {
	rv := reflect.ValueOf(v)
	if rv.Kind() != reflect.Slice || rv.IsNil() {
		return v
	}
	switch el := rv.Type().Elem(); {
	case el.Kind() == reflect.Uint8:
		cp := reflect.MakeSlice(rv.Type(), rv.Len(), rv.Len())
		reflect.Copy(cp, rv)
		return cp.Interface()
	case el.Kind() == reflect.Slice && el.Elem().Kind() == reflect.Uint8:
		cp := reflect.MakeSlice(rv.Type(), rv.Len(), rv.Len())
		for j := range rv.Len() {
			if inner := rv.Index(j); !inner.IsNil() {
				c := reflect.MakeSlice(inner.Type(), inner.Len(), inner.Len())
				reflect.Copy(c, inner)
				cp.Index(j).Set(c)
			}
		}
		return cp.Interface()
	}
	return v
}

// queueMark is how much an attempt had queued at a savepoint: what was
// queued after it is dropped when the savepoint is rolled back.
type queueMark struct{ stmts, hooks, batched int }

func (a *attemptTx) queued() queueMark {
	a.mu.Lock()
	defer a.mu.Unlock()
	return queueMark{len(a.queue), len(a.hooks), len(a.batched)}
}

// batchedRows returns a copy of the attempt's queued batched rows.
func (a *attemptTx) batchedRows() []batchedRow {
	a.mu.Lock()
	defer a.mu.Unlock()
	return append([]batchedRow(nil), a.batched...)
}

func (a *attemptTx) setBatched(rows []batchedRow) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.batched = rows
}

func (a *attemptTx) dropQueued(mark queueMark) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if mark.stmts < len(a.queue) {
		a.queue = a.queue[:mark.stmts]
	}
	if mark.hooks < len(a.hooks) {
		a.hooks = a.hooks[:mark.hooks]
	}
	if mark.batched < len(a.batched) {
		a.batched = a.batched[:mark.batched]
	}
}

// OnCommit arranges for fn to run once the work of the delivery attempt
// running on tx has committed: after the commit of its batch (or of its
// own transaction, in HandleInTx), never if the attempt, a savepoint
// around the call (Savepoint), or the transaction is rolled back, nor if
// the outcome of the commit is unknown (the connection was lost during
// it). fn runs on the consumer's goroutine: it must be quick and must not
// block (count, log). pgsaga counts its metrics this way.
//
// It reports whether tx is a delivery attempt's transaction or a
// dbtx.Pipe (whose commit it sees too). For any other Tx (a transaction of
// the caller's) it registers nothing and returns false: the transport
// cannot see that commit, and the caller decides.
func OnCommit(tx Tx, fn func()) bool {
	if p, ok := tx.(*dbtx.Pipe); ok {
		p.OnCommit(fn)
		return true
	}
	a, ok := tx.(*attemptTx)
	if !ok {
		return false
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	if !a.over { // an attempt that is over commits nothing more
		a.hooks = append(a.hooks, fn)
	}
	return true
}

// InAttempt reports whether tx is the transaction of a delivery attempt,
// whose commit the transport sees (see OnCommit).
func InAttempt(tx Tx) bool {
	_, ok := tx.(*attemptTx)
	return ok
}

// takeHooks returns and forgets the attempt's commit hooks. The caller
// holds mu.
func (a *attemptTx) takeHooks() []func() {
	h := a.hooks
	a.hooks = nil
	return h
}

// runHooks runs commit hooks, each in isolation: a hook that panics is
// logged and does not stop the others.
func (t *Transport) runHooks(hooks []func()) {
	for _, h := range hooks {
		func() {
			defer func() {
				if p := recover(); p != nil {
					t.log.Error("transport: a commit hook panicked", "panic", PanicValue(p), "stack", string(debug.Stack()))
				}
			}()
			h()
		}()
	}
}

// revoke ends the handler's use of the attempt: it waits for a running
// statement, closes result sets left open (they keep the connection busy),
// notes whether a query the handler ran ended the transaction (the status
// is known once its result is closed) and refuses any later statement.
func (a *attemptTx) revoke() {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.over = true
	for _, r := range a.rows {
		_ = r.Close()
	}
	a.rows = nil
	a.cancelRows()
	if !a.ended && a.sendErr == nil {
		_ = a.check()
	}
}

// cutOff stops the attempt now: the statement it runs, if any, is
// cancelled, and the handler can run no more; an in-process delivery
// running inside it is cut off first.
func (a *attemptTx) cutOff() {
	if ch := a.child.Load(); ch != nil {
		ch.cutOff()
	}
	if a.inFlight.Load() {
		a.c.cancelRunning()
	}
	a.revoke()
	// A delivery that started while revoke waited for mu (tryLocal holds
	// it while it opens the savepoint) is visible now; none starts later.
	if ch := a.child.Load(); ch != nil {
		ch.cutOff()
	}
}

// requestCut asks the goroutine running the attempt to cut it off.
func (a *attemptTx) requestCut() { a.cutOnce.Do(func() { close(a.cut) }) }

// deliveryTx is the transaction attempts run in: a consumer's batch, or a
// transaction of the transport's own. While it is open its commit is
// refused (the commit guard) until the transport allows it, knowing that no
// attempt is open.
type deliveryTx struct {
	c  *conn
	tx *sql.Tx
	// spOpen: an empty attempt savepoint is open, made ready by the
	// previous step's pipeline.
	spOpen bool
	// more reports whether another attempt may follow in the transaction:
	// its savepoint is then opened ahead, in the pipeline that ends the
	// attempt before it.
	more func() bool
	// own: the transport commits the transaction itself after the attempt,
	// so the pipeline that keeps the attempt also allows the commit.
	own bool
	// expired reports whether the transaction's deadline has passed.
	expired func() bool
	// local: the handlers that take in-process deliveries from its
	// attempts (nil: none).
	local *localRoutes
	// hooks run once the transaction commits: those of its kept attempts
	// and the transport's own (a recorded retry or dead letter).
	hooks []func()
	// batched: rows of batched writes its kept attempts queued, written
	// when the batch ends (see writeBatched).
	batched []batchedRow
	// claims: the keys the batch claimed up front (see ClaimKeysPerBatch);
	// nil before its claim or without one.
	claims *batchClaims
	// loads: what the batch loaded up front (see LoadPerBatch); nil
	// without.
	loads *batchLoads
	// preluded: the batch's prelude (claim and load) has run.
	preluded bool
	// topic of the message of a transaction of the transport's own (a
	// consumer's messages carry theirs in their context).
	topic string
	// clock is the server's, as the transaction's first statement read it
	// (see DBNow); zero until then.
	clock dbClock
}

// open starts the attempt: a savepoint (already open, if the previous step
// opened it ahead).
func (a *attemptTx) open(ctx context.Context, d *deliveryTx) error {
	if d.spOpen {
		d.spOpen = false
		return nil
	}
	return a.c.send(ctx, stmt{"opening the attempt", openAttemptSQL, nil})
}

// keep sends the queued statements, keeps the attempt's work, and opens
// the next attempt's savepoint if one may follow, in one round trip. It
// runs after revoke. The attempt's batched rows, and the deletion of the
// message from its queue (id; none for 0), go to d, to be written when the
// batch ends, in the transaction, not in the attempt's savepoint: the row
// was locked by the transaction's claim, and changing it from a
// subtransaction would make every claimed row a MultiXact. A transaction
// of the transport's own writes them in the same round trip, after the
// savepoint's release.
func (a *attemptTx) keep(ctx context.Context, d *deliveryTx, id int64) error {
	a.mu.Lock()
	defer a.mu.Unlock()
	stmts, err := a.release(stmt{"keeping the attempt", releaseAttemptSQL, nil})
	if err != nil {
		return err
	}
	rows := a.batched
	if id != 0 {
		rows = append(rows, batchedRow{w: ackWrite, values: []any{id}})
	}
	if d.own {
		bs, err := batchedStatements(rows)
		if err != nil {
			return err
		}
		stmts, rows = append(stmts, bs...), nil
	}
	stmts, ahead := d.ending(stmts)
	a.touched.Store(true)
	err = a.c.send(ctx, stmts...)
	if pgerr.Is(err, pgerrcode.InvalidSavepointSpecification) { // the handler released or rolled back past it
		if a.brokenBy != nil {
			return errors.Join(a.brokenBy, err)
		}
		return fmt.Errorf("%w: %w", ErrTransactionEnded, err)
	}
	d.spOpen = err == nil && ahead
	if err == nil {
		d.hooks = append(d.hooks, a.takeHooks()...)
		d.batched = append(d.batched, rows...)
		a.batched = nil
	}
	return err
}

// release returns what keeps the attempt's work: its queued statements,
// then rel (the release of its savepoint), unless the attempt cannot be
// kept. It runs after revoke; the caller holds mu.
func (a *attemptTx) release(rel ...stmt) ([]stmt, error) {
	switch {
	case a.sendErr != nil:
		return nil, a.sendErr
	case a.ended:
		return nil, ErrTransactionEnded
	case a.unwound != nil:
		return nil, a.unwound
	}
	if err := a.check(); err != nil {
		return nil, err
	}
	stmts := append(a.queue, rel...)
	a.queue = nil
	return stmts, nil
}

// ending appends what ends a step of d to stmts: the next attempt's
// savepoint if one may follow (ahead), or the commit's permission in a
// transaction of the transport's own.
func (d *deliveryTx) ending(stmts []stmt) (_ []stmt, ahead bool) {
	switch {
	case d.own:
		return append(stmts, stmt{"allowing commit", allowCommitSQL, nil}), false
	case d.more():
		return append(stmts, stmt{"opening the next attempt", openAttemptSQL, nil}), true
	}
	return stmts, false
}

// record sends the statements that record an attempt's outcome outside it
// (a retry's time, a dead letter), with the next attempt's savepoint. A
// savepoint opened ahead is released first: what is recorded belongs to
// the transaction, not to a subtransaction.
func (d *deliveryTx) record(ctx context.Context, stmts ...stmt) error {
	if d.spOpen {
		stmts = append([]stmt{{"closing the unused attempt", releaseAttemptSQL, nil}}, stmts...)
		d.spOpen = false
	}
	stmts, ahead := d.ending(stmts)
	err := d.c.send(ctx, stmts...)
	d.spOpen = err == nil && ahead
	return err
}

// rollback takes back everything the attempt did; the transaction stays
// usable. A cancel request for a statement of the attempt can land on the
// rollback instead; it is then sent again.
func (a *attemptTx) rollback(ctx context.Context) error {
	return a.c.rollbackTo(ctx, "rolling back the attempt", rollbackAttemptSQL)
}

// rollbackTo runs query, a rollback to a savepoint and its release, again
// if a cancel request meant for the statement before it landed on it.
func (c *conn) rollbackTo(ctx context.Context, name, query string) error {
	err := c.exec(ctx, name, query)
	if pgerr.Is(err, pgerrcode.QueryCanceled) {
		err = c.exec(ctx, name, query)
	}
	return err
}

// run runs h on msg as attempt n, until deadline at most, and ends the
// handler's use of the transaction. An attempt that runs out of time or is
// cut off returns ErrAttemptTimeout; its handler goroutine may go on, but
// nothing it does reaches the database. The handler's context keeps the
// values of msg's, not its cancellation: a middleware acking the message
// early (which cancels its context) does not end the attempt.
func (a *attemptTx) run(msg *message.Message, n int, deadline time.Time, h HandlerFunc) error {
	ctx, cancel := context.WithDeadline(context.WithoutCancel(msg.Context()), deadline)
	defer cancel()
	a.deadline = deadline
	hm := handlerCopy(msg)
	hm.SetContext(context.WithValue(ContextWithTx(ctx, a), attemptKey{}, n))
	done := make(chan error, 1)
	var herr error
	attemptWorkers.Go(func() { herr = call(h, hm) }, func() { done <- herr })
	select {
	case err := <-done:
		a.revoke()
		return err
	case <-ctx.Done():
	case <-a.cut:
	}
	a.cutOff()
	return ErrAttemptTimeout
}

// attemptEnd is how one attempt ended.
type attemptEnd int

const (
	kept    attemptEnd = iota // the attempt's work is in the transaction
	failed                    // rolled back; the transaction is usable
	broken                    // the transaction can no longer commit
	refused                   // not started: the router is closing
	unwound                   // an in-process delivery failed after writing (see tryLocal)
)

// handle runs h on msg as attempt n in d (see attempt), and, if h asks for
// it with Instead, its replacement in a fresh attempt, within the same
// deadline: Config.AttemptTimeout from now. handler names h for
// Config.Intercept, which wraps the replacement too.
func (t *Transport) handle(d *deliveryTx, g *gate, msg *message.Message, id int64, n int, handler string, h HandlerFunc) (attemptEnd, error) {
	return t.handleBy(d, g, msg, id, n, time.Now().Add(t.cfg.AttemptTimeout), handler, h)
}

// handleBy is handle within a given deadline.
func (t *Transport) handleBy(d *deliveryTx, g *gate, msg *message.Message, id int64, n int, deadline time.Time, handler string, h HandlerFunc) (attemptEnd, error) {
	out, err := t.attempt(d, g, msg, id, n, deadline, h)
	for uw := (*unwoundError)(nil); out == failed && errors.As(err, &uw); {
		// Rolled back: run again at once, as the same attempt, with the
		// delivery that unwound it queued (or its Instead run in its
		// place), the others in process again.
		msg = withPlan(msg, uw.plan.again())
		out, err = t.attempt(d, g, msg, id, n, deadline, h)
	}
	if d.own {
		// No queue row to hand back while an awaited call runs.
		out, err = awaitInline(out, err, deadline, func() (attemptEnd, error) { return t.attempt(d, g, afterAwait(msg), id, n, deadline, h) })
	}
	var instead *InsteadError
	if out != failed || !errors.As(err, &instead) {
		return out, err
	}
	topic := TopicFromContext(msg.Context())
	if topic == "" {
		topic = d.topic
	}
	ih := t.wrap(handler, handler, topic, instead.Handler)
	return t.attempt(d, g, msg, id, n, deadline, ih)
}

// attempt runs h once, in a savepoint of d, and keeps its work, removing
// the message (queue id; 0 for none) from its queue with it, or rolls it
// back.
func (t *Transport) attempt(d *deliveryTx, g *gate, msg *message.Message, id int64, n int, deadline time.Time, h HandlerFunc) (attemptEnd, error) {
	a := newAttemptTx(d)
	a.first = n == 1
	a.plan = planFrom(msg.Context())
	a.queueID = id
	if g != nil {
		if !g.track(a) {
			return refused, ErrClosing
		}
		defer g.untrack(a)
	}
	ctx := context.Background()
	if err := a.open(ctx, d); err != nil {
		return broken, fmt.Errorf("transport: opening an attempt: %w", err)
	}
	herr := a.run(msg, n, deadline, h)
	if herr == nil {
		if herr = a.keep(ctx, d, id); herr == nil {
			return kept, nil
		}
	}
	a.mu.Lock()
	if a.unwound != nil {
		// Whatever the handler made of it: the delivery's writes are in
		// the attempt, which is therefore rolled back.
		herr = a.unwound
	}
	a.mu.Unlock()
	d.spOpen = false
	if !a.touched.Load() && a.untouchedOpen() {
		// Nothing of it reached the server: its savepoint is as it was
		// opened, and serves the next attempt (the charge's run after its
		// awaited call, say) instead of a rollback and a savepoint again.
		d.spOpen = true
		return failed, herr
	}
	if rerr := a.rollback(ctx); rerr != nil {
		if a.ended {
			herr = fmt.Errorf("%w (%w)", ErrTransactionEnded, herr)
		}
		return broken, errors.Join(herr, fmt.Errorf("transport: rolling back the attempt: %w", rerr))
	}
	if a.ended {
		// The savepoint survived, so the transaction did too; yet the
		// handler tried to end it.
		herr = fmt.Errorf("%w (%w)", ErrTransactionEnded, herr)
	}
	return failed, herr
}

// untouchedOpen reports whether the transaction of an attempt that sent
// nothing is still open as it was (not lost, not ended, not rolled back at
// its deadline): only then does its savepoint serve the next attempt.
func (a *attemptTx) untouchedOpen() bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	return !a.ended && a.brokenBy == nil && a.sendErr == nil && a.c.state() == txOpen
}

// result is a sql.Result for a queued statement: nothing is known of it
// until it is sent.
type result struct{}

func (result) LastInsertId() (int64, error) { return 0, errors.New("transport: not supported") }
func (result) RowsAffected() (int64, error) {
	return 0, errors.New("transport: a queued statement's result is not known until it is sent")
}

var _ driver.Result = result{}
