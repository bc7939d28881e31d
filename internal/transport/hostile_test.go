package transport_test

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/internal/transport"
)

// Handlers and middleware that misbehave: each costs its own message a
// retry or a dead letter, never a partial commit, a second run in one
// batch, or the progress of the messages around it.

// publishMarked publishes one message marked bad, then n good ones, in one
// transaction (so one claim can take them all), and returns the bad one.
func (e *env) publishMarked(n int) *message.Message {
	e.t.Helper()
	bad := message.NewMessage("bad-"+e.id, []byte(`{}`))
	bad.Metadata.Set("bad", "yes")
	msgs := []*message.Message{bad}
	for i := range n {
		msgs = append(msgs, message.NewMessage(fmt.Sprintf("good-%d-%s", i, e.id), []byte(`{}`)))
	}
	require.NoError(e.t, e.tr.Publisher(e.db.SQL).Publish(e.in, msgs...))
	return bad
}

func isBad(msg *message.Message) bool { return msg.Metadata.Get("bad") == "yes" }

// onlyBadDeadLettered waits for the env's input to drain, and checks that
// bad alone was dead-lettered, after attempts, for reason, with no effect
// kept, and that the good messages took effect once each.
func (e *env) onlyBadDeadLettered(bad *message.Message, good, attempts int, reason string) {
	e.t.Helper()
	e.drained(e.in, "g", 30*time.Second)
	dead := e.deadLetters(e.in)
	require.Len(e.t, dead, 1)
	assert.Equal(e.t, bad.UUID, dead[0].UUID)
	assert.Equal(e.t, attempts, dead[0].Attempts)
	assert.Contains(e.t, dead[0].Reason, reason)
	assert.Zero(e.t, e.count(`SELECT count(*) FROM `+e.eff+` WHERE msg = $1`, bad.UUID), "nothing of the bad attempts is kept")
	assertExactlyOnce(e.t, e, good)
}

// A handler that returns without scanning a QueryRowContext row does not
// leave the connection busy: its attempt is kept like any other.
func TestUnscannedRowDoesNotHoldTheConnection(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	e.route(t, func(msg *message.Message) error {
		tx, _ := transport.TxFromContext(msg.Context())
		_ = tx.QueryRowContext(msg.Context(), `SELECT 1`) // never scanned
		if err := effect(msg, e.eff, "a"); err != nil {
			return err
		}
		return effect(msg, e.eff, "b")
	})
	e.publish(4)
	e.drained(e.in, "g", 20*time.Second)
	assertExactlyOnce(t, e, 4)
	assert.Empty(t, e.deadLetters(e.in))
}

// A replayed row behaves as database/sql's own: values convert at Scan,
// no row is sql.ErrNoRows, a failed statement's error comes out of Scan,
// and so does the reason a finished attempt refuses statements.
func TestQueryRowReplaysTheRow(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	var late transport.Tx
	got := make(chan error, 1)
	e.runOne(t, func(msg *message.Message) error {
		if transport.AttemptFromContext(msg.Context()) > 1 {
			return nil
		}
		tx, _ := transport.TxFromContext(msg.Context())
		late = tx
		var (
			n    int64
			s    string
			b    []byte
			null *string
		)
		if err := tx.QueryRowContext(msg.Context(), `SELECT 42::int8, 'x', '\x00ff'::bytea, NULL::text`).Scan(&n, &s, &b, &null); err != nil {
			got <- err
			return err
		}
		if n != 42 || s != "x" || string(b) != "\x00\xff" || null != nil {
			got <- fmt.Errorf("replayed %v %q %x %v", n, s, b, null)
			return nil
		}
		if err := tx.QueryRowContext(msg.Context(), `SELECT 1 WHERE false`).Scan(&n); !errors.Is(err, sql.ErrNoRows) {
			got <- fmt.Errorf("no row: %v", err)
			return nil
		}
		err := tx.QueryRowContext(msg.Context(), `SELECT 1/0`).Scan(&n)
		if err == nil || !assert.Contains(t, err.Error(), "division by zero") {
			got <- fmt.Errorf("failed statement: %v", err)
			return nil
		}
		got <- nil
		return errors.New("rolled back")
	})
	require.NoError(t, <-got)
	e.drained(e.in, "g", 10*time.Second) // the first attempt is over
	var n int
	assert.ErrorIs(t, late.QueryRowContext(context.Background(), `SELECT 1`).Scan(&n), transport.ErrAttemptOver)
}

// A message whose attempt breaks its batch (here: it kills its own
// connection) is counted like any failed attempt, once the batch has
// rolled back: it is retried after its backoff, behind the others, and
// dead-lettered after MaxAttempts.
func TestMessageThatBreaksItsBatchRunsOutOfAttempts(t *testing.T) {
	t.Parallel()
	e := newEnv(t, func(c *transport.Config) {
		c.Retry = transport.RetryPolicy{MaxAttempts: 3, InitialBackoff: 10 * time.Millisecond, MaxBackoff: 10 * time.Millisecond}
	})
	var badTries atomic.Int32
	two := twoPartHandler(e)
	e.route(t, func(msg *message.Message) error {
		if !isBad(msg) {
			return two(msg)
		}
		badTries.Add(1)
		if err := effect(msg, e.eff, "a"); err != nil {
			return err
		}
		tx, _ := transport.TxFromContext(msg.Context())
		_, err := tx.ExecContext(msg.Context(), `SELECT pg_terminate_backend(pg_backend_pid())`)
		return err
	})
	bad := e.publishMarked(3)
	e.onlyBadDeadLettered(bad, 3, 3, "terminating connection")
	assert.EqualValues(t, 3, badTries.Load(), "one try per attempt")
}

// An Instead handler runs within the deadline of the attempt it replaces:
// a step and its failure record take AttemptTimeout together, so that the
// batch stays within MaxTransactionDuration.
func TestInsteadSharesTheAttemptDeadline(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	deadlines := make(chan time.Time, 2)
	e.runOne(t, func(msg *message.Message) error {
		first, ok := msg.Context().Deadline()
		require.True(t, ok)
		deadlines <- first
		return transport.Instead(func(msg *message.Message) error {
			second, _ := msg.Context().Deadline()
			deadlines <- second
			return effect(msg, e.eff, "failure")
		}, errors.New("business failure"))
	})
	e.drained(e.in, "g", 10*time.Second)
	first, second := <-deadlines, <-deadlines
	assert.True(t, first.Equal(second), "the Instead attempt's deadline %s is the step's %s", second, first)
	assert.Equal(t, 1, e.count(`SELECT count(*) FROM `+e.eff+` WHERE part = 'failure'`))
}

// Config.Intercept wraps an Instead handler too: faults are injected into
// the attempt that records a business failure as well.
func TestInterceptWrapsTheInsteadHandler(t *testing.T) {
	t.Parallel()
	var wrapped atomic.Int32
	e := newEnv(t, func(c *transport.Config) {
		c.Intercept = func(_ string, h transport.HandlerFunc) transport.HandlerFunc {
			return func(msg *message.Message) error {
				wrapped.Add(1)
				return h(msg)
			}
		}
	})
	e.runOne(t, func(msg *message.Message) error {
		return transport.Instead(func(msg *message.Message) error { return effect(msg, e.eff, "failure") }, errors.New("declined"))
	})
	e.drained(e.in, "g", 10*time.Second)
	assert.EqualValues(t, 2, wrapped.Load(), "the step and its Instead handler")
	assert.Equal(t, 1, e.count(`SELECT count(*) FROM `+e.eff))
}

// Router middleware that misbehaves changes nothing of the deliveries:
// each message gets one attempt per batch, attempts take turns on the
// connection, and the batch commits only after them.
func TestMisbehavingMiddleware(t *testing.T) {
	t.Parallel()
	slow := func(d time.Duration) message.HandlerMiddleware {
		return func(h message.HandlerFunc) message.HandlerFunc {
			return func(msg *message.Message) ([]*message.Message, error) {
				time.Sleep(d) // slow work before the handler
				return h(msg)
			}
		}
	}
	for _, c := range []struct {
		name   string
		config func(*transport.Config)
		mw     []message.HandlerMiddleware
		// oneDelivery: no message is handed back untouched, so each
		// reaches the middleware once.
		oneDelivery bool
	}{{
		// A nack would make watermill-sql hand the message out again at
		// once, in the same batch.
		name:        "fails after the handler",
		oneDelivery: true,
		mw: []message.HandlerMiddleware{func(h message.HandlerFunc) message.HandlerFunc {
			return func(msg *message.Message) ([]*message.Message, error) {
				out, err := h(msg)
				return out, errors.Join(err, errors.New("metrics backend unavailable"))
			}
		}},
	}, {
		name:        "panics after the handler",
		oneDelivery: true,
		mw: []message.HandlerMiddleware{func(h message.HandlerFunc) message.HandlerFunc {
			return func(msg *message.Message) ([]*message.Message, error) {
				if _, err := h(msg); err == nil {
					panic("middleware bug")
				}
				return nil, nil
			}
		}},
	}, {
		name:        "calls the handler twice",
		oneDelivery: true,
		mw: []message.HandlerMiddleware{func(h message.HandlerFunc) message.HandlerFunc {
			return func(msg *message.Message) ([]*message.Message, error) {
				if _, err := h(msg); err != nil {
					return nil, err
				}
				return h(msg)
			}
		}},
	}, {
		// The subscriber hands out the next message, and moves to commit,
		// while the attempt runs.
		name:        "acks before the handler (InstantAck)",
		oneDelivery: true,
		mw:          []message.HandlerMiddleware{middleware.InstantAck},
	}, {
		// The admission into the batch must come before the ack, or the
		// batch commits before the delivery reaches the handler.
		name:        "acks before the handler, then is slow",
		oneDelivery: true,
		mw:          []message.HandlerMiddleware{middleware.InstantAck, slow(20 * time.Millisecond)},
	}, {
		name:        "acks before the handler, one message a batch",
		config:      func(c *transport.Config) { c.BatchSize = 1 },
		oneDelivery: true,
		mw:          []message.HandlerMiddleware{middleware.InstantAck},
	}, {
		// The batch's window opens at its first delivery, however late.
		name:   "is slower than BatchTimeout",
		config: func(c *transport.Config) { c.BatchTimeout = time.Millisecond },
		mw:     []message.HandlerMiddleware{slow(2 * time.Millisecond)},
	}} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t, c.config)
			calls, deliveries := newAttempts(), newAttempts()
			two := twoPartHandler(e)
			counting := func(h message.HandlerFunc) message.HandlerFunc {
				return func(msg *message.Message) ([]*message.Message, error) {
					deliveries.next(msg.UUID)
					return h(msg)
				}
			}
			e.route(t, func(msg *message.Message) error {
				calls.next(msg.UUID)
				return two(msg)
			}, append([]message.HandlerMiddleware{counting}, c.mw...)...)
			ids := e.publish(10)
			e.drained(e.in, "g", 30*time.Second)
			assert.Empty(t, e.deadLetters(e.in))
			assertExactlyOnce(t, e, len(ids))
			for _, id := range ids {
				assert.Equal(t, 1, calls.of(id), "attempts of %s", id)
				if c.oneDelivery {
					assert.Equal(t, 1, deliveries.of(id), "deliveries of %s", id)
				}
			}
		})
	}
}

// violating returns a handler that writes what a deferred foreign key
// rejects at commit for bad messages, and does twoPartHandler's work,
// then more (if not nil), for the others.
func (e *env) violating(t *testing.T, more transport.HandlerFunc) transport.HandlerFunc {
	t.Helper()
	parent, child := "parent_"+e.id, "child_"+e.id
	_, err := e.db.SQL.Exec(`CREATE TABLE ` + parent + ` (id int PRIMARY KEY);
		CREATE TABLE ` + child + ` (p int REFERENCES ` + parent + ` DEFERRABLE INITIALLY DEFERRED)`)
	require.NoError(t, err)
	two := twoPartHandler(e)
	return func(msg *message.Message) error {
		tx, _ := transport.TxFromContext(msg.Context())
		if isBad(msg) {
			_, err := tx.ExecContext(msg.Context(), `INSERT INTO `+child+` VALUES (42)`) // no parent 42
			return err
		}
		if err := two(msg); err != nil || more == nil {
			return err
		}
		return more(msg)
	}
}

// A write that violates a deferred constraint fails its batch's commit,
// not a statement of the attempt: the consumer then claims the batch's
// messages one at a time, and the one at fault fails alone, is counted,
// and is dead-lettered after MaxAttempts; the others are handled.
func TestDeferredConstraintViolationCostsOnlyItsMessage(t *testing.T) {
	t.Parallel()
	e := newEnv(t, func(c *transport.Config) {
		c.Retry = transport.RetryPolicy{MaxAttempts: 3, InitialBackoff: 10 * time.Millisecond, MaxBackoff: 10 * time.Millisecond}
	})
	e.route(t, e.violating(t, nil))
	bad := e.publishMarked(3)
	e.onlyBadDeadLettered(bad, 3, 3, "foreign key")
	assert.Zero(t, e.count(`SELECT count(*) FROM child_`+e.id))
}

// SET CONSTRAINTS ALL IMMEDIATE runs the commit guard's check too, so it
// fails its attempt, with a hint to name the constraints instead; the
// message is retried and dead-lettered, and nothing of it is kept.
func TestSetConstraintsAllImmediateFailsItsAttempt(t *testing.T) {
	t.Parallel()
	e := newEnv(t, func(c *transport.Config) {
		c.Retry = transport.RetryPolicy{MaxAttempts: 2, InitialBackoff: 10 * time.Millisecond, MaxBackoff: 10 * time.Millisecond}
	})
	e.runOne(t, func(msg *message.Message) error {
		if err := effect(msg, e.eff, "a"); err != nil {
			return err
		}
		tx, _ := transport.TxFromContext(msg.Context())
		_, err := tx.ExecContext(msg.Context(), `SET CONSTRAINTS ALL IMMEDIATE`)
		return err
	})
	e.drained(e.in, "g", 10*time.Second)
	dead := e.deadLetters(e.in)
	require.Len(t, dead, 1)
	assert.Equal(t, 2, dead[0].Attempts)
	assert.Contains(t, dead[0].Reason, "cannot commit while an attempt is open")
	assert.Zero(t, e.count(`SELECT count(*) FROM `+e.eff))
}

// A handler that releases its attempt's savepoint commits nothing of the
// attempt, and is dead-lettered at once: it would do the same every time.
func TestHandlerReleasingTheAttemptSavepointIsDeadLettered(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	e.route(t, func(msg *message.Message) error {
		if err := effect(msg, e.eff, "a"); err != nil {
			return err
		}
		if isBad(msg) {
			tx, _ := transport.TxFromContext(msg.Context())
			if _, err := tx.ExecContext(msg.Context(), `RELEASE SAVEPOINT pgsaga_attempt`); err != nil {
				return err
			}
		}
		return effect(msg, e.eff, "b")
	})
	bad := e.publishMarked(3)
	e.onlyBadDeadLettered(bad, 3, 1, "ended its attempt's transaction")
}

// A queued statement keeps the bytes its arguments had when it was queued,
// for every kind of byte slice: the caller may reuse the memory.
func TestQueuedArgumentsAreCopied(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	e.runOne(t, func(msg *message.Message) error {
		tx, _ := transport.TxFromContext(msg.Context())
		raw := json.RawMessage(`{"v": 1}`)
		b := []byte("one")
		bs := [][]byte{[]byte("two")}
		err := transport.Queue(msg.Context(), tx, "recording", `INSERT INTO `+e.eff+` (msg, part)
			VALUES ($1, $2::jsonb::text || convert_from($3, 'UTF8') || convert_from(($4::bytea[])[1], 'UTF8'))`, msg.UUID, raw, b, bs)
		if err != nil {
			return err
		}
		copy(raw, `{"v": 2}`)
		copy(b, "xxx")
		copy(bs[0], "yyy")
		return nil
	})
	e.drained(e.in, "g", 10*time.Second)
	var part string
	require.NoError(t, e.db.SQL.QueryRow(`SELECT part FROM `+e.eff).Scan(&part))
	assert.Equal(t, `{"v": 1}onetwo`, part)
}

// A middleware that refuses a message without calling the handler (a
// circuit breaker, a validation) costs that message an attempt: it is
// retried after its backoff, behind the others, and dead-lettered after
// MaxAttempts with the middleware's reason, instead of being claimed again
// at once, ahead of the others, forever.
func TestMiddlewareRefusalCountsAsAFailedAttempt(t *testing.T) {
	t.Parallel()
	e := newEnv(t, func(c *transport.Config) {
		c.BatchSize = 2
		c.Retry = transport.RetryPolicy{MaxAttempts: 3, InitialBackoff: 10 * time.Millisecond, MaxBackoff: 10 * time.Millisecond}
	})
	refusals := newAttempts()
	e.route(t, twoPartHandler(e), func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			if isBad(msg) {
				refusals.next(msg.UUID)
				return nil, errors.New("circuit open")
			}
			return h(msg)
		}
	})
	bad := e.publishMarked(3)
	e.onlyBadDeadLettered(bad, 3, 3, "circuit open")
	assert.Equal(t, 3, refusals.of(bad.UUID))
	assert.Contains(t, e.deadLetters(e.in)[0].Reason, "without calling the handler")
}

// A middleware that is slow once, before the batch's first attempt, costs
// nothing: a message whose attempt would not fit in what is left of the
// transaction is handed back untouched and handled in the next batch,
// instead of having its transaction rolled back under it and being charged.
func TestSlowMiddlewareBeforeTheFirstAttemptCostsNothing(t *testing.T) {
	t.Parallel()
	e := newEnv(t, func(c *transport.Config) {
		c.BatchTimeout = 10 * time.Millisecond
		c.AttemptTimeout = 800 * time.Millisecond
		c.StatementTimeout = 300 * time.Millisecond
		// MaxTransactionDuration = 10ms + 800ms + 600ms + 1s = 2.41s
	})
	var first atomic.Bool
	calls := newAttempts()
	e.route(t, func(msg *message.Message) error {
		calls.next(msg.UUID)
		if err := effect(msg, e.eff, "a"); err != nil {
			return err
		}
		tx, _ := transport.TxFromContext(msg.Context())
		for range 2 { // 500 ms of work: within AttemptTimeout
			if _, err := tx.ExecContext(msg.Context(), `SELECT pg_sleep(0.25)`); err != nil {
				return err
			}
		}
		return effect(msg, e.eff, "b")
	}, func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			if first.CompareAndSwap(false, true) {
				time.Sleep(2050 * time.Millisecond) // slow once, before the handler
			}
			return h(msg)
		}
	})
	ids := e.publish(1)
	e.drained(e.in, "g", 20*time.Second)
	assert.Empty(t, e.deadLetters(e.in))
	assert.Equal(t, 1, calls.of(ids[0]), "one attempt, kept")
	assertExactlyOnce(t, e, 1)
}

// A handler that ends its transaction through QueryContext, then fails, is
// seen ending it, as through ExecContext: dead-lettered at once, not
// retried as if the connection had been lost.
func TestEndingTheTransactionThroughQueryContext(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	two := twoPartHandler(e)
	e.route(t, func(msg *message.Message) error {
		if !isBad(msg) {
			return two(msg)
		}
		tx, _ := transport.TxFromContext(msg.Context())
		rows, err := tx.QueryContext(msg.Context(), `ROLLBACK`)
		if err != nil {
			return err
		}
		if err := rows.Close(); err != nil {
			return err
		}
		return errors.New("gave up") // so that nothing but the end of the attempt looks at the transaction
	})
	bad := e.publishMarked(3)
	e.onlyBadDeadLettered(bad, 3, 1, "ended its attempt's transaction")
}

// A deferred check that kills its connection when the batch commits is the
// fault of the message whose write it checks: found by claiming one at a
// time, counted, dead-lettered after MaxAttempts; the others are handled.
func TestCommitThatKillsTheConnectionCostsOnlyItsMessage(t *testing.T) {
	t.Parallel()
	e := newEnv(t, func(c *transport.Config) {
		c.Retry = transport.RetryPolicy{MaxAttempts: 3, InitialBackoff: 10 * time.Millisecond, MaxBackoff: 10 * time.Millisecond}
	})
	trap := "trap_" + e.id
	_, err := e.db.SQL.Exec(`CREATE TABLE ` + trap + ` (x int);
		CREATE FUNCTION ` + trap + `() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN PERFORM pg_terminate_backend(pg_backend_pid()); PERFORM pg_sleep(5); RETURN NULL; END $$;
		CREATE CONSTRAINT TRIGGER ` + trap + ` AFTER INSERT ON ` + trap + `
			DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION ` + trap + `()`)
	require.NoError(t, err)
	two := twoPartHandler(e)
	e.route(t, func(msg *message.Message) error {
		if isBad(msg) {
			tx, _ := transport.TxFromContext(msg.Context())
			_, err := tx.ExecContext(msg.Context(), `INSERT INTO `+trap+` VALUES (1)`)
			return err
		}
		return two(msg)
	})
	bad := e.publishMarked(3)
	e.onlyBadDeadLettered(bad, 3, 3, "terminating connection")
}

// Once the message at fault in a batch that could not commit is found, the
// consumer claims whole batches again.
func TestConsumerLeavesIsolationOnceTheCulpritIsFound(t *testing.T) {
	t.Parallel()
	e := newEnv(t, func(c *transport.Config) {
		c.Retry = transport.RetryPolicy{MaxAttempts: 1}
	})
	e.route(t, e.violating(t, func(msg *message.Message) error {
		tx, _ := transport.TxFromContext(msg.Context())
		_, err := tx.ExecContext(msg.Context(), `UPDATE `+e.eff+` SET attempt = (txid_current() % 2000000000)::int WHERE msg = $1`, msg.UUID)
		return err
	}))
	bad := e.publishMarked(3)
	e.onlyBadDeadLettered(bad, 3, 1, "foreign key")
	ids := e.publish(10) // in one transaction: one claim can take them all
	e.drained(e.in, "g", 20*time.Second)
	var batches int
	require.NoError(t, e.db.SQL.QueryRow(`SELECT count(DISTINCT attempt) FROM `+e.eff+` WHERE msg = ANY ($1)`, ids).Scan(&batches))
	assert.Less(t, batches, len(ids), "the last messages were claimed one at a time")
}
