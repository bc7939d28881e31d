package transport_test

import (
	"context"
	"database/sql"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/steps/transport"
)

func deadLetters(t *testing.T, e *env, topic string) []map[string]string {
	t.Helper()
	rows, err := e.db.SQL.Query(`SELECT uuid, metadata::text FROM ` + e.tr.MessagesTable(topic) + ` ORDER BY "offset"`)
	require.NoError(t, err)
	defer rows.Close()
	var out []map[string]string
	for rows.Next() {
		var id, meta string
		require.NoError(t, rows.Scan(&id, &meta))
		m := message.NewMessage(id, nil)
		require.NoError(t, jsonUnmarshal(meta, &m.Metadata))
		m.Metadata.Set("uuid", id)
		out = append(out, m.Metadata)
	}
	require.NoError(t, rows.Err())
	return out
}

// A message that keeps failing gets MaxAttempts attempts, then goes to the
// dead-letter topic in the same transaction, and the lane moves on; the
// failed attempts leave nothing behind.
func TestExhaustedRetriesGoToDeadLetter(t *testing.T) {
	t.Parallel()
	dlq := "dlq_" + randomID()
	e := newEnv(t, func(c *transport.Config) {
		c.Retry = transport.RetryPolicy{MaxAttempts: 3, InitialBackoff: 20 * time.Millisecond, DeadLetterTopic: dlq}
	})
	require.NoError(t, e.tr.CreateTopics(context.Background(), dlq))
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

	tx, err := e.db.SQL.Begin()
	require.NoError(t, err)
	bad := message.NewMessage("bad-"+e.id, []byte(`{"x":1}`))
	bad.Metadata.Set("poison", "yes")
	good := message.NewMessage("good-"+e.id, []byte(`{"x":2}`))
	require.NoError(t, e.tr.Publisher(tx).Publish(e.in, bad, good))
	require.NoError(t, tx.Commit())

	waitFor(t, 10*time.Second, "both messages consumed", func() bool { return e.consumed(e.in, "g") == 2 })
	mu.Lock()
	assert.Equal(t, []int{1, 2, 3}, attempts[bad.UUID], "three attempts, numbered")
	assert.Equal(t, []int{1}, attempts[good.UUID], "the lane moved on")
	require.Len(t, times, 3)
	assert.GreaterOrEqual(t, times[1].Sub(times[0]), 20*time.Millisecond, "backoff before the second attempt")
	assert.GreaterOrEqual(t, times[2].Sub(times[1]), 40*time.Millisecond, "doubled before the third")
	mu.Unlock()

	dead := deadLetters(t, e, dlq)
	require.Len(t, dead, 1)
	assert.Equal(t, bad.UUID, dead[0]["uuid"])
	assert.Equal(t, "always fails", dead[0][transport.DeadLetterReason])
	assert.Equal(t, "3", dead[0][transport.DeadLetterAttempts])
	assert.Equal(t, e.in, dead[0][transport.DeadLetterTopic])
	assert.Equal(t, "h", dead[0][transport.DeadLetterHandler])
	assert.Equal(t, "g", dead[0][transport.DeadLetterGroup])
	assert.Equal(t, "yes", dead[0]["poison"], "the original metadata travels along")
	assert.Zero(t, e.count(`SELECT count(*) FROM `+e.eff+` WHERE msg = $1`, bad.UUID), "failed attempts left nothing")
	assert.Equal(t, 1, e.count(`SELECT count(*) FROM `+e.eff+` WHERE msg = $1`, good.UUID))
}

// A permanent failure is dead-lettered after one attempt.
func TestPermanentFailureDeadLetteredAtOnce(t *testing.T) {
	t.Parallel()
	dlq := "dlq_" + randomID()
	e := newEnv(t, func(c *transport.Config) { c.Retry = transport.RetryPolicy{DeadLetterTopic: dlq} })
	require.NoError(t, e.tr.CreateTopics(context.Background(), dlq))
	r, err := e.tr.NewRouter()
	require.NoError(t, err)
	var calls atomic.Int32
	require.NoError(t, r.AddHandler("h", e.in, "g", func(msg *message.Message) error {
		calls.Add(1)
		return transport.Permanent(errors.New("cannot decode"))
	}))
	startRouter(t, r)
	e.publish(1)
	waitFor(t, 10*time.Second, "message consumed", func() bool { return e.consumed(e.in, "g") == 1 })
	assert.EqualValues(t, 1, calls.Load())
	dead := deadLetters(t, e, dlq)
	require.Len(t, dead, 1)
	assert.Equal(t, "1", dead[0][transport.DeadLetterAttempts])
	assert.Contains(t, dead[0][transport.DeadLetterReason], "cannot decode")
}

// A serialization failure cannot be retried in the same REPEATABLE READ
// snapshot: the batch is rolled back and redelivered in a new transaction,
// and every message's effect still exists exactly once.
func TestSerializationFailureRedeliversBatch(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	r, err := e.tr.NewRouter()
	require.NoError(t, err)
	var (
		raised    atomic.Bool
		snapshots sync.Map // message -> the batch transaction's snapshot of its first attempt
	)
	require.NoError(t, r.AddHandler("h", e.in, "g", func(msg *message.Message) error {
		tx, _ := transport.TxFromContext(msg.Context())
		var snap string
		if err := tx.QueryRowContext(msg.Context(), `SELECT pg_current_snapshot()::text`).Scan(&snap); err != nil {
			return err
		}
		snapshots.LoadOrStore(msg.UUID, snap)
		if err := effect(msg, e.eff, "a"); err != nil {
			return err
		}
		if msg.Metadata.Get("conflict") == "yes" && raised.CompareAndSwap(false, true) {
			return &pgconn.PgError{Code: "40001", Message: "could not serialize access due to concurrent update"}
		}
		return effect(msg, e.eff, "b")
	}))
	startRouter(t, r)

	tx, err := e.db.SQL.Begin()
	require.NoError(t, err)
	var msgs []*message.Message
	for i := range 10 {
		m := message.NewMessage(randomID()+randomID(), []byte(`{}`))
		if i == 5 {
			m.Metadata.Set("conflict", "yes")
		}
		msgs = append(msgs, m)
	}
	require.NoError(t, e.tr.Publisher(tx).Publish(e.in, msgs...))
	require.NoError(t, tx.Commit())

	waitFor(t, 10*time.Second, "all consumed", func() bool { return e.consumed(e.in, "g") == 10 })
	assert.True(t, raised.Load())
	assertExactlyOnce(t, e, 10)
}

// Closing the router while a delivery waits between attempts does not wait
// out the backoff; the message stays unacked.
func TestCloseInterruptsBackoff(t *testing.T) {
	t.Parallel()
	e := newEnv(t, func(c *transport.Config) {
		c.Retry = transport.RetryPolicy{MaxAttempts: 3, InitialBackoff: 20 * time.Second, MaxBackoff: 20 * time.Second}
	})
	r, err := e.tr.NewRouter()
	require.NoError(t, err)
	failed := make(chan struct{}, 1)
	require.NoError(t, r.AddHandler("h", e.in, "g", func(msg *message.Message) error {
		if err := effect(msg, e.eff, "row"); err != nil {
			return err
		}
		select {
		case failed <- struct{}{}:
		default:
		}
		return errors.New("fails")
	}))
	stop := startRouter(t, r)
	e.publish(1)
	<-failed
	start := time.Now()
	stop()
	assert.Less(t, time.Since(start), 10*time.Second, "close did not wait for the 20s backoff")
	assert.Zero(t, e.consumed(e.in, "g"))
	assert.Zero(t, e.count(`SELECT count(*) FROM `+e.eff))
}

func TestRetryPolicyValidation(t *testing.T) {
	t.Parallel()
	db := &sql.DB{}
	_, err := transport.New(transport.Config{DB: db, AckDeadline: time.Minute, Retry: transport.RetryPolicy{MaxAttempts: 10, InitialBackoff: 10 * time.Second, MaxBackoff: 10 * time.Second}})
	require.ErrorContains(t, err, "more than half the ack deadline")
	_, err = transport.New(transport.Config{DB: db, Retry: transport.RetryPolicy{MaxAttempts: -1}})
	require.ErrorContains(t, err, "MaxAttempts")
	_, err = transport.New(transport.Config{DB: db, Retry: transport.RetryPolicy{DeadLetterTopic: "bad topic"}})
	require.ErrorIs(t, err, transport.ErrInvalidTopic)

	tr, err := transport.New(transport.Config{DB: db})
	require.NoError(t, err)
	r, err := tr.NewRouter()
	require.NoError(t, err)
	err = r.AddHandler("h", "t", "", func(*message.Message) error { return nil }, transport.WithRetry(transport.RetryPolicy{MaxAttempts: -2}))
	require.ErrorContains(t, err, "MaxAttempts")
}

// A message stored with JSON null metadata is consumed like any other.
func TestNilMetadataIsConsumed(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	r, err := e.tr.NewRouter()
	require.NoError(t, err)
	require.NoError(t, r.AddHandler("h", e.in, "g", func(msg *message.Message) error { return effect(msg, e.eff, "row") }))
	startRouter(t, r)
	require.NoError(t, e.tr.Publisher(e.db.SQL).Publish(e.in, &message.Message{UUID: "nil-meta-" + e.id, Payload: []byte(`{}`)}))
	// A row another producer wrote with null metadata.
	_, err = e.db.SQL.Exec(`INSERT INTO `+e.tr.MessagesTable(e.in)+` (uuid, payload, metadata, transaction_id) VALUES ($1, '{}', 'null', pg_current_xact_id())`, "null-meta-"+e.id)
	require.NoError(t, err)
	waitFor(t, 10*time.Second, "both consumed", func() bool { return e.consumed(e.in, "g") == 2 })
	assert.Equal(t, 2, e.count(`SELECT count(*) FROM `+e.eff))
}

// A handler that acks the message itself and then fails must not get its
// failed attempt committed: the ack goes nowhere, the message stays unacked.
func TestHandlerAckDoesNotEndAttempt(t *testing.T) {
	t.Parallel()
	e := newEnv(t, func(c *transport.Config) {
		c.Retry = transport.RetryPolicy{MaxAttempts: 2, InitialBackoff: 10 * time.Millisecond}
	})
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
	assert.Zero(t, e.consumed(e.in, "g"), "the message was never acked")
}

// Once Close has started, no new attempt begins, even from a retry
// middleware outside the Router's own loop; so an attempt can never start
// after Close decided which attempts to cut off and be committed half done.
func TestNoAttemptStartsAfterCloseBegins(t *testing.T) {
	t.Parallel()
	e := newEnv(t, func(c *transport.Config) { c.CloseTimeout = 200 * time.Millisecond })
	other := "other_" + randomID()
	require.NoError(t, e.tr.CreateTopics(context.Background(), other))
	r, err := e.tr.NewRouter()
	require.NoError(t, err)
	r.AddMiddleware(middleware.Retry{MaxRetries: 3, InitialInterval: 300 * time.Millisecond}.Middleware)
	var (
		aStarted = make(chan struct{}, 10)
		bInside  = make(chan struct{})
		aCalls   atomic.Int32
	)
	require.NoError(t, r.AddHandler("a", e.in, "a", func(msg *message.Message) error {
		aCalls.Add(1)
		aStarted <- struct{}{}
		if err := effect(msg, e.eff, "a"); err != nil {
			return err
		}
		if aCalls.Load() == 1 {
			return errors.New("first attempt fails; the retry middleware waits 300ms")
		}
		tx, _ := transport.TxFromContext(msg.Context())
		if _, err := tx.ExecContext(msg.Context(), `SELECT pg_sleep(3)`); err != nil {
			return err
		}
		return effect(msg, e.eff, "b")
	}))
	require.NoError(t, r.AddHandler("b", other, "b", func(msg *message.Message) error {
		close(bInside)
		tx, _ := transport.TxFromContext(msg.Context())
		_, err := tx.ExecContext(msg.Context(), `SELECT pg_sleep(2)`) // slows Close's cut-off
		return err
	}))
	done := make(chan error, 1)
	go func() { done <- r.Run(context.Background()) }()
	<-r.Running()
	// Both in one transaction: B's open batch would otherwise hide a later
	// message from A (the subscriber's visibility fence).
	tx, err := e.db.SQL.Begin()
	require.NoError(t, err)
	require.NoError(t, e.tr.Publisher(tx).Publish(other, message.NewMessage("b-"+e.id, []byte(`{}`))))
	require.NoError(t, e.tr.Publisher(tx).Publish(e.in, message.NewMessage("a-"+e.id, []byte(`{}`))))
	require.NoError(t, tx.Commit())
	<-bInside
	<-aStarted
	_ = r.Close()
	<-done
	assert.EqualValues(t, 1, aCalls.Load(), "no attempt started after Close began")
	assertNoPartialWork(t, e, "a")
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
	waitFor(t, 10*time.Second, "consumed", func() bool { return e.consumed(e.in, "g") == 1 })
	assert.Equal(t, 1, e.count(`SELECT count(*) FROM `+e.eff+` WHERE msg = $1 AND part = 'a'`, ids[0]), "the failed attempt's write was rolled back")
	assert.Equal(t, 1, e.count(`SELECT count(*) FROM `+e.eff+` WHERE msg = $1 AND part = 'intercepted'`, ids[0]))
	mu.Lock()
	assert.Equal(t, 2, names["h"])
	mu.Unlock()
}
