package transport

import (
	"cmp"
	"context"
	"database/sql"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unicode/utf8"

	"github.com/ThreeDotsLabs/watermill"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v3/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/pgsaga/pgsaga/internal/dbtx"
	"github.com/pgsaga/pgsaga/internal/pgerr"
	"github.com/pgsaga/pgsaga/internal/telemetry"
)

// route is one handler: what it is called, what it reads, and how its
// failures are retried.
type route struct {
	name  string
	topic string
	group string
	h     HandlerFunc
	retry RetryPolicy
	keys  *batchKeys // see ClaimKeysPerBatch; nil: none
	load  *BatchLoad // see LoadPerBatch; nil: none
}

// consumer is one consumer of a route: a watermill-sql subscriber claiming
// batches of the route's consumer group, and the delivery of what it claims.
// It is the subscriber's Beginner: each batch runs on a connection of its
// own, held from the claim to the commit.
type consumer struct {
	t     *Transport
	rt    route
	gate  *gate
	local *localRoutes // the router's in-process handlers
	poll  *pollState   // set when it subscribes
	log   *slog.Logger

	// commitFailed: the subscriber could not commit the last batch (see
	// commitWatch).
	commitFailed atomic.Bool

	mu  sync.Mutex
	cur *batch // the open batch, nil between batches
	// isolate: claims still to make one message at a time, after a batch
	// whose commit failed on something one of its messages did.
	isolate int
}

// batch is one claim of a consumer: its transaction, and what became of the
// messages it claimed.
type batch struct {
	d      deliveryTx
	cancel context.CancelFunc

	// run is held by the attempt running on the connection: a middleware
	// that acks early (Watermill's InstantAck) makes the subscriber hand
	// out the next message before the attempt ends.
	run sync.Mutex

	mu        sync.Mutex
	settled   *sync.Cond     // on mu: a delivery ended
	started   time.Time      // the first delivery; BatchTimeout counts from it
	claimed   int            // messages the claim returned
	keys      []claimRequest // their idempotency keys (see ClaimKeysPerBatch)
	loads     []loadRequest  // what their handlers read (see LoadPerBatch)
	handedOut int            // of those, handed to the consumer so far
	pending   int            // deliveries under way
	// committing: the subscriber commits; nothing more starts.
	committing bool
	// commitAsked: the commit was allowed; a failure of the statement
	// that allows it is a failure of what the batch did.
	commitAsked bool
	// batchedErr: writing the rows its attempts queued failed (see
	// commitQuery).
	batchedErr error
	released   int        // handed back untouched, for other consumers
	attempted  []delivery // messages whose attempts ran, in order
	broken     error      // why the batch can no longer commit
	// deadline is when the transaction is rolled back
	// (Config.MaxTransactionDuration after it began at begun); claimDone
	// is when the claim returned its first message.
	deadline, begun, claimDone time.Time
	// culprit is the message whose attempt broke the batch: its failure
	// is recorded once the batch has rolled back.
	culprit  *failure
	inFlight sync.WaitGroup // deliveries using the connection
	// ended is closed when the batch is over (committed or rolled back),
	// so that an awaited call's end can touch its message's row.
	ended chan struct{}
	// held: the deliveries whose awaited calls hold the batch (see
	// await), in order, until runHeld runs them again or parks them.
	held []*heldCall
}

// failure is a failed attempt of a message, to record.
type failure struct {
	d     delivery
	n     int
	cause error
	// what failed outside the batch: "" for an attempt that broke its
	// batch.
	what string
}

var _ wsql.Beginner = (*consumer)(nil)

func newConsumer(t *Transport, rt route, g *gate, local *localRoutes) *consumer {
	return &consumer{t: t, rt: rt, gate: g, local: local, log: t.log.With("handler", rt.name, "topic", rt.topic)}
}

// BeginTx opens a batch: a connection of its own (with its commit guard)
// and a READ COMMITTED transaction on it that is rolled back if it is still
// open after Config.MaxTransactionDuration.
func (c *consumer) BeginTx(ctx context.Context, opts *sql.TxOptions) (*sql.Tx, error) {
	if err := c.t.calls.room(ctx, c.t.cfg.MaxAwaitedCalls, c.log); err != nil {
		return nil, err
	}
	cn, err := c.t.acquire(ctx)
	if err != nil {
		return nil, err
	}
	txCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), c.t.cfg.MaxTransactionDuration())
	tx, err := cn.sql.BeginTx(txCtx, opts)
	if err != nil {
		cancel()
		cn.release()
		return nil, fmt.Errorf("transport: beginning a delivery transaction: %w", err)
	}
	b := &batch{cancel: cancel, ended: make(chan struct{}), begun: time.Now()}
	b.deadline, _ = txCtx.Deadline()
	b.settled = sync.NewCond(&b.mu)
	b.d = deliveryTx{c: cn, tx: tx, more: b.more, local: c.local, expired: func() bool { return txCtx.Err() != nil }}
	c.mu.Lock()
	c.cur = b
	c.mu.Unlock()
	return tx, nil
}

// claimLimit is how many messages the next claim may take.
func (c *consumer) claimLimit() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.isolate > 0 {
		return 1
	}
	return c.t.cfg.BatchSize
}

// claimedOne counts msg, a message of the current batch's claim with
// queue id id, read when the server's clock said dbNow (the batch's clock,
// see DBNow, is its first message's), and notes its key if the batch claims keys (on the
// subscriber's goroutine, before any middleware can touch the message), and
// what its handler reads if the batch loads it.
func (c *consumer) claimedOne(id int64, msg *message.Message, dbNow time.Time) {
	c.mu.Lock()
	b := c.cur
	c.mu.Unlock()
	if b != nil {
		b.mu.Lock()
		if b.claimed == 0 {
			b.claimDone = time.Now()
			b.d.clock = readClock(dbNow)
		}
		b.claimed++
		if c.rt.keys != nil && msg.Metadata.Get(metaUnreadable) == "" {
			if scope, key, hash, ok := c.rt.keys.keyOf(msg); ok {
				b.keys = append(b.keys, claimRequest{id: id, scope: scope, key: key, hash: hash})
			}
		}
		if c.rt.load != nil && msg.Metadata.Get(metaUnreadable) == "" {
			if key, args, ok := c.rt.load.key(msg); ok {
				b.loads = append(b.loads, loadRequest{key: key, args: args})
			}
		}
		b.mu.Unlock()
	}
}

// more reports whether messages of the claim are still to be handed out.
func (b *batch) more() bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	return (b.handedOut < b.claimed && !b.committing || len(b.held) > 0) && b.broken == nil
}

// commitQuery is what the subscriber runs right before committing the
// batch. It lets no other delivery in, waits for those under way (each
// ends within its attempt's deadline), and then allows the commit and
// checks the deferred constraints of what the batch did, so that a
// violation fails this statement, where the consumer learns of it, and not
// the commit, which the subscriber only logs. A broken batch gets a
// statement that fails instead: nothing of it commits.
func (c *consumer) commitQuery() string {
	c.mu.Lock()
	b := c.cur
	c.mu.Unlock()
	if b == nil {
		return refuseCommitSQL
	}
	b.mu.Lock()
	b.committing = true
	for b.pending > 0 {
		b.settled.Wait()
	}
	b.mu.Unlock()
	// The handlers whose calls returned by their hold run again, and the
	// others are parked, before anything is allowed.
	c.runHeld(b)
	b.mu.Lock()
	broken := b.broken != nil
	b.commitAsked = !broken
	b.mu.Unlock()
	if broken {
		return refuseCommitSQL
	}
	giveBack := b.d.claims.giveBack(c.rt.keys)
	if len(b.d.batched) == 0 && len(giveBack) == 0 {
		return commitSQL
	}
	// The rows the batch's attempts queued go with the commit's
	// permission, in one round trip, and then the claims of keys no
	// attempt completed are given back; a failure of theirs cannot be
	// pinned on one message: the batch is then delivered again one message
	// at a time (see endBatch). The connection is the attempts' (a
	// middleware may have returned before the attempt it started ended).
	b.run.Lock()
	defer b.run.Unlock()
	if err := b.d.writeBatched(context.Background(), append(giveBack, stmt{"allowing commit", allowCommitSQL, nil})...); err != nil {
		b.mu.Lock()
		b.batchedErr = err
		b.mu.Unlock()
		return refuseCommitSQL
	}
	return checkConstraintsSQL
}

// The rest of wsql.Beginner is not used by watermill-sql's subscriber;
// it refuses, so that nothing runs outside a batch by mistake.
var errNotABatch = errors.New("transport: a consumer runs statements only in its batches")

func (c *consumer) Exec(string, ...any) (sql.Result, error) { return nil, errNotABatch }
func (c *consumer) Query(string, ...any) (*sql.Rows, error) { return nil, errNotABatch }
func (c *consumer) QueryRow(string, ...any) *sql.Row {
	return replayRow(context.Background(), replayed{Err: errNotABatch})
}
func (c *consumer) QueryRowContext(context.Context, string, ...any) *sql.Row {
	return replayRow(context.Background(), replayed{Err: errNotABatch})
}
func (c *consumer) ExecContext(context.Context, string, ...any) (sql.Result, error) {
	return nil, errNotABatch
}
func (c *consumer) QueryContext(context.Context, string, ...any) (*sql.Rows, error) {
	return nil, errNotABatch
}

// endBatch closes the consumer's batch once the subscriber has committed or
// rolled it back (err: why the poll failed, if it did). It waits for
// deliveries still using the connection, returns the connection, records
// the failure of a message that broke the batch, and reports whether the
// consumer should poll again at once (messages were handed back, or the
// batch failed).
func (c *consumer) endBatch(err error) (again bool) {
	c.mu.Lock()
	b := c.cur
	c.cur = nil
	c.mu.Unlock()
	if b == nil {
		return false
	}
	b.inFlight.Wait()
	c.letGo(b) // calls still held when the batch ended without its commit
	expired := b.d.expired()
	// After a commit the connection is idle; after a commit whose
	// connection was lost, the outcome is unknown and nothing is told.
	idle := b.d.c.state() == txIdle
	b.cancel()
	b.d.c.release()
	b.d.loads.drop() // an awaited call may keep the batch for a while
	defer close(b.ended)
	var hooks []func()
	defer func() { c.t.runHooks(hooks) }() // once b.mu is unlocked
	b.mu.Lock()
	defer b.mu.Unlock()
	// The subscriber commits only after the statement that allows the
	// commit succeeded, and returns nil then; a broken or expired batch
	// fails that statement (err). A COMMIT that fails after it (a full
	// NOTIFY queue, say) is only logged by the subscriber: commitWatch
	// catches it.
	if committed := !c.commitFailed.Swap(false); err == nil && idle && committed {
		hooks = b.d.hooks
	}
	b.d.hooks = nil
	c.mu.Lock()
	if c.isolate > 0 && b.claimed > 0 {
		c.isolate--
	}
	c.mu.Unlock()
	commitFailed := b.commitAsked && failedOnServer(err) && !expired
	if commitFailed && b.batchedErr != nil {
		err = b.batchedErr
	}
	if b.culprit == nil && !b.commitAsked && b.batchedErr != nil && len(b.attempted) > 1 {
		commitFailed, err = true, b.batchedErr // written before the end (see breakBatchedWrite)
	}
	switch {
	case b.culprit != nil:
		c.recordAfter(*b.culprit)
	case commitFailed && len(b.attempted) == 1:
		c.recordAfter(failure{d: b.attempted[0], n: b.attempted[0].failed + 1,
			cause: fmt.Errorf("transport: the attempt's transaction could not commit: %w", err)})
	case commitFailed && len(b.attempted) > 1:
		c.mu.Lock()
		c.isolate = len(b.attempted)
		c.mu.Unlock()
		c.log.Warn("a delivery batch could not commit; claiming its messages one at a time to find the one at fault",
			"messages", len(b.attempted), "err", err)
	}
	return b.released > 0 || b.broken != nil || commitFailed
}

// enter returns the open batch if it is tx, counting the caller in its
// work on the connection (leave with b.inFlight.Done), or nil if that batch
// is over.
func (c *consumer) enter(tx *sql.Tx) *batch {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.cur == nil || c.cur.d.tx != tx {
		return nil
	}
	c.cur.inFlight.Add(1)
	return c.cur
}

// consumerKey carries a consumer in the context of the messages it claims.
type consumerKey struct{}

// A ticket is one delivery of a claimed message through the router. The
// gate, the outermost middleware, admits it into its batch before any
// other middleware runs (so that no middleware acking early can let the
// batch commit before the delivery), deliver runs it, and the gate settles
// it once the middleware chain has returned.
type ticket struct {
	c       *consumer
	b       *batch
	d       delivery
	uuid    string
	reached atomic.Bool // deliver has seen it
}

type ticketKey struct{}

// admit is the gate's admission of msg. It returns the message's ticket,
// and whether the middleware chain is to run at all: not for a message
// whose batch is over or takes no more deliveries (committing, broken,
// the router closing); such a message is handed back untouched.
func admit(msg *message.Message, closing bool) (*ticket, bool) {
	c, ok := msg.Context().Value(consumerKey{}).(*consumer)
	if !ok {
		return nil, true // not a claimed message: nothing to track
	}
	tx, _ := wsql.TxFromContext(msg.Context())
	return c.admit(tx, msg, closing)
}

// admit admits msg, claimed in the batch of transaction tx (see the
// function admit).
func (c *consumer) admit(tx *sql.Tx, msg *message.Message, closing bool) (*ticket, bool) {
	b := c.enter(tx)
	if b == nil {
		c.log.Error("transport: a message arrived after its batch ended; it stays queued", "message_uuid", msg.UUID)
		return nil, false
	}
	d, err := deliveryOf(msg.Metadata)
	if err != nil {
		b.inFlight.Done()
		c.log.Error("transport: a claimed message lacks its delivery record; releasing it", "message_uuid", msg.UUID, "err", err)
		return nil, false
	}
	if !b.admit(closing) {
		b.inFlight.Done()
		return nil, false
	}
	tk := &ticket{c: c, b: b, d: d, uuid: msg.UUID}
	msg.SetContext(context.WithValue(msg.Context(), ticketKey{}, tk))
	return tk, true
}

// admit counts a delivery as under way, unless the batch takes no more
// deliveries; the message is then handed back.
func (b *batch) admit(closing bool) bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.handedOut++
	if b.broken != nil || b.committing || closing {
		b.released++
		return false
	}
	b.pending++
	return true
}

// settle ends the delivery once the middleware chain has returned (mwErr:
// what it returned). A message whose handler was never reached (a
// middleware refused it, or passed on a message without its context)
// counts as a failed attempt, so that it is retried after its backoff and
// dead-lettered in the end like any other, instead of being claimed again
// at once, ahead of the others, forever.
func (tk *ticket) settle(mwErr error) {
	b := tk.b
	defer b.inFlight.Done()
	defer b.settle()
	if tk.reached.Load() {
		return
	}
	cause := ErrHandlerNotCalled
	if mwErr != nil {
		cause = fmt.Errorf("%w: %w", ErrHandlerNotCalled, mwErr)
	}
	b.run.Lock()
	defer b.run.Unlock()
	b.d.claims.free(tk.d.id)
	tk.c.fail(b, tk.c.log.With("message_uuid", tk.uuid), tk.d, tk.d.failed+1, cause)
}

// start decides, once the connection is free, whether an admitted
// delivery runs its attempt: not if the router is closing, the batch has
// used its window (Config.BatchTimeout from the first delivery), or the
// transaction's deadline leaves no room for a whole attempt (the claim or
// the middleware took that long). A message not started is handed back
// untouched.
func (b *batch) start(d delivery, cfg Config, closing bool) (ok bool, late bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	now := time.Now()
	if b.started.IsZero() {
		b.started = now
	}
	late = b.deadline.Sub(now) < cfg.AttemptTimeout+2*cfg.StatementTimeout
	if closing || late || now.Sub(b.started) > cfg.BatchTimeout {
		b.released++
		return false, late
	}
	b.attempted = append(b.attempted, d)
	return true, false
}

// settle ends an admitted delivery.
func (b *batch) settle() {
	b.mu.Lock()
	b.pending--
	b.settled.Broadcast()
	b.mu.Unlock()
}

// deliver handles one message the gate admitted: it releases it,
// dead-letters it, or runs an attempt and records the outcome. It always
// acks: what happens to the message next is recorded in its queue row, in
// the batch transaction, never by a redelivery inside it.
func (c *consumer) deliver(msg *message.Message) error {
	tk, _ := msg.Context().Value(ticketKey{}).(*ticket)
	if tk == nil {
		c.log.Error("transport: a message reached its handler without its context (a router middleware passed on another message); it counts as not handled", "message_uuid", msg.UUID)
		return nil
	}
	if tk.reached.Swap(true) {
		return nil // a middleware called the handler again: one attempt per delivery
	}
	b, d := tk.b, tk.d
	b.run.Lock()
	defer b.run.Unlock()
	c.prelude(b) // before the batch's first start, which counts its time
	wasKept := false
	defer func() {
		if !wasKept {
			// A copy later in the batch may take its claim; a held
			// delivery's run after its call takes it again (runHeld).
			b.d.claims.free(d.id)
		}
	}()
	if ok, late := b.start(d, c.t.cfg, c.gate.closing()); !ok {
		if late {
			c.t.late.tell(c.log, b)
		}
		return nil
	}
	log := c.log.With("message_uuid", msg.UUID)
	if d.unreadable != "" {
		c.deadLetter(b, log, d, d.failed+1, Permanent(fmt.Errorf("message %s cannot be read: %s", msg.UUID, d.unreadable)))
		return nil
	}
	n := d.failed + 1
	deadline := time.Now().Add(c.t.cfg.AttemptTimeout)
	if d.awaited > 0 {
		msg = afterAwait(msg) // delivered again after its park
	}
	out := c.run(b, log, d, msg, n, deadline, true)
	wasKept = out == kept
	if out == refused {
		c.release(b)
	}
	return nil
}

// run runs the attempts of delivery d of b (the connection is the
// caller's: it holds b.run) until one ends it, and returns how the last
// ended: kept, refused (not started: the router is closing; the caller
// hands the message back), or else failed or broken, recorded. hold: an
// awaited call may hold the batch (see await); a call it holds is run
// again by the batch before its commit (runHeld).
func (c *consumer) run(b *batch, log *slog.Logger, d delivery, msg *message.Message, n int, deadline time.Time, hold bool) attemptEnd {
	wrote := false // the batch's queued rows were written for it once
	for {
		out, err := c.t.handleBy(&b.d, c.gate, msg, d.id, n, deadline, c.rt.name, c.rt.h)
		switch out {
		case kept, refused:
		case broken:
			c.breakBatch(b, log, d, n, err)
		case failed:
			if !wrote && errors.Is(err, dbtx.ErrBatchedPending) && len(b.d.batched) > 0 {
				// It read a row an earlier attempt changed with a write
				// still queued: written now, in the transaction, it runs
				// again.
				wrote = true
				if werr := b.d.writeBatched(context.Background()); werr != nil {
					c.breakBatchedWrite(b, log, werr)
					return broken
				}
				continue
			}
			if hb := (*HandBackError)(nil); errors.As(err, &hb) {
				c.handBack(b, log, d, hb)
			} else if aw := (*AwaitError)(nil); errors.As(err, &aw) {
				c.await(b, log, d, msg, n, aw, hold)
			} else {
				c.fail(b, log, d, n, err)
			}
		}
		return out
	}
}

// release hands a message of b back untouched.
func (c *consumer) release(b *batch) {
	b.mu.Lock()
	b.released++
	b.mu.Unlock()
}

// handBack hands a message of b back untouched (see HandBack): no attempt
// is counted, and it is parked for handBackWait, with the batch's writes.
func (c *consumer) handBack(b *batch, log *slog.Logger, d delivery, hb *HandBackError) {
	n := d.handedBack + 1
	wait := handBackWait(n)
	b.d.batched = append(b.d.batched, batchedRow{w: parkWrite,
		values: []any{d.id, wait.Seconds(), strconv.Itoa(n), reason(hb), metaHandedBack}})
	b.d.hooks = append(b.d.hooks, func() { c.t.metrics.HandedBack(c.rt.topic, c.rt.name) })
	log.Debug("message handed back untouched for another consumer of its group", "times", n, "again_in_ms", telemetry.Millis(wait), "reason", hb.Cause)
}

// fail records a failed attempt: the message is retried after its backoff,
// or dead-lettered when it failed permanently or ran out of attempts.
func (c *consumer) fail(b *batch, log *slog.Logger, d delivery, n int, cause error) {
	if c.final(n, cause) {
		c.deadLetter(b, log, d, n, cause)
		return
	}
	wait := backoff(c.rt.retry, n)
	err := b.d.record(context.Background(), stmt{"recording a failed attempt", rescheduleSQL,
		[]any{d.id, n, wait.Seconds(), reason(cause)}})
	if err != nil {
		c.breakBatch(b, log, d, n, errors.Join(cause, err))
		return
	}
	b.d.hooks = append(b.d.hooks, func() { c.t.metrics.Retrying(c.rt.topic, c.rt.name) })
	level, what := slog.LevelWarn, "attempt failed; the message will be retried"
	if pgerr.Retryable(cause) {
		// A conflict with concurrent work (a serialization failure, a
		// deadlock, a saga instance saved meanwhile): expected under load,
		// and the retry reads afresh.
		level, what = slog.LevelInfo, "attempt conflicted with concurrent work; the message will be retried"
	}
	log.Log(context.Background(), level, what, append([]any{"attempt", n, "of", c.rt.retry.MaxAttempts, "retry_in_ms", telemetry.Millis(wait), "err", cause}, panicStack(cause)...)...)
}

// final reports whether failed attempt n is the message's last (see
// RetryPolicy.final).
func (c *consumer) final(n int, cause error) bool { return final(c.rt.retry, n, cause) }

// deadLetter moves the message to pgsaga_dead_letters, in the batch.
func (c *consumer) deadLetter(b *batch, log *slog.Logger, d delivery, n int, cause error) {
	err := b.d.record(context.Background(), stmt{"dead-lettering the message", deadLetterSQL,
		[]any{d.id, c.rt.name, reason(cause), n}})
	if err != nil {
		c.breakBatch(b, log, d, n, errors.Join(cause, err))
		return
	}
	b.d.hooks = append(b.d.hooks, func() { c.t.metrics.DeadLettered(c.rt.topic, c.rt.name) })
	log.Error("message dead-lettered", append([]any{"attempts", n, "permanent", IsPermanent(cause), "reason", cause}, panicStack(cause)...)...)
}

// breakBatch gives up on the batch: its transaction can no longer commit
// (the connection is gone, the attempt could not be rolled back, the
// handler ended the transaction). The rest of it is released untouched,
// and every message of it is delivered again; the failure of the message
// whose attempt broke it is recorded once the batch no longer holds it
// (see recordAfter), so that a message that breaks its batch every time
// runs out of attempts like any other.
func (c *consumer) breakBatch(b *batch, log *slog.Logger, d delivery, n int, cause error) {
	b.mu.Lock()
	first := b.broken == nil
	if first {
		b.broken = cause
		b.culprit = &failure{d: d, n: n, cause: cause}
	}
	b.mu.Unlock()
	if first {
		level := slog.LevelWarn
		if pgerr.ConnectionLost(cause) {
			level = slog.LevelInfo
		}
		log.Log(context.Background(), level, "delivery batch abandoned; its messages will be delivered again", "cause", cause)
	}
}

// breakBatchedWrite gives up on the batch when writing the rows its kept
// attempts queued failed before its end: the rows are theirs, not the
// message's under way, so no attempt is charged; the batch's messages are
// delivered again one a batch (see endBatch), which finds the one at
// fault.
func (c *consumer) breakBatchedWrite(b *batch, log *slog.Logger, err error) {
	b.mu.Lock()
	first := b.broken == nil
	if first {
		b.broken, b.batchedErr = err, err
	}
	b.mu.Unlock()
	if first {
		log.Warn("delivery batch abandoned: writing what its attempts queued failed; its messages will be delivered one at a time", "err", err)
	}
}

// recordAfter records a failed attempt after its batch rolled back (or,
// for an awaited call, after its batch ended), in a transaction of its own: the message is retried after its backoff, or
// dead-lettered (see final). It waits up to Config.LockTimeout for the
// message's row: the batch's own backend may still hold it while it exits
// (a lost connection), or another consumer, which then decides. Nothing is
// recorded if that attempt is recorded already.
func (c *consumer) recordAfter(f failure) {
	log := c.log.With("queue_id", f.d.id, "attempt", f.n)
	final := c.final(f.n, f.cause)
	wait := backoff(c.rt.retry, f.n)
	query, args := rescheduleSQL, []any{f.d.id, f.n, wait.Seconds(), reason(f.cause)}
	if final {
		query, args = deadLetterSQL, []any{f.d.id, c.rt.name, reason(f.cause), f.n}
	}
	done, err := c.t.execWaiting(query, args...)
	what := cmp.Or(f.what, "attempt that broke its batch")
	switch {
	case pgerr.LockNotAvailable(err): // another consumer holds it
		log.Info("the message of a failed "+what+" is held by another consumer; its failure is not recorded", "err", f.cause)
	case err != nil:
		log.Error("recording the failure of an "+what+" failed; the message will be delivered again", "err", err, "cause", f.cause)
	case !done:
	case final:
		c.t.metrics.DeadLettered(c.rt.topic, c.rt.name)
		log.Error("message dead-lettered", append([]any{"attempts", f.n, "permanent", IsPermanent(f.cause), "reason", f.cause}, panicStack(f.cause)...)...)
	default:
		c.t.metrics.Retrying(c.rt.topic, c.rt.name)
		log.Warn(what+" failed; the message will be retried", append([]any{"of", c.rt.retry.MaxAttempts, "retry_in_ms", telemetry.Millis(wait), "err", f.cause}, panicStack(f.cause)...)...)
	}
}

// commitWatch is the logger a consumer gives its watermill-sql subscriber:
// the subscriber reports a batch's failed COMMIT only by logging it (the
// poll then returns no error), and nothing of a batch that did not commit
// may be told (OnCommit).
type commitWatch struct {
	watermill.LoggerAdapter
	c *consumer
}

// wsqlCommitFailed is what watermill-sql's subscriber logs when the
// COMMIT of a batch fails (TestCommitWatchKnowsWatermillSQL reads it from
// the module's source).
const wsqlCommitFailed = "could not commit tx for querying message"

func (w commitWatch) Error(msg string, err error, fields watermill.LogFields) {
	if msg == wsqlCommitFailed {
		// The consumer reports what it does about it (a retry, or the
		// message at fault isolated): the commit guard refusing a batch
		// is by design, not an error of its own.
		w.c.commitFailed.Store(true)
		w.LoggerAdapter.Info("a delivery batch's COMMIT failed; its messages are delivered again",
			fields.Add(watermill.LogFields{"err": err}))
		return
	}
	w.LoggerAdapter.Error(msg, err, fields)
}

func (w commitWatch) With(fields watermill.LogFields) watermill.LoggerAdapter {
	return commitWatch{LoggerAdapter: w.LoggerAdapter.With(fields), c: w.c}
}

// failedOnServer reports whether err, from the statement that lets a batch
// commit, is the server's refusal (a deferred check failed, or the
// connection died running it) rather than the batch having ended before.
func failedOnServer(err error) bool {
	if err == nil || errors.Is(err, sql.ErrTxDone) {
		return false
	}
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) || pgerr.ConnectionLost(err)
}

// reason is err as text PostgreSQL accepts (valid UTF-8, no NUL), at most
// 2000 bytes.
func reason(err error) string {
	s := strings.ToValidUTF8(err.Error(), "\uFFFD")
	s = strings.ReplaceAll(s, "\x00", "\uFFFD")
	if len(s) > 2000 {
		cut := 2000
		for cut > 0 && !utf8.RuneStart(s[cut]) {
			cut--
		}
		s = s[:cut] + "…"
	}
	return s
}

// lateLog tells of batches whose first delivery came too late for an
// attempt to fit in their transaction, at Warn at most once a minute per
// transport (after a restart every consumer's first batch may be late at
// once), at Debug otherwise.
type lateLog struct {
	mu         sync.Mutex
	last       time.Time
	suppressed int
}

func (l *lateLog) tell(log *slog.Logger, b *batch) {
	b.mu.Lock()
	begun, claimDone := b.begun, b.claimDone
	b.mu.Unlock()
	now := time.Now()
	if claimDone.IsZero() {
		claimDone = now
	}
	l.mu.Lock()
	level, more := slog.LevelDebug, 0
	if now.Sub(l.last) >= time.Minute {
		level, more, l.last, l.suppressed = slog.LevelWarn, l.suppressed, now, 0
	} else {
		l.suppressed++
	}
	l.mu.Unlock()
	// Where the time went: the claim (the database slow to answer: a
	// restart, a lock, a busy server), or between the claim and the
	// delivery (this process starved of CPU, or router middleware).
	log.Log(context.Background(), level, "transport: a delivery batch came to its first message too late for an attempt to fit in its transaction; its messages are handed back untouched for the next batch",
		"claim_took_ms", telemetry.Millis(claimDone.Sub(begun)), "then_waited_ms", telemetry.Millis(now.Sub(claimDone)),
		"more_since_last_warning", more)
}
