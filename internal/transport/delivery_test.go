package transport_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/internal/testdb"
	"github.com/pgsaga/pgsaga/internal/testout"
	"github.com/pgsaga/pgsaga/internal/transport"
)

// A failed attempt (error, panic, failed statement, or a failed statement
// the handler ignored) leaves nothing behind: after one failed and one
// successful attempt there is exactly one business row and one outgoing
// message.
func TestFailedAttemptLeavesNothingBehind(t *testing.T) {
	t.Parallel()
	failures := map[string]func(tx transport.Tx, msg *message.Message) error{
		"error": func(transport.Tx, *message.Message) error { return errors.New("boom") },
		"panic": func(transport.Tx, *message.Message) error { panic("boom") },
		"failed statement": func(tx transport.Tx, msg *message.Message) error {
			_, err := tx.ExecContext(msg.Context(), `SELECT 1/0`)
			return err
		},
		"ignored failed statement": func(tx transport.Tx, msg *message.Message) error {
			_, _ = tx.ExecContext(msg.Context(), `SELECT 1/0`)
			return nil // the attempt must still count as failed
		},
	}
	for name, fail := range failures {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t, nil)
			r, err := e.tr.NewRouter()
			require.NoError(t, err)
			seen := newAttempts()
			require.NoError(t, r.AddHandler("h", e.in, "g", func(msg *message.Message) error {
				tx, _ := transport.TxFromContext(msg.Context())
				if err := effect(msg, e.eff, "row"); err != nil {
					return err
				}
				out := message.NewMessage(replyID(msg), []byte(`{"ok":true}`))
				if err := e.tr.Publisher(tx).Publish(e.out, out); err != nil {
					return err
				}
				if seen.next(msg.UUID) == 1 {
					return fail(tx, msg)
				}
				return nil
			}))
			startRouter(t, r)

			ids := e.publish(3)
			e.drained(e.in, "g", 10*time.Second)
			for _, id := range ids {
				assert.Equal(t, 2, seen.of(id), "one failed and one successful attempt")
				assert.Equal(t, 1, e.count(`SELECT count(*) FROM `+e.eff+` WHERE msg = $1`, id), "business rows of %s", id)
				assert.Equal(t, 1, e.count(`SELECT count(*) FROM pgsaga_queue WHERE topic = $1 AND uuid = $2`, e.out, replyID(message.NewMessage(id, nil))), "outgoing messages of %s", id)
			}
			assert.Empty(t, e.deadLetters(e.in))
		})
	}
}

// An outgoing message published through the step's transaction never exists
// if the step never commits.
func TestOutboxMessageOnlyWithCommit(t *testing.T) {
	t.Parallel()
	for _, mode := range []string{"error", "panic"} {
		t.Run(mode, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t, func(c *transport.Config) { c.Retry.MaxAttempts = 1000 })
			r, err := e.tr.NewRouter()
			require.NoError(t, err)
			var tries atomic.Int32
			require.NoError(t, r.AddHandler("h", e.in, "g", func(msg *message.Message) error {
				tx, _ := transport.TxFromContext(msg.Context())
				if err := effect(msg, e.eff, "row"); err != nil {
					return err
				}
				if err := e.tr.Publisher(tx).Publish(e.out, message.NewMessage(replyID(msg), []byte(`{}`))); err != nil {
					return err
				}
				tries.Add(1)
				if mode == "panic" {
					panic("crash before commit")
				}
				return errors.New("crash before commit")
			}))
			stop := startRouter(t, r)
			e.publish(1)
			waitFor(t, 10*time.Second, "several failed attempts", func() bool { return tries.Load() >= 3 })
			assert.Zero(t, e.published(), "no outgoing message while the step has not committed")
			stop()
			assert.Zero(t, e.published(), "no outgoing message after the router stopped")
			assert.Zero(t, e.count(`SELECT count(*) FROM `+e.eff), "no business row")
			assert.Equal(t, 1, e.waiting(e.in, "g"), "the message is still queued")
		})
	}
}

// A failed message is retried after its backoff with no transaction held
// meanwhile: the queue row carries its attempt count, the next try time and
// the error, nothing of the consumer is open in the database, and the
// messages behind it are delivered at once.
func TestRetryWaitsOutsideAnyTransaction(t *testing.T) {
	t.Parallel()
	db := testdb.Fresh(t) // nothing else runs here: any open transaction is ours
	e := newEnvOn(t, db, func(c *transport.Config) {
		c.Retry = transport.RetryPolicy{MaxAttempts: 3, InitialBackoff: 2 * time.Second, MaxBackoff: 2 * time.Second}
	})
	r, err := e.tr.NewRouter()
	require.NoError(t, err)
	seen := newAttempts()
	var times sync.Map
	require.NoError(t, r.AddHandler("h", e.in, "g", func(msg *message.Message) error {
		n := seen.next(msg.UUID)
		times.Store(fmt.Sprint(msg.UUID, n), time.Now())
		if err := effect(msg, e.eff, "row"); err != nil {
			return err
		}
		if msg.Metadata.Get("poison") == "yes" && n == 1 {
			return errors.New("the first try fails")
		}
		return nil
	}))
	startRouter(t, r)

	bad := message.NewMessage("bad-"+e.id, []byte(`{}`))
	bad.Metadata.Set("poison", "yes")
	require.NoError(t, e.tr.Publisher(e.db.SQL).Publish(e.in, bad))
	waitFor(t, 10*time.Second, "the failure recorded", func() bool {
		return e.count(`SELECT count(*) FROM pgsaga_queue WHERE uuid = $1 AND attempts = 1`, bad.UUID) == 1
	})
	failedAt, _ := times.Load(fmt.Sprint(bad.UUID, 1))

	var lastErr string
	var future bool
	require.NoError(t, e.db.SQL.QueryRow(`SELECT last_error, available_at > clock_timestamp() FROM pgsaga_queue WHERE uuid = $1`, bad.UUID).Scan(&lastErr, &future))
	assert.Equal(t, "the first try fails", lastErr)
	assert.True(t, future, "not available again before its backoff")
	assert.Never(t, func() bool {
		return e.count(`SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()
			AND clock_timestamp() - xact_start > interval '300 milliseconds'`) > 0
	}, time.Second, 20*time.Millisecond, "no transaction is held during the backoff")

	good := e.publish(5)
	e.drained(e.in, "g", 10*time.Second)
	retriedAt, _ := times.Load(fmt.Sprint(bad.UUID, 2))
	assert.GreaterOrEqual(t, retriedAt.(time.Time).Sub(failedAt.(time.Time)), 2*time.Second, "retried after the backoff")
	for _, id := range good {
		at, ok := times.Load(fmt.Sprint(id, 1))
		require.True(t, ok)
		assert.True(t, at.(time.Time).Before(retriedAt.(time.Time)), "the messages behind the failed one did not wait for its retry")
	}
	assert.Equal(t, 1, e.count(`SELECT count(*) FROM `+e.eff+` WHERE msg = $1`, bad.UUID), "the failed try left nothing")
}

// A message that keeps failing gets MaxAttempts attempts, numbered, with a
// doubling backoff, then goes to pgsaga_dead_letters in the same transaction
// that records its last failure, with the reason and where it came from;
// the failed attempts leave nothing behind.
func TestExhaustedRetriesGoToDeadLetters(t *testing.T) {
	t.Parallel()
	e := newEnv(t, func(c *transport.Config) {
		c.Retry = transport.RetryPolicy{MaxAttempts: 3, InitialBackoff: 50 * time.Millisecond, MaxBackoff: time.Second}
	})
	r, err := e.tr.NewRouter()
	require.NoError(t, err)
	var (
		mu       sync.Mutex
		attempts = map[string][]int{}
		times    []time.Time
	)
	require.NoError(t, r.AddHandler("h", e.in, "g", func(msg *message.Message) error {
		mu.Lock()
		attempts[msg.UUID] = append(attempts[msg.UUID], transport.AttemptFromContext(msg.Context()))
		if msg.Metadata.Get("poison") == "yes" {
			times = append(times, time.Now())
		}
		mu.Unlock()
		if err := effect(msg, e.eff, "row"); err != nil {
			return err
		}
		if msg.Metadata.Get("poison") == "yes" {
			return errors.New("always fails")
		}
		return nil
	}))
	startRouter(t, r)

	bad := message.NewMessage("bad-"+e.id, []byte(`{"x":1}`))
	bad.Metadata.Set("poison", "yes")
	good := message.NewMessage("good-"+e.id, []byte(`{"x":2}`))
	require.NoError(t, e.tr.Publisher(e.db.SQL).Publish(e.in, bad, good))

	e.drained(e.in, "g", 10*time.Second)
	mu.Lock()
	assert.Equal(t, []int{1, 2, 3}, attempts[bad.UUID], "three attempts, numbered")
	assert.Equal(t, []int{1}, attempts[good.UUID])
	require.Len(t, times, 3)
	assert.GreaterOrEqual(t, times[1].Sub(times[0]), 50*time.Millisecond, "backoff before the second attempt")
	assert.GreaterOrEqual(t, times[2].Sub(times[1]), 100*time.Millisecond, "doubled before the third")
	mu.Unlock()

	dead := e.deadLetters(e.in)
	require.Len(t, dead, 1)
	d := dead[0]
	assert.Equal(t, bad.UUID, d.UUID)
	assert.Equal(t, "always fails", d.Reason)
	assert.Equal(t, 3, d.Attempts)
	assert.Equal(t, "h", d.Handler)
	assert.Equal(t, "g", d.ConsumerGroup)
	assert.Equal(t, `{"x":1}`, string(d.PayloadPreview))
	assert.Equal(t, "always fails", d.Metadata[transport.DeadLetterReason])
	assert.Equal(t, "3", d.Metadata[transport.DeadLetterAttempts])
	assert.Equal(t, e.in, d.Metadata[transport.DeadLetterTopic])
	assert.Equal(t, "h", d.Metadata[transport.DeadLetterHandler])
	assert.Equal(t, "g", d.Metadata[transport.DeadLetterGroup])
	assert.NotEmpty(t, d.Metadata[transport.DeadLetterAt])
	assert.Equal(t, "yes", d.Metadata["poison"], "the original metadata travels along")
	assert.Zero(t, e.count(`SELECT count(*) FROM `+e.eff+` WHERE msg = $1`, bad.UUID), "failed attempts left nothing")
	assert.Equal(t, 1, e.count(`SELECT count(*) FROM `+e.eff+` WHERE msg = $1`, good.UUID))
}

// Failures no retry can fix are dead-lettered after one attempt: an error
// marked Permanent, PostgreSQL refusing the bytes of a message (a NUL in
// text, a \u0000 in JSON), and a message published with no id or one too
// long (retried 5 times as transient before), which would fail the same
// way every time.
func TestPermanentFailuresDeadLetteredAtOnce(t *testing.T) {
	t.Parallel()
	publishWithID := func(id string) func(e *env, msg *message.Message) error {
		return func(e *env, msg *message.Message) error {
			tx, _ := transport.TxFromContext(msg.Context())
			return e.tr.Publisher(tx).Publish(e.out, message.NewMessage(id, []byte(`{}`)))
		}
	}
	cases := map[string]struct {
		handle func(e *env, msg *message.Message) error
		reason string
	}{
		"published with no id":     {publishWithID(""), "message UUID must be 1 to 255 bytes"},
		"published with a long id": {publishWithID(strings.Repeat("x", 256)), "message UUID must be 1 to 255 bytes"},
		"marked permanent":         {func(*env, *message.Message) error { return transport.Permanent(errors.New("cannot decode")) }, "cannot decode"},
		"NUL in text (22021)": {func(e *env, msg *message.Message) error {
			tx, _ := transport.TxFromContext(msg.Context())
			_, err := tx.ExecContext(msg.Context(), `INSERT INTO `+e.eff+` (msg, part) VALUES ($1, $2)`, msg.UUID, "a\x00b")
			return err
		}, "invalid byte sequence"},
		"NUL in published metadata (22P05)": {func(e *env, msg *message.Message) error {
			tx, _ := transport.TxFromContext(msg.Context())
			out := message.NewMessage(replyID(msg), nil)
			out.Metadata.Set("note", "a\x00b")
			return e.tr.Publisher(tx).Publish(e.out, out)
		}, "unsupported Unicode escape sequence"},
		"invalid UTF-8 in text (22021)": {func(e *env, msg *message.Message) error {
			tx, _ := transport.TxFromContext(msg.Context())
			_, err := tx.ExecContext(msg.Context(), `INSERT INTO `+e.eff+` (msg, part) VALUES ($1, $2)`, msg.UUID, "\xff\xfe")
			return err
		}, "invalid byte sequence"},
	}
	for name, c := range cases {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t, nil)
			r, err := e.tr.NewRouter()
			require.NoError(t, err)
			var calls atomic.Int32
			require.NoError(t, r.AddHandler("h", e.in, "g", func(msg *message.Message) error {
				calls.Add(1)
				return c.handle(e, msg)
			}))
			startRouter(t, r)
			e.publish(1)
			e.drained(e.in, "g", 10*time.Second)
			assert.EqualValues(t, 1, calls.Load(), "one attempt")
			dead := e.deadLetters(e.in)
			require.Len(t, dead, 1)
			assert.Equal(t, 1, dead[0].Attempts)
			assert.Contains(t, dead[0].Reason, c.reason)
			assert.Zero(t, e.published())
		})
	}
}

// A stored message that cannot be read (metadata that is not a JSON object
// of strings) is dead-lettered in one attempt, with the reason, without
// reaching the handler; the messages around it are delivered as usual.
func TestUnreadableMessagesDeadLetteredInOneAttempt(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	r, err := e.tr.NewRouter()
	require.NoError(t, err)
	var handled sync.Map
	require.NoError(t, r.AddHandler("h", e.in, "g", func(msg *message.Message) error {
		handled.Store(msg.UUID, true)
		return effect(msg, e.eff, "row")
	}))
	startRouter(t, r)

	before := e.publish(3)
	for i, md := range []string{`{"type": 5}`, `[1, 2]`, `"text"`, `{"nested": {"a": "b"}}`} {
		_, err := e.db.SQL.Exec(`INSERT INTO pgsaga_queue (topic, consumer_group, uuid, payload, metadata) VALUES ($1, 'g', $2, $3, $4::jsonb)`,
			e.in, fmt.Sprint("unreadable-", i, "-", e.id), []byte{0, 0xff, 0xfe}, md)
		require.NoError(t, err)
	}
	// Payloads are bytes, and metadata may be null: those are readable.
	_, err = e.db.SQL.Exec(`INSERT INTO pgsaga_queue (topic, consumer_group, uuid, payload, metadata) VALUES ($1, 'g', $2, $3, NULL)`,
		e.in, "null-metadata-"+e.id, []byte{0, 0xff})
	require.NoError(t, err)
	after := e.publish(3)

	e.drained(e.in, "g", 10*time.Second)
	for _, id := range append(append(before, after...), "null-metadata-"+e.id) {
		_, ok := handled.Load(id)
		assert.True(t, ok, "%s delivered", id)
	}
	dead := e.deadLetters(e.in)
	require.Len(t, dead, 4)
	for _, d := range dead {
		assert.True(t, strings.HasPrefix(d.UUID, "unreadable-"), d.UUID)
		_, ok := handled.Load(d.UUID)
		assert.False(t, ok, "the handler never saw %s", d.UUID)
		assert.Equal(t, 1, d.Attempts)
		assert.Contains(t, d.Reason, "cannot be read")
		assert.Equal(t, []byte{0, 0xff, 0xfe}, d.PayloadPreview, "kept byte for byte")
	}
}

// A connection killed in the middle of a step (pg_terminate_backend) costs
// its batch a redelivery within a second or so, and every message's effect
// still exists exactly once.
func TestConnectionKilledMidStepRecoversQuickly(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	r, err := e.tr.NewRouter()
	require.NoError(t, err)
	var killed atomic.Bool
	require.NoError(t, r.AddHandler("h", e.in, "g", func(msg *message.Message) error {
		if err := effect(msg, e.eff, "a"); err != nil {
			return err
		}
		if msg.Metadata.Get("kill") == "yes" && killed.CompareAndSwap(false, true) {
			tx, _ := transport.TxFromContext(msg.Context())
			var pid int
			if err := tx.QueryRowContext(msg.Context(), `SELECT pg_backend_pid()`).Scan(&pid); err != nil {
				return err
			}
			if _, err := e.db.SQL.Exec(`SELECT pg_terminate_backend($1)`, pid); err != nil {
				return err
			}
		}
		return effect(msg, e.eff, "b")
	}))
	startRouter(t, r)

	var msgs []*message.Message
	for i := range 30 {
		m := message.NewMessage(fmt.Sprintf("m-%02d-%s", i, e.id), []byte(`{}`))
		if i == 10 {
			m.Metadata.Set("kill", "yes")
		}
		msgs = append(msgs, m)
	}
	require.NoError(t, e.tr.Publisher(e.db.SQL).Publish(e.in, msgs...))

	e.drained(e.in, "g", 20*time.Second)
	assert.True(t, killed.Load())
	assertExactlyOnce(t, e, 30)
	assert.Empty(t, e.deadLetters(e.in))
}

// A statement of an attempt is bounded by statement_timeout; the attempt
// fails and is retried like any other.
func TestStatementTimeoutBoundsAttempt(t *testing.T) {
	t.Parallel()
	e := newEnv(t, func(c *transport.Config) { c.StatementTimeout = 100 * time.Millisecond })
	r, err := e.tr.NewRouter()
	require.NoError(t, err)
	seen := newAttempts()
	var firstErr atomic.Value
	require.NoError(t, r.AddHandler("h", e.in, "g", func(msg *message.Message) error {
		if err := effect(msg, e.eff, "row"); err != nil {
			return err
		}
		if seen.next(msg.UUID) == 1 {
			tx, _ := transport.TxFromContext(msg.Context())
			_, err := tx.ExecContext(msg.Context(), `SELECT pg_sleep(30)`)
			firstErr.CompareAndSwap(nil, err)
			return err
		}
		return nil
	}))
	startRouter(t, r)
	e.publish(1)
	e.drained(e.in, "g", 10*time.Second)
	var pgErr *pgconn.PgError
	require.ErrorAs(t, firstErr.Load().(error), &pgErr)
	assert.Equal(t, "57014", pgErr.Code, "query_canceled by statement_timeout")
	assert.Equal(t, 1, e.count(`SELECT count(*) FROM `+e.eff))
}

// A statement of an attempt runs to completion even when the context the
// handler passes is already cancelled: only the bounds stop it.
func TestStatementsIgnoreMessageCancellation(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	r, err := e.tr.NewRouter()
	require.NoError(t, err)
	require.NoError(t, r.AddHandler("h", e.in, "g", func(msg *message.Message) error {
		ctx, cancel := context.WithCancel(msg.Context())
		cancel()
		tx, _ := transport.TxFromContext(ctx)
		_, err := tx.ExecContext(ctx, `INSERT INTO `+e.eff+` (msg, part) VALUES ($1, 'row')`, msg.UUID)
		return err
	}))
	startRouter(t, r)
	e.publish(2)
	e.drained(e.in, "g", 10*time.Second)
	assert.Equal(t, 2, e.count(`SELECT count(*) FROM `+e.eff))
}

// A handler's Tx stops working when its attempt ends, so a goroutine it left
// behind cannot write into the next message's work.
func TestAttemptTxUnusableAfterAttempt(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	r, err := e.tr.NewRouter()
	require.NoError(t, err)
	kept := make(chan transport.Tx, 1)
	require.NoError(t, r.AddHandler("h", e.in, "g", func(msg *message.Message) error {
		tx, _ := transport.TxFromContext(msg.Context())
		select {
		case kept <- tx:
		default:
		}
		return nil
	}))
	startRouter(t, r)
	e.publish(1)
	tx := <-kept
	e.drained(e.in, "g", 10*time.Second)
	_, err = tx.ExecContext(context.Background(), `INSERT INTO `+e.eff+` (msg, part) VALUES ('late', 'row')`)
	require.ErrorIs(t, err, transport.ErrAttemptOver)
	require.ErrorIs(t, transport.Queue(context.Background(), tx, "late", `SELECT 1`), transport.ErrAttemptOver)
	var one int
	require.Error(t, tx.QueryRowContext(context.Background(), `SELECT 1`).Scan(&one))
	assert.Zero(t, e.count(`SELECT count(*) FROM `+e.eff))
}

// A handler that acks the message itself and then fails must not get its
// failed attempt committed: the ack goes nowhere.
func TestHandlerAckDoesNotEndAttempt(t *testing.T) {
	t.Parallel()
	e := newEnv(t, func(c *transport.Config) { c.Retry.MaxAttempts = 1000 })
	r, err := e.tr.NewRouter()
	require.NoError(t, err)
	var calls atomic.Int32
	require.NoError(t, r.AddHandler("h", e.in, "g", func(msg *message.Message) error {
		calls.Add(1)
		if err := effect(msg, e.eff, "row"); err != nil {
			return err
		}
		msg.Ack()
		time.Sleep(50 * time.Millisecond) // a subscriber that saw the ack commits meanwhile
		return errors.New("fails after acking")
	}))
	stop := startRouter(t, r)
	e.publish(1)
	waitFor(t, 10*time.Second, "several attempts", func() bool { return calls.Load() >= 4 })
	stop()
	assert.Zero(t, e.count(`SELECT count(*) FROM `+e.eff), "no failed attempt's row was committed")
	assert.Equal(t, 1, e.waiting(e.in, "g"), "the message is still queued")
}

// Intercept wraps every handler inside its attempt: a write it makes is
// kept with the attempt, a failure it returns rolls the attempt back.
func TestInterceptRunsInsideTheAttempt(t *testing.T) {
	t.Parallel()
	var (
		mu    sync.Mutex
		names = map[string]int{}
	)
	var e *env
	e = newEnv(t, func(c *transport.Config) {
		c.Intercept = func(name string, h transport.HandlerFunc) transport.HandlerFunc {
			return func(msg *message.Message) error {
				mu.Lock()
				names[name]++
				n := names[name]
				mu.Unlock()
				if err := h(msg); err != nil {
					return err
				}
				if err := effect(msg, e.eff, "intercepted"); err != nil {
					return err
				}
				if n == 1 {
					return errors.New("crash after the handler, before commit")
				}
				return nil
			}
		}
	})
	r, err := e.tr.NewRouter()
	require.NoError(t, err)
	require.NoError(t, r.AddHandler("h", e.in, "g", func(msg *message.Message) error { return effect(msg, e.eff, "a") }))
	startRouter(t, r)
	ids := e.publish(1)
	e.drained(e.in, "g", 10*time.Second)
	assert.Equal(t, 1, e.count(`SELECT count(*) FROM `+e.eff+` WHERE msg = $1 AND part = 'a'`, ids[0]), "the failed attempt's write was rolled back")
	assert.Equal(t, 1, e.count(`SELECT count(*) FROM `+e.eff+` WHERE msg = $1 AND part = 'intercepted'`, ids[0]))
	mu.Lock()
	assert.Equal(t, 2, names["h"])
	mu.Unlock()
}

// A message published with nil metadata is delivered like any other.
func TestNilMetadataIsDelivered(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	r, err := e.tr.NewRouter()
	require.NoError(t, err)
	require.NoError(t, r.AddHandler("h", e.in, "g", func(msg *message.Message) error { return effect(msg, e.eff, "row") }))
	startRouter(t, r)
	require.NoError(t, e.tr.Publisher(e.db.SQL).Publish(e.in, &message.Message{UUID: "nil-meta-" + e.id, Payload: []byte(`{}`)}))
	e.drained(e.in, "g", 10*time.Second)
	assert.Equal(t, 1, e.count(`SELECT count(*) FROM `+e.eff))
}

// A message published to a topic no consumer group subscribes to is kept as
// a dead letter saying so, never dropped; once a group subscribes, the next
// one is queued for it.
func TestUnroutedMessagesAreKept(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	lonely := "lonely_" + e.id
	msg := message.NewMessage("unrouted-"+e.id, []byte(`{"a":1}`))
	msg.Metadata.Set("k", "v")
	require.NoError(t, e.tr.Publisher(e.db.SQL).Publish(lonely, msg))
	dead := e.deadLetters(lonely)
	require.Len(t, dead, 1)
	assert.Equal(t, "no consumer group subscribes to topic "+lonely, dead[0].Reason)
	assert.Equal(t, "v", dead[0].Metadata["k"])
	assert.Equal(t, `{"a":1}`, string(dead[0].PayloadPreview))
	assert.Zero(t, e.count(`SELECT count(*) FROM pgsaga_queue WHERE topic = $1`, lonely))

	require.NoError(t, e.tr.Subscribe(context.Background(), transport.Subscription{Topic: lonely, ConsumerGroup: "late"}))
	require.NoError(t, e.tr.Publisher(e.db.SQL).Publish(lonely, message.NewMessage("routed-"+e.id, nil)))
	assert.Equal(t, 1, e.waiting(lonely, "late"))
	assert.Len(t, e.deadLetters(lonely), 1)
}

// Every consumer group of a topic gets every message; dropping a group
// stops its queue and deletes what it held.
func TestFanOutAndDropGroup(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	topic := "fan_" + e.id
	ctx := context.Background()
	require.NoError(t, e.tr.Subscribe(ctx, transport.Subscription{Topic: topic, ConsumerGroup: "a"},
		transport.Subscription{Topic: topic, ConsumerGroup: "b"}))
	for i := range 3 {
		require.NoError(t, e.tr.Publisher(e.db.SQL).Publish(topic, message.NewMessage(fmt.Sprint("f", i, e.id), nil)))
	}
	assert.Equal(t, 3, e.waiting(topic, "a"))
	assert.Equal(t, 3, e.waiting(topic, "b"))
	n, err := e.tr.DropConsumerGroup(ctx, topic, "b")
	require.NoError(t, err)
	assert.EqualValues(t, 3, n)
	require.NoError(t, e.tr.Publisher(e.db.SQL).Publish(topic, message.NewMessage("f-after-"+e.id, nil)))
	assert.Equal(t, 4, e.waiting(topic, "a"))
	assert.Zero(t, e.waiting(topic, "b"))
}

func TestConfigValidation(t *testing.T) {
	t.Parallel()
	// A pgx handle that never connects: New does not touch the database.
	conf, err := pgx.ParseConfig("postgres://nobody@127.0.0.1:1/nothing")
	require.NoError(t, err)
	db := stdlib.OpenDB(*conf)
	t.Cleanup(func() { _ = db.Close() })
	cases := map[string]transport.Config{
		"no db":                 {},
		"negative batch":        {DB: db, BatchSize: -1},
		"too many consumers":    {DB: db, Consumers: 65},
		"negative poll":         {DB: db, PollInterval: -time.Second},
		"tiny attempt timeout":  {DB: db, AttemptTimeout: time.Microsecond},
		"max retry below retry": {DB: db, RetryInterval: time.Second, MaxRetryInterval: time.Millisecond},
		"bad channel":           {DB: db, NotifyChannel: "has space"},
		"hold past the attempt": {DB: db, AttemptTimeout: time.Second, AwaitHold: 2 * time.Second},
		"negative attempts":     {DB: db, Retry: transport.RetryPolicy{MaxAttempts: -1}},
		"backoff order":         {DB: db, Retry: transport.RetryPolicy{InitialBackoff: time.Second, MaxBackoff: time.Millisecond}},
	}
	for name, cfg := range cases {
		t.Run(name, func(t *testing.T) {
			_, err := transport.New(cfg)
			require.Error(t, err)
			assert.Contains(t, err.Error(), "transport: invalid config")
		})
	}
	tr, err := transport.New(transport.Config{DB: db})
	require.NoError(t, err)
	got := tr.Config()
	assert.Equal(t, transport.BatchSizeDefault, got.BatchSize)
	assert.Equal(t, transport.AttemptTimeoutDefault, got.AttemptTimeout)
	assert.Equal(t, transport.StatementTimeoutDefault, got.StatementTimeout)
	assert.Equal(t, transport.MaxAttemptsDefault, got.Retry.MaxAttempts)
	assert.Equal(t, got.BatchTimeout+got.AttemptTimeout+2*got.StatementTimeout+time.Second, got.MaxTransactionDuration())

	r, err := tr.NewRouter()
	require.NoError(t, err)
	err = r.AddHandler("h", "t", "", func(*message.Message) error { return nil }, transport.WithRetry(transport.RetryPolicy{MaxAttempts: -2}))
	require.ErrorContains(t, err, "MaxAttempts")
	err = r.AddHandler("h", "t", "", func(*message.Message) error { return nil }, transport.WithConsumers(0))
	require.ErrorContains(t, err, "consumers")
}

func TestNameErrors(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	err := e.tr.Publisher(e.db.SQL).Publish(e.out, message.NewMessage(strings.Repeat("x", 256), []byte(`{}`)))
	require.ErrorIs(t, err, transport.ErrInvalidMessageID)
	err = e.tr.Publisher(e.db.SQL).Publish(e.out, message.NewMessage("", []byte(`{}`)))
	require.ErrorIs(t, err, transport.ErrInvalidMessageID)

	for _, bad := range []string{"", "has space", "semi;colon", "quote\"", strings.Repeat("a", transport.MaxTopicLen+1)} {
		require.ErrorIs(t, transport.ValidateTopic(bad), transport.ErrInvalidTopic, "%q", bad)
		require.ErrorIs(t, e.tr.Publisher(e.db.SQL).Publish(bad, message.NewMessage("x", nil)), transport.ErrInvalidTopic, "%q", bad)
		require.ErrorIs(t, e.tr.Subscribe(context.Background(), transport.Subscription{Topic: bad, ConsumerGroup: "g"}), transport.ErrInvalidTopic, "%q", bad)
	}
	require.ErrorIs(t, e.tr.Subscribe(context.Background(), transport.Subscription{Topic: "t", ConsumerGroup: "bad group"}), transport.ErrInvalidConsumerGroup)

	r, err := e.tr.NewRouter()
	require.NoError(t, err)
	require.ErrorIs(t, r.AddHandler("h", "bad topic", "g", func(*message.Message) error { return nil }), transport.ErrInvalidTopic)
	require.ErrorIs(t, r.AddHandler("h", e.in, "bad group", func(*message.Message) error { return nil }), transport.ErrInvalidConsumerGroup)
	require.NoError(t, r.AddHandler("h", e.in, "", func(*message.Message) error { return nil }))
	require.Error(t, r.AddHandler("h", e.in, "g", func(*message.Message) error { return nil }), "duplicate handler name")
}

// A handler that panics costs its message an attempt, like an error: the
// reason a dead letter keeps is one short line with the panic's value; the
// stack goes to the log, never into a reason (it used to: a dead letter's
// reason was a goroutine dump).
func TestPanicReasonIsShortAndTheStackIsLogged(t *testing.T) {
	t.Parallel()
	var logs testout.Buffer
	e := newEnv(t, func(cfg *transport.Config) {
		cfg.Logger = slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelWarn}))
		cfg.Retry = transport.RetryPolicy{MaxAttempts: 2, InitialBackoff: time.Millisecond}
	})
	r, err := e.tr.NewRouter()
	require.NoError(t, err)
	require.NoError(t, r.AddHandler("h", e.in, "g", func(msg *message.Message) error {
		panic("boom\nsecond line " + strings.Repeat("x", 1000))
	}))
	startRouter(t, r)
	e.publish(1)
	e.drained(e.in, "g", 10*time.Second)
	dead := e.deadLetters(e.in)
	require.Len(t, dead, 1)
	assert.Equal(t, 2, dead[0].Attempts)
	assert.True(t, strings.HasPrefix(dead[0].Reason, "transport: handler panicked: boom second line xxx"), dead[0].Reason)
	assert.NotContains(t, dead[0].Reason, "\n")
	assert.NotContains(t, dead[0].Reason, "goroutine")
	assert.Less(t, len(dead[0].Reason), 400)
	assert.Contains(t, logs.String(), "goroutine", "the stack is logged")
	assert.Contains(t, logs.String(), "delivery_test.go", "the stack names the handler")
}

// Batches whose claim took so long that no attempt fits in their
// transaction (the queue locked for a while, as around a restart) hand
// their messages back; that is told once, at Warn, with where the time
// went, not once per consumer (it was, blaming router middleware).
func TestLateBatchesAreToldOnceWithWhereTheTimeWent(t *testing.T) {
	t.Parallel()
	var logs testout.Buffer
	e := newEnvOn(t, testdb.Fresh(t), func(cfg *transport.Config) {
		cfg.Logger = slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelWarn}))
	})
	ids := e.publish(20)
	ctx := context.Background()
	lock, err := e.db.SQL.BeginTx(ctx, nil)
	require.NoError(t, err)
	_, err = lock.ExecContext(ctx, `LOCK TABLE pgsaga_queue IN ACCESS EXCLUSIVE MODE`)
	require.NoError(t, err)
	r, err := e.tr.NewRouter()
	require.NoError(t, err)
	handled := make(chan string, len(ids))
	require.NoError(t, r.AddHandler("h", e.in, "g", func(msg *message.Message) error {
		handled <- msg.UUID
		return nil
	}, transport.WithConsumers(4)))
	startRouter(t, r)
	// Every consumer's claim waits on the lock for longer than the time a
	// batch may take before its first attempt.
	cfg := e.tr.Config()
	waitFor(t, 10*time.Second, "four claims waiting on the lock", func() bool {
		return e.count(`SELECT count(*) FROM pg_locks WHERE relation = 'pgsaga_queue'::regclass AND NOT granted`) == 4
	})
	time.Sleep(cfg.BatchTimeout + 1500*time.Millisecond) // the lock's length is the scenario
	require.NoError(t, lock.Rollback())
	for range ids {
		<-handled
	}
	warnings := strings.Count(logs.String(), "came to its first message too late")
	assert.Equal(t, 1, warnings, logs.String())
	assert.Regexp(t, `claim_took_ms=[2-9][0-9]{3}(\.[0-9]+)? `, logs.String())
	assert.NotContains(t, logs.String(), "middleware")
}

// Attempts run one after another share goroutines (whose stacks have grown
// already) instead of starting one each. Not parallel: the goroutines are
// the process's, and other tests' attempts would take them in between.
func TestAttemptsReuseTheirGoroutines(t *testing.T) {
	e := newEnv(t, nil)
	const n = 20
	var mu sync.Mutex
	ids := map[string]bool{}
	var ran atomic.Int32
	e.route(t, func(msg *message.Message) error {
		mu.Lock()
		ids[transport.GoroutineID()] = true
		mu.Unlock()
		ran.Add(1)
		return nil
	})
	e.publish(n)
	waitFor(t, 30*time.Second, "every message handled", func() bool { return ran.Load() >= n })
	mu.Lock()
	defer mu.Unlock()
	assert.LessOrEqual(t, len(ids), n/2, "goroutines for %d attempts", n)
}
