package transport_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v3/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/steps/transport"
)

// Pins watermill-sql's behaviour that the savepoint exists for: a nacked
// attempt's writes stay in the batch transaction and are committed with the
// successful retry.
func TestPinNackKeepsWritesWithoutSavepoint(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	sub, err := e.tr.Subscriber("pin")
	require.NoError(t, err)
	wr, err := message.NewRouter(message.RouterConfig{}, nil)
	require.NoError(t, err)
	seen := newAttempts()
	wr.AddConsumerHandler("pin", e.in, sub, func(msg *message.Message) error {
		tx, ok := wsql.TxFromContext(msg.Context())
		require.True(t, ok)
		if _, err := tx.ExecContext(msg.Context(), `INSERT INTO `+e.eff+` (msg, part) VALUES ($1, 'row')`, msg.UUID); err != nil {
			return err
		}
		if seen.next(msg.UUID) == 1 {
			return errors.New("first attempt fails after writing")
		}
		return nil
	})
	go func() { _ = wr.Run(context.Background()) }()
	t.Cleanup(func() { _ = wr.Close() })
	<-wr.Running()

	ids := e.publish(1)
	waitFor(t, 10*time.Second, "the message to be consumed", func() bool { return e.consumed(e.in, "pin") == 1 })
	assert.Equal(t, 2, e.count(`SELECT count(*) FROM `+e.eff+` WHERE msg = $1`, ids[0]),
		"watermill-sql v3 is expected to keep a nacked attempt's writes; if this changed, revisit the savepoint design")
}

// Pins the other half: without a savepoint, a failed statement leaves the
// batch transaction aborted and every redelivery fails until the ack deadline.
func TestPinFailedStatementPoisonsTransactionWithoutSavepoint(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	sub, err := e.tr.Subscriber("pin")
	require.NoError(t, err)
	wr, err := message.NewRouter(message.RouterConfig{}, nil)
	require.NoError(t, err)
	second := make(chan error, 1)
	seen := newAttempts()
	wr.AddConsumerHandler("pin", e.in, sub, func(msg *message.Message) error {
		tx, _ := wsql.TxFromContext(msg.Context())
		_, err := tx.ExecContext(msg.Context(), `SELECT 1/0`)
		if seen.next(msg.UUID) == 2 {
			second <- err
		}
		return err
	})
	go func() { _ = wr.Run(context.Background()) }()
	t.Cleanup(func() { _ = wr.Close() })
	<-wr.Running()

	e.publish(1)
	select {
	case err := <-second:
		var pgErr *pgconn.PgError
		require.ErrorAs(t, err, &pgErr)
		assert.Equal(t, "25P02", pgErr.Code, "the redelivery runs in the aborted transaction")
	case <-time.After(10 * time.Second):
		t.Fatal("no redelivery")
	}
}

// With the Router, a failed attempt (error, panic, or failed statement)
// leaves nothing behind: after one failed and one successful attempt there is
// exactly one business row and one outgoing message.
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
			waitFor(t, 10*time.Second, "all messages consumed", func() bool { return e.consumed(e.in, "g") == 3 })
			for _, id := range ids {
				assert.Equal(t, 2, seen.of(id), "one failed and one successful attempt")
				assert.Equal(t, 1, e.count(`SELECT count(*) FROM `+e.eff+` WHERE msg = $1`, id), "business rows of %s", id)
				assert.Equal(t, 1, e.count(`SELECT count(*) FROM `+e.tr.MessagesTable(e.out)+` WHERE uuid = $1`, replyID(message.NewMessage(id, nil))), "outgoing messages of %s", id)
			}
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
			e := newEnv(t, nil)
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
			assert.Zero(t, e.messagesIn(e.out), "no outgoing message while the step has not committed")
			stop()
			assert.Zero(t, e.messagesIn(e.out), "no outgoing message after the router stopped")
			assert.Zero(t, e.count(`SELECT count(*) FROM `+e.eff), "no business row")
			assert.Zero(t, e.consumed(e.in, "g"), "the message was never acked")
		})
	}
}

// A failed statement does not stall the lane until the ack deadline: the
// message is retried and succeeds within a fraction of it.
func TestFailedStatementRetriedWellBeforeAckDeadline(t *testing.T) {
	t.Parallel()
	e := newEnv(t, func(c *transport.Config) { c.AckDeadline = time.Minute })
	r, err := e.tr.NewRouter()
	require.NoError(t, err)
	seen := newAttempts()
	var firstErr atomic.Value
	require.NoError(t, r.AddHandler("h", e.in, "g", func(msg *message.Message) error {
		if seen.next(msg.UUID) == 1 {
			tx, _ := transport.TxFromContext(msg.Context())
			_, err := tx.ExecContext(msg.Context(), `INSERT INTO `+e.eff+` (msg, part) VALUES ($1, NULL)`, msg.UUID)
			firstErr.CompareAndSwap(nil, err)
			return err
		}
		return effect(msg, e.eff, "row")
	}))
	startRouter(t, r)

	start := time.Now()
	e.publish(20)
	waitFor(t, 10*time.Second, "all 20 messages consumed", func() bool { return e.consumed(e.in, "g") == 20 })
	elapsed := time.Since(start)
	var pgErr *pgconn.PgError
	require.ErrorAs(t, firstErr.Load().(error), &pgErr)
	assert.Equal(t, "23502", pgErr.Code, "the first attempt failed on a NOT NULL violation")
	assert.Equal(t, 20, e.count(`SELECT count(*) FROM `+e.eff))
	assert.Less(t, elapsed, time.Minute/6, "recovered well before the ack deadline")
}

// Statements of an attempt are bounded by statement_timeout, and a statement
// that hits it is rolled back and retried like any failure.
func TestStatementTimeoutBoundsAttempt(t *testing.T) {
	t.Parallel()
	e := newEnv(t, func(c *transport.Config) { c.StatementTimeout = 100 * time.Millisecond; c.AckDeadline = time.Minute })
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
	waitFor(t, 10*time.Second, "the message consumed", func() bool { return e.consumed(e.in, "g") == 1 })
	var pgErr *pgconn.PgError
	require.ErrorAs(t, firstErr.Load().(error), &pgErr)
	assert.Equal(t, "57014", pgErr.Code, "query_canceled by statement_timeout")
	assert.Equal(t, 1, e.count(`SELECT count(*) FROM `+e.eff))
}

// A statement of an attempt runs to completion even when the context the
// handler passes is already cancelled: only statement_timeout bounds it.
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
	waitFor(t, 10*time.Second, "messages consumed", func() bool { return e.consumed(e.in, "g") == 2 })
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
	waitFor(t, 10*time.Second, "message consumed", func() bool { return e.consumed(e.in, "g") == 1 })
	_, err = tx.ExecContext(context.Background(), `INSERT INTO `+e.eff+` (msg, part) VALUES ('late', 'row')`)
	require.ErrorIs(t, err, transport.ErrAttemptOver)
	var one int
	require.Error(t, tx.QueryRowContext(context.Background(), `SELECT 1`).Scan(&one))
	assert.Zero(t, e.count(`SELECT count(*) FROM `+e.eff))
}

// A connection killed in the middle of a step (pg_terminate_backend) costs a
// redelivery of the batch within seconds, not a stall until the ack deadline,
// and every message's effect still exists exactly once.
func TestConnectionKilledMidStepRecoversQuickly(t *testing.T) {
	t.Parallel()
	e := newEnv(t, func(c *transport.Config) { c.AckDeadline = 5 * time.Minute })
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

	tx, err := e.db.SQL.Begin()
	require.NoError(t, err)
	var msgs []*message.Message
	for i := range 30 {
		m := message.NewMessage(fmt.Sprintf("m-%02d-%s", i, e.id), []byte(`{}`))
		if i == 10 {
			m.Metadata.Set("kill", "yes")
		}
		msgs = append(msgs, m)
	}
	require.NoError(t, e.tr.Publisher(tx).Publish(e.in, msgs...))
	require.NoError(t, tx.Commit())

	start := time.Now()
	waitFor(t, 20*time.Second, "all messages consumed after the kill", func() bool { return e.consumed(e.in, "g") == 30 })
	assert.True(t, killed.Load())
	assert.Less(t, time.Since(start), time.Minute, "recovered long before the 5m ack deadline")
	assertExactlyOnce(t, e, 30)
}

// assertExactlyOnce checks that each of n messages has both parts of its
// effect exactly once.
func assertExactlyOnce(t *testing.T, e *env, n int) {
	t.Helper()
	assert.Equal(t, n, e.count(`SELECT count(DISTINCT msg) FROM `+e.eff), "messages with an effect")
	assert.Zero(t, e.count(`SELECT count(*) FROM (SELECT msg FROM `+e.eff+` GROUP BY msg, part HAVING count(*) <> 1) d`), "effect parts present more than once")
	assert.Zero(t, e.count(`SELECT count(*) FROM (SELECT msg FROM `+e.eff+` GROUP BY msg HAVING count(*) <> 2) d`), "messages with a partial effect")
}

func TestConfigValidation(t *testing.T) {
	t.Parallel()
	db := &sql.DB{}
	cases := map[string]transport.Config{
		"no db":                      {},
		"negative batch":             {DB: db, BatchSize: -1},
		"negative poll":              {DB: db, PollInterval: -time.Second},
		"ack deadline below timeout": {DB: db, StatementTimeout: time.Minute, AckDeadline: time.Minute},
		"max retry below retry":      {DB: db, RetryInterval: time.Second, MaxRetryInterval: time.Millisecond},
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
	assert.Equal(t, 50, got.BatchSize)
	assert.Equal(t, 5*time.Minute, got.AckDeadline)
	assert.Equal(t, 10*time.Second, got.StatementTimeout)
}

func TestTopicErrors(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	err := e.tr.Publisher(e.db.SQL).Publish("missing_"+e.id, message.NewMessage("x", []byte(`{}`)))
	require.ErrorIs(t, err, transport.ErrUnknownTopic)
	err = e.tr.Publisher(e.db.SQL).Publish(e.out, message.NewMessage(strings.Repeat("x", 37), []byte(`{}`)))
	require.ErrorIs(t, err, transport.ErrInvalidMessageID)

	for _, bad := range []string{"", "has space", "semi;colon", "quote\"", strings.Repeat("a", transport.MaxTopicLen+1)} {
		require.ErrorIs(t, transport.ValidateTopic(bad), transport.ErrInvalidTopic, "%q", bad)
		require.ErrorIs(t, e.tr.CreateTopics(context.Background(), bad), transport.ErrInvalidTopic)
	}

	r, err := e.tr.NewRouter()
	require.NoError(t, err)
	require.ErrorIs(t, r.AddHandler("h", "bad topic", "g", func(*message.Message) error { return nil }), transport.ErrInvalidTopic)
	require.ErrorIs(t, r.AddHandler("h", e.in, "bad group", func(*message.Message) error { return nil }), transport.ErrInvalidConsumerGroup)
	require.NoError(t, r.AddHandler("h", "missing_"+e.id, "", func(*message.Message) error { return nil }))
	require.Error(t, r.AddHandler("h", e.in, "g", func(*message.Message) error { return nil }), "duplicate handler name")
	err = r.Run(context.Background())
	require.ErrorIs(t, err, transport.ErrUnknownTopic)
}
