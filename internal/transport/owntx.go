package transport

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/pgsaga/pgsaga/internal/telemetry"
)

// HandleInTx handles msg outside a consumer, each attempt in a READ
// COMMITTED transaction of its own that commits when the attempt succeeds:
// the counterpart of a Router handler for messages that arrive another way
// (an HTTP request, another transport). The attempt runs as a Router's does
// (deadline, queued writes, commit guard, Instead); failed attempts are
// retried after their backoff with no transaction open, and a message whose
// attempts ran out, or that failed permanently, is stored in
// pgsaga_dead_letters and returned as ErrDeadLettered with the cause. name
// and topic label the dead letter; name is also its consumer group.
func (t *Transport) HandleInTx(ctx context.Context, name, topic string, msg *message.Message, h HandlerFunc, opts ...HandlerOption) error {
	h = t.wrap(name, name, topic, h)
	o := handlerOptions{retry: t.cfg.Retry}
	for _, opt := range opts {
		opt(&o)
	}
	setRetryDefaults(&o.retry)
	if err := validateRetry(o.retry); err != nil {
		return fmt.Errorf("transport: %s: %w", name, err)
	}
	if o.inProcess {
		return fmt.Errorf("transport: %s: %w", name, errInProcessRouterOnly)
	}
	if err := t.checkServer(ctx); err != nil {
		return err
	}
	log := t.log.With("handler", name, "message_uuid", msg.UUID)
	for n := 1; ; n++ {
		err := t.ownAttempt(ctx, msg, n, name, topic, h)
		if err == nil {
			return nil
		}
		if ctx.Err() != nil || IsHandBack(err) {
			return err // a hand-back is the caller's: there is no queue here
		}
		permanent := IsPermanent(err)
		if !final(o.retry, n, err) {
			wait := backoff(o.retry, n)
			log.Warn("attempt failed; retrying", append([]any{"attempt", n, "retry_in_ms", telemetry.Millis(wait), "err", err}, panicStack(err)...)...)
			t.metrics.Retrying(topic, name)
			select {
			case <-time.After(wait):
				continue
			case <-ctx.Done():
				return err
			}
		}
		md, merr := json.Marshal(msg.Metadata)
		if merr != nil {
			return errors.Join(err, merr)
		}
		if _, derr := t.db.ExecContext(ctx, deadLetterMessageSQL, msg.UUID, topic, name, name, []byte(msg.Payload), string(md), reason(err), n); derr != nil {
			return errors.Join(err, fmt.Errorf("transport: dead-lettering %s: %w", msg.UUID, derr))
		}
		t.metrics.DeadLettered(topic, name)
		log.Error("message dead-lettered", append([]any{"attempts", n, "permanent", permanent, "reason", err}, panicStack(err)...)...)
		return fmt.Errorf("%w: %w", ErrDeadLettered, err)
	}
}

// TryInTx runs h for msg as one attempt of HandleInTx would (its deadline,
// queued writes, Instead), in a transaction of its own that it rolls back
// at the end. Once the attempt kept its work, next is called in that
// transaction: it sees what the attempt did, and returns the message h
// handles next, in a fresh attempt of the same transaction, or nil to
// stop. Nothing is retried, dead-lettered, counted or committed. An
// attempt that failed stops it with its error as attemptErr (next is not
// called then); what kept the run from going on otherwise (the database, a
// transaction that broke, next's own error) is err. For unit tests of
// handlers (the test kit's), which tell the two apart.
func (t *Transport) TryInTx(ctx context.Context, name, topic string, msg *message.Message, h HandlerFunc,
	next func(tx Tx) (*message.Message, error)) (attemptErr, err error) {
	if err := t.checkServer(ctx); err != nil {
		return nil, err
	}
	h = t.wrap(name, name, topic, h)
	err = t.ownTx(ctx, topic, func(d *deliveryTx, tx *sql.Tx) (bool, error) {
		for msg != nil {
			switch out, herr := t.handle(d, nil, msg, 0, 1, name, h); out {
			case kept:
			case failed:
				attemptErr = herr
				return false, nil
			default: // broken, refused: not the handler's doing alone
				return false, herr
			}
			if next == nil {
				return false, nil
			}
			m, err := next(tx)
			if err != nil {
				return false, err
			}
			msg = m
		}
		return false, nil // rolled back
	})
	return attemptErr, err
}

// ownAttempt runs h in a transaction of its own, with Instead, and commits
// what it kept.
func (t *Transport) ownAttempt(ctx context.Context, msg *message.Message, n int, name, topic string, h HandlerFunc) error {
	return t.ownTx(ctx, topic, func(d *deliveryTx, tx *sql.Tx) (bool, error) {
		if out, herr := t.handle(d, nil, msg, 0, n, name, h); out != kept {
			return false, herr
		}
		if err := tx.Commit(); err != nil {
			return false, fmt.Errorf("transport: committing: %w", err)
		}
		return true, nil
	})
}

// ownTx runs run in a bounded READ COMMITTED transaction of its own, as a
// delivery of topic; the transaction is rolled back unless run commits it
// (and says so), and the hooks of the attempts it kept run after a commit
// only.
func (t *Transport) ownTx(ctx context.Context, topic string, run func(d *deliveryTx, tx *sql.Tx) (committed bool, err error)) error {
	c, err := t.acquire(ctx)
	if err != nil {
		return err
	}
	defer c.release()
	txCtx, cancel := context.WithTimeout(ctx, t.cfg.MaxTransactionDuration())
	defer cancel()
	tx, err := c.sql.BeginTx(txCtx, &sql.TxOptions{Isolation: sql.LevelReadCommitted})
	if err != nil {
		return fmt.Errorf("transport: beginning a transaction: %w", err)
	}
	defer tx.Rollback() //nolint:errcheck // a no-op after Commit
	var dbNow time.Time
	readNow := func(rows pgx.Rows) error {
		if !rows.Next() {
			return errors.New("the statement returned no row")
		}
		return rows.Scan(&dbNow)
	}
	if err := c.sendReading(ctx, []stmt{{"bounding the transaction", beginOwnSQL, []any{t.statementTimeout, t.lockTimeout, t.idleTimeout}}},
		map[int]func(pgx.Rows) error{0: readNow}); err != nil {
		return fmt.Errorf("transport: %w", err)
	}
	d := &deliveryTx{c: c, tx: tx, own: true, topic: topic, more: func() bool { return false }, expired: func() bool { return txCtx.Err() != nil },
		clock: readClock(dbNow)}
	committed, err := run(d, tx)
	if committed {
		t.runHooks(d.hooks)
	}
	return err
}
