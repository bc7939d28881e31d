package dbtx

import (
	"context"
	"crypto/sha256"
	"database/sql"
	"database/sql/driver"
	"encoding/hex"
	"errors"
	"fmt"
	"sync"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"
)

// Queuer is a transaction that can hold back a write nobody reads back in
// it: a statement queued with QueueExec is sent with the transaction's
// next statement, or its commit, in the same round trip, and commits with
// it or not at all; its failure fails that statement and the transaction.
// name says what the statement does, in errors. Arguments are encoded when
// the statement is sent: do not change them after the call.
type Queuer interface {
	QueueExec(name, query string, args ...any) error
}

// Queue queues query on tx if tx is a Queuer, and runs it at once
// otherwise.
func Queue(ctx context.Context, tx DBTX, name, query string, args ...any) error {
	if q, ok := tx.(Queuer); ok {
		return q.QueueExec(name, query, args...)
	}
	if _, err := tx.ExecContext(ctx, query, args...); err != nil {
		return fmt.Errorf("%s: %w", name, err)
	}
	return nil
}

// Pipe is a READ COMMITTED transaction on a pgx connection that sends
// what it can together, each group in one round trip: BEGIN with its first
// statement, and the writes queued with QueueExec with the next statement
// or the commit. It is the transaction of one goroutine: its methods must
// not be called concurrently. Rows are read in full, as FromPgx reads
// them.
type Pipe struct {
	conn  *pgx.Conn
	queue []stmt
	begun bool // BEGIN has been sent
	// taken counts the statements taken off the queue, in order (BEGIN is
	// the 0th), sent or not; ran, the first of them that the server
	// carried out.
	taken, ran int
	err        error // the transaction failed: nothing but a rollback runs
	ended      bool
	hooks      []func() // run once it commits (OnCommit)
	// unsent: err is that of the unsent-th statement, which could not be
	// prepared or encoded: nothing of its group left, and it is queued
	// still (-1: err, if any, is the server's).
	unsent int
}

type stmt struct {
	name  string
	query string
	args  []any
	// control: a transaction control statement without arguments (BEGIN,
	// COMMIT, SAVEPOINT, RELEASE), sent as it is rather than prepared.
	control bool
}

// statementNames are the names of the statements Pipes prepare: their
// own, so that what runs the same text on the connection otherwise
// (pgx's Exec of a statement prepared by its text) is not changed.
var statementNames sync.Map // query -> name

func statementName(query string) string {
	if name, ok := statementNames.Load(query); ok {
		return name.(string)
	}
	sum := sha256.Sum256([]byte(query))
	name := "pgsaga_pipe_" + hex.EncodeToString(sum[:12])
	statementNames.Store(query, name)
	return name
}

const beginSQL = "begin isolation level read committed"

// ErrPipeEnded is returned by a statement on a Pipe that has committed or
// rolled back: database/sql's sql.ErrTxDone, as a *sql.Tx would return.
var ErrPipeEnded = sql.ErrTxDone

// BeginPipe starts a Pipe on conn; BEGIN is sent with its first
// statement. conn must be idle, and be used by nothing else until the
// Pipe ends.
func BeginPipe(conn *pgx.Conn) *Pipe {
	return &Pipe{conn: conn, queue: []stmt{{name: "beginning a transaction", query: beginSQL, control: true}}, unsent: -1}
}

var (
	_ DBTX   = (*Pipe)(nil)
	_ Queuer = (*Pipe)(nil)
)

// QueueExec queues a write (see Queuer).
func (p *Pipe) QueueExec(name, query string, args ...any) error {
	if err := p.usable(); err != nil {
		return err
	}
	p.queue = append(p.queue, stmt{name: name, query: query, args: append([]any(nil), positional(args)...)})
	return nil
}

func (p *Pipe) usable() error {
	if p.ended {
		return ErrPipeEnded
	}
	return p.err
}

// ExecContext runs query after what is queued, in one round trip.
func (p *Pipe) ExecContext(ctx context.Context, query string, args ...any) (sql.Result, error) {
	var tag pgconn.CommandTag
	err := p.send(ctx, stmt{query: query, args: positional(args)}, func(rr *pgconn.ResultReader) error {
		var err error
		tag, err = rr.Close()
		return err
	})
	if err != nil {
		return nil, err
	}
	return driver.RowsAffected(tag.RowsAffected()), nil
}

// QueryContext runs query after what is queued, in one round trip, and
// reads its rows in full.
func (p *Pipe) QueryContext(ctx context.Context, query string, args ...any) (*sql.Rows, error) {
	return p.read(ctx, query, args).Rows(ctx)
}

// QueryRowContext is QueryContext's first row.
func (p *Pipe) QueryRowContext(ctx context.Context, query string, args ...any) *sql.Row {
	return p.read(ctx, query, args).Row(ctx)
}

func (p *Pipe) read(ctx context.Context, query string, args []any) Result {
	var r Result
	err := p.send(ctx, stmt{query: query, args: positional(args)}, func(rr *pgconn.ResultReader) error {
		r = readResult(rr, p.conn.TypeMap())
		return r.Err
	})
	if err != nil {
		return Result{Err: err}
	}
	return r
}

// Flush sends what is queued, if anything, in one round trip.
func (p *Pipe) Flush(ctx context.Context) error {
	if err := p.usable(); err != nil {
		return err
	}
	if len(p.queue) == 0 {
		return nil
	}
	last := p.queue[len(p.queue)-1]
	p.queue = p.queue[:len(p.queue)-1]
	return p.send(ctx, last, closeResult)
}

// Commit sends what is queued and COMMIT, in one round trip. A
// transaction that failed is rolled back, and its error returned.
func (p *Pipe) Commit(ctx context.Context) error {
	if p.ended {
		return ErrPipeEnded
	}
	if p.err != nil {
		err := p.err
		return errors.Join(err, p.Rollback(ctx))
	}
	if !p.begun && len(p.queue) == 1 {
		// Nothing but BEGIN: there is nothing to commit.
		p.ended, p.queue = true, nil
		return nil
	}
	err := p.send(ctx, stmt{name: "committing", query: "commit", control: true}, closeResult)
	if err != nil {
		return errors.Join(err, p.Rollback(ctx))
	}
	p.ended = true
	if p.conn.PgConn().TxStatus() != 'I' {
		return errors.New("dbtx: the transaction is still open after its commit")
	}
	hooks := p.hooks
	p.hooks = nil
	for _, fn := range hooks {
		fn()
	}
	return nil
}

// Rollback drops what is queued and rolls back what reached the server.
// It is a no-op once the transaction has ended.
func (p *Pipe) Rollback(ctx context.Context) error {
	if p.ended {
		return nil
	}
	p.ended, p.queue, p.hooks = true, nil, nil
	if !p.begun || p.conn.IsClosed() || p.conn.PgConn().TxStatus() == 'I' {
		return nil
	}
	if _, err := p.conn.Exec(context.WithoutCancel(ctx), "rollback", pgx.QueryExecModeSimpleProtocol); err != nil {
		// A connection left in a transaction must not go back to a pool.
		_ = p.conn.Close(context.Background())
		return fmt.Errorf("dbtx: rolling back: %w", err)
	}
	return nil
}

// OnCommit arranges for fn to run once the transaction has committed:
// never if it, or a savepoint around the call, rolls back, nor if the
// outcome of its commit is unknown (the connection was lost during it).
func (p *Pipe) OnCommit(fn func()) {
	if !p.ended {
		p.hooks = append(p.hooks, fn)
	}
}

// Savepoint runs fn inside a savepoint: if fn returns an error, or one
// of the statements queued inside it fails, what fn did, queued writes
// included, is undone and the transaction stays usable. SAVEPOINT goes
// with fn's first statement, RELEASE with what fn left queued, in one
// round trip: its writes' failures are known before it returns. A
// savepoint whose function fails before its SAVEPOINT left is undone by
// dropping the queue.
func (p *Pipe) Savepoint(ctx context.Context, name string, fn func() error) (err error) {
	if err := p.usable(); err != nil {
		return err
	}
	at := p.taken + len(p.queue) // the SAVEPOINT's place in the order sent
	hooks := len(p.hooks)
	p.queue = append(p.queue, stmt{name: "opening savepoint", query: "SAVEPOINT " + name, control: true})
	err = fn()
	if err == nil && p.err != nil {
		err = p.err // fn swallowed the error of a statement of its own
	}
	if err == nil {
		p.queue = append(p.queue, stmt{name: "releasing savepoint", query: "RELEASE SAVEPOINT " + name, control: true})
		err = p.Flush(ctx)
	}
	if err != nil {
		p.hooks = p.hooks[:hooks]
		return p.undo(ctx, name, at, err)
	}
	return nil
}

// undo takes back a savepoint that failed with cause: its SAVEPOINT is
// the at-th statement of the transaction.
func (p *Pipe) undo(ctx context.Context, name string, at int, cause error) error {
	switch {
	case p.ended:
		return cause
	case at >= p.taken:
		// It never left, nor did anything queued after it.
		p.queue = p.queue[:at-p.taken]
		if p.err != nil && p.unsent >= at {
			// What failed was fn's, and never left: the transaction
			// goes on without it.
			p.err, p.unsent = nil, -1
		}
		return cause
	case at >= p.ran:
		// It was taken but never carried out: the failure came before it
		// (or nothing was sent), and the transaction cannot go on.
		p.queue = nil
		return cause
	}
	p.queue = nil // all of it was queued after the SAVEPOINT
	if _, err := p.conn.Exec(context.WithoutCancel(ctx), "ROLLBACK TO SAVEPOINT "+name+"; RELEASE SAVEPOINT "+name, pgx.QueryExecModeSimpleProtocol); err != nil {
		p.taken++
		p.fail("rolling back to savepoint", err)
		return errors.Join(cause, p.err)
	}
	p.taken++
	p.ran = p.taken
	p.err = nil
	return cause
}

// send sends what is queued and last in one round trip (a pipeline of
// prepared statements: a statement this connection has not prepared yet
// costs one round trip of its own, once); result reads last's result.
// Rows come in the formats pgx's database/sql driver asks for, so they
// scan as its rows do.
func (p *Pipe) send(ctx context.Context, last stmt, result func(*pgconn.ResultReader) error) error {
	if err := p.usable(); err != nil {
		return err
	}
	stmts := append(p.queue, last)
	p.queue = nil
	base := p.ran
	p.taken += len(stmts)
	descs := make([]*pgconn.StatementDescription, len(stmts))
	for i, s := range stmts {
		if s.control {
			continue
		}
		sd, err := p.conn.Prepare(ctx, statementName(s.query), s.query)
		if err != nil {
			return p.failUnsent(stmts, base, i, err)
		}
		descs[i] = sd
	}
	types := p.conn.TypeMap()
	var eqb pgx.ExtendedQueryBuilder
	params := make([][][]byte, len(stmts))
	paramFormats := make([][]int16, len(stmts))
	for i, s := range stmts {
		if s.control {
			continue
		}
		if err := eqb.Build(types, descs[i], s.args); err != nil {
			return p.failUnsent(stmts, base, i, err)
		}
		// eqb reuses its buffers: keep this statement's.
		params[i] = make([][]byte, len(eqb.ParamValues))
		for j, v := range eqb.ParamValues {
			if v != nil {
				params[i][j] = append([]byte{}, v...)
			}
		}
		paramFormats[i] = append([]int16(nil), eqb.ParamFormats...)
	}
	tr := p.tracer(ctx, stmts)
	pipe := p.conn.PgConn().StartPipeline(ctx)
	for i, s := range stmts {
		if s.control {
			pipe.SendQueryParams(s.query, nil, nil, nil, nil)
			continue
		}
		formats := make([]int16, len(descs[i].Fields))
		for j, f := range descs[i].Fields {
			formats[j] = binaryResults[f.DataTypeOID] // text (0) unless listed
		}
		pipe.SendQueryStatement(descs[i], params[i], paramFormats[i], formats)
	}
	p.begun = true
	if err := pipe.Sync(); err != nil {
		_ = pipe.Close()
		tr.end(err)
		return p.fail(stmts[0].name, err)
	}
	for i, s := range stmts {
		res, err := pipe.GetResults()
		var tag pgconn.CommandTag
		if err == nil {
			rr, ok := res.(*pgconn.ResultReader)
			switch {
			case !ok:
				err = fmt.Errorf("dbtx: unexpected pipeline result %T", res)
			case i == len(stmts)-1:
				err = result(rr)
				tag, _ = rr.Close() // closed already: its tag
			default:
				tag, err = rr.Close()
			}
		}
		tr.query(s, tag, err)
		if err != nil {
			_ = pipe.Close()
			tr.end(err)
			p.ran = base + i
			return p.fail(s.name, err)
		}
	}
	p.ran = base + len(stmts)
	err := pipe.Close()
	tr.end(err)
	if err != nil {
		return p.fail(last.name, err)
	}
	return nil
}

// pipeTrace hands a round trip of a Pipe to its connection's batch
// tracer, if it has one, as pgx does a batch's.
type pipeTrace struct {
	ctx  context.Context
	conn *pgx.Conn
	t    pgx.BatchTracer
}

func (p *Pipe) tracer(ctx context.Context, stmts []stmt) pipeTrace {
	t, ok := p.conn.Config().Tracer.(pgx.BatchTracer)
	if !ok {
		return pipeTrace{}
	}
	b := &pgx.Batch{}
	for _, s := range stmts {
		b.Queue(s.query, s.args...)
	}
	return pipeTrace{ctx: t.TraceBatchStart(ctx, p.conn, pgx.TraceBatchStartData{Batch: b}), conn: p.conn, t: t}
}

func (t pipeTrace) query(s stmt, tag pgconn.CommandTag, err error) {
	if t.t != nil {
		t.t.TraceBatchQuery(t.ctx, t.conn, pgx.TraceBatchQueryData{SQL: s.query, Args: s.args, CommandTag: tag, Err: err})
	}
}

func (t pipeTrace) end(err error) {
	if t.t != nil {
		t.t.TraceBatchEnd(t.ctx, t.conn, pgx.TraceBatchEndData{Err: err})
	}
}

// failUnsent records that the i-th of stmts, the group starting at the
// base-th statement, cannot be sent: the group goes back to the queue
// (a savepoint around the statement can still drop it), the transaction
// fails.
func (p *Pipe) failUnsent(stmts []stmt, base, i int, err error) error {
	p.queue, p.taken = stmts, base
	p.unsent = base + i
	return p.fail(stmts[i].name, err)
}

// fail records that a statement, named name, failed with err: the
// transaction is aborted (or its connection gone). It returns the error.
func (p *Pipe) fail(name string, err error) error {
	if name != "" {
		err = fmt.Errorf("%s: %w", name, err)
	}
	p.err = err
	return err
}

func closeResult(rr *pgconn.ResultReader) error {
	_, err := rr.Close()
	return err
}

// readResult reads rr's rows in full, as readPgxRows does.
func readResult(rr *pgconn.ResultReader, types *pgtype.Map) Result {
	fields := rr.FieldDescriptions()
	r := Result{Columns: columnNames(fields)}
	for rr.NextRow() {
		row, err := decodeRow(types, fields, rr.Values())
		if err != nil {
			_, _ = rr.Close()
			return Result{Err: err}
		}
		r.Values = append(r.Values, row)
	}
	if _, err := rr.Close(); err != nil {
		return Result{Err: err}
	}
	return r
}
