package transport_test

import (
	"context"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/steps/transport"
)

// Inside an attempt, publishes and deferred statements land at the end of
// the attempt: with the offset when it succeeds, not at all when it fails,
// byte for byte, in order.
func TestDeferredStatementsCommitWithTheAttempt(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	var attempt atomic.Int32
	handleOne(t, e, func(msg *message.Message) error {
		tx, _ := transport.TxFromContext(msg.Context())
		n := attempt.Add(1)
		_, isDeferrer := tx.(transport.Deferrer)
		require.True(t, isDeferrer)
		out := []*message.Message{message.NewMessage(replyID(msg), []byte{0, 1, 2, 255, '\'', '$'}), message.NewMessage(replyID(msg)[:30]+"second", nil)}
		out[0].Metadata.Set("quote", `it's "$1"`)
		if err := e.tr.Publisher(tx).Publish(e.out, out...); err != nil {
			return err
		}
		if err := transport.ExecOrDefer(msg.Context(), tx, `INSERT INTO `+e.eff+` (msg, part, attempt) VALUES ($1, $2, $3)`, msg.UUID, "deferred", n); err != nil {
			return err
		}
		if n == 1 {
			return errors.New("first attempt fails after queueing")
		}
		return nil
	})
	waitFor(t, 10*time.Second, "the message consumed", func() bool { return e.consumed(e.in, "g") == 1 })
	assert.Equal(t, 1, e.count(`SELECT count(*) FROM `+e.eff), "only the second attempt's deferred insert")
	assert.Equal(t, 1, e.count(`SELECT count(*) FROM `+e.eff+` WHERE attempt = 2`))
	rows, err := e.db.SQL.Query(`SELECT uuid, payload, metadata->>'quote' FROM ` + e.tr.MessagesTable(e.out) + ` ORDER BY "offset"`)
	require.NoError(t, err)
	defer rows.Close()
	var got []string
	for rows.Next() {
		var id string
		var payload []byte
		var quote *string
		require.NoError(t, rows.Scan(&id, &payload, &quote))
		if quote != nil {
			assert.Equal(t, `it's "$1"`, *quote)
			assert.Equal(t, []byte{0, 1, 2, 255, '\'', '$'}, payload)
		} else {
			assert.Nil(t, payload)
		}
		got = append(got, id)
	}
	require.Len(t, got, 2, "the failed attempt's messages are gone")
	assert.True(t, strings.HasSuffix(got[1], "second"), "in publish order")
}

// A handler's own savepoint takes back what was published after it, as it
// would without deferral: queued statements are sent before any savepoint
// command.
func TestDeferralRespectsTheHandlersSavepoints(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	handleOne(t, e, func(msg *message.Message) error {
		ctx := msg.Context()
		tx, _ := transport.TxFromContext(ctx)
		pub := e.tr.Publisher(tx)
		if err := pub.Publish(e.out, message.NewMessage("kept-"+msg.UUID[:20], nil)); err != nil {
			return err
		}
		if _, err := tx.ExecContext(ctx, `SAVEPOINT mine`); err != nil {
			return err
		}
		if err := pub.Publish(e.out, message.NewMessage("undone-"+msg.UUID[:20], nil)); err != nil {
			return err
		}
		_, err := tx.ExecContext(ctx, `ROLLBACK TO SAVEPOINT mine`)
		return err
	})
	waitFor(t, 10*time.Second, "the message consumed", func() bool { return e.consumed(e.in, "g") == 1 })
	assert.Equal(t, 1, e.outWithPrefix("kept-"))
	assert.Zero(t, e.outWithPrefix("undone-"))
}

// A deferred publish to a topic with no table fails its attempt (at the
// end, where it runs) with ErrUnknownTopic; the message is dead-lettered
// after its attempts and the lane moves on.
func TestDeferredPublishToAnUnknownTopic(t *testing.T) {
	t.Parallel()
	dlq := "dlq_" + randomID()
	e := newEnv(t, func(c *transport.Config) {
		c.Retry = transport.RetryPolicy{MaxAttempts: 2, InitialBackoff: time.Millisecond, DeadLetterTopic: dlq}
	})
	require.NoError(t, e.tr.CreateTopics(context.Background(), dlq))
	handleOne(t, e, func(msg *message.Message) error {
		tx, _ := transport.TxFromContext(msg.Context())
		if err := effect(msg, e.eff, "row"); err != nil {
			return err
		}
		return e.tr.Publisher(tx).Publish("nowhere_"+e.id, message.NewMessage(replyID(msg), nil))
	})
	waitFor(t, 10*time.Second, "the message dead-lettered", func() bool { return e.messagesIn(dlq) == 1 })
	var reason string
	require.NoError(t, e.db.SQL.QueryRow(`SELECT metadata->>'dead_letter_reason' FROM `+e.tr.MessagesTable(dlq)).Scan(&reason))
	assert.Contains(t, reason, "topic table does not exist")
	assert.Zero(t, e.count(`SELECT count(*) FROM `+e.eff), "nothing of the failed attempts stays")
}

// A handler that rolls back to its own savepoint after a failed statement
// recovers, as it would without deferral: the rollback takes back what was
// queued after the savepoint instead of sending it into the aborted
// transaction.
func TestHandlerRollsBackToItsSavepointAfterAnError(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	var attempts atomic.Int32
	handleOne(t, e, func(msg *message.Message) error {
		attempts.Add(1)
		ctx := msg.Context()
		tx, _ := transport.TxFromContext(ctx)
		if _, err := tx.ExecContext(ctx, `SAVEPOINT mine`); err != nil {
			return err
		}
		if err := e.tr.Publisher(tx).Publish(e.out, message.NewMessage("undone-"+msg.UUID[:20], nil)); err != nil {
			return err
		}
		if _, err := tx.ExecContext(ctx, `SELECT 1/0`); err == nil {
			return errors.New("division by zero succeeded")
		}
		if _, err := tx.ExecContext(ctx, `ROLLBACK TO SAVEPOINT mine`); err != nil {
			return err
		}
		return effect(msg, e.eff, "after-recovery")
	})
	waitFor(t, 10*time.Second, "the message consumed", func() bool { return e.consumed(e.in, "g") == 1 })
	assert.Equal(t, int32(1), attempts.Load(), "the handler recovered in its first attempt")
	assert.Equal(t, 1, e.count(`SELECT count(*) FROM `+e.eff+` WHERE part = 'after-recovery'`))
	assert.Zero(t, e.messagesIn(e.out), "the publish after the savepoint was taken back")
}

// Savepoint commands are recognised behind comments and white space, and
// through QueryContext too.
func TestSavepointCommandsBehindComments(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	handleOne(t, e, func(msg *message.Message) error {
		ctx := msg.Context()
		tx, _ := transport.TxFromContext(ctx)
		pub := e.tr.Publisher(tx)
		if err := pub.Publish(e.out, message.NewMessage("kept-"+msg.UUID[:20], nil)); err != nil {
			return err
		}
		rows, err := tx.QueryContext(ctx, "/* take a /* nested */ mark */ savepoint s")
		if err != nil {
			return err
		}
		_ = rows.Close()
		if err := pub.Publish(e.out, message.NewMessage("undone-"+msg.UUID[:20], nil)); err != nil {
			return err
		}
		_, err = tx.ExecContext(ctx, "-- undo\n  ROLLBACK TO SAVEPOINT s")
		return err
	})
	waitFor(t, 10*time.Second, "the message consumed", func() bool { return e.consumed(e.in, "g") == 1 })
	assert.Equal(t, 1, e.outWithPrefix("kept-"))
	assert.Zero(t, e.outWithPrefix("undone-"))
}

// Placeholders are renumbered only where pgx and PostgreSQL see them: not
// in comments, E” strings or dollar-quoted strings.
func TestDeferredSQLWithQuotesAndComments(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	handleOne(t, e, func(msg *message.Message) error {
		ctx := msg.Context()
		tx, _ := transport.TxFromContext(ctx)
		if err := transport.ExecOrDefer(ctx, tx, `INSERT INTO `+e.eff+` (msg, part) VALUES ($1, $2)`, msg.UUID, "first"); err != nil {
			return err
		}
		return transport.ExecOrDefer(ctx, tx, `INSERT INTO `+e.eff+` (msg, part, attempt) VALUES ($1 /* it's $2 /* nested $3 */ */,
			E'\'$1' || $$ $2 $$ || $tag$ '$1 $tag$ || $2, -- $1 isn't here
			$3)`, msg.UUID, "x", 7)
	})
	waitFor(t, 10*time.Second, "the message consumed", func() bool { return e.consumed(e.in, "g") == 1 })
	var part string
	var attempt int
	require.NoError(t, e.db.SQL.QueryRow(`SELECT part, attempt FROM `+e.eff+` WHERE part <> 'first'`).Scan(&part, &attempt))
	assert.Equal(t, `'$1 $2  '$1 x`, part)
	assert.Equal(t, 7, attempt)
}

// When queued statements cannot be sent (here pgx cannot encode an
// argument, so nothing reaches the server and the transaction is not
// aborted), the attempt fails even if the handler ignores the error: what
// was queued is gone and must not be missing from a kept attempt.
func TestFailedSendOfQueuedStatementsFailsTheAttempt(t *testing.T) {
	t.Parallel()
	dlq := "dlq_" + randomID()
	e := newEnv(t, func(c *transport.Config) {
		c.Retry = transport.RetryPolicy{MaxAttempts: 2, InitialBackoff: time.Millisecond, DeadLetterTopic: dlq}
	})
	require.NoError(t, e.tr.CreateTopics(context.Background(), dlq))
	handleOne(t, e, func(msg *message.Message) error {
		ctx := msg.Context()
		tx, _ := transport.TxFromContext(ctx)
		if err := tx.(transport.Deferrer).DeferExec(ctx, `INSERT INTO `+e.eff+` (msg, part) VALUES ($1, $2)`, msg.UUID, make(chan int)); err != nil {
			return err
		}
		_, _ = tx.ExecContext(ctx, `SAVEPOINT ignored`) // fails to send the queue; ignored
		return effect(msg, e.eff, "kept-anyway")
	})
	waitFor(t, 10*time.Second, "the message dead-lettered", func() bool { return e.messagesIn(dlq) == 1 })
	assert.Zero(t, e.count(`SELECT count(*) FROM `+e.eff), "no attempt was kept")
}

// handleOne runs h as handler "h" of group "g" on e.in in a started Router,
// and publishes one message to it.
func handleOne(t *testing.T, e *env, h func(*message.Message) error) {
	t.Helper()
	r, err := e.tr.NewRouter()
	require.NoError(t, err)
	require.NoError(t, r.AddHandler("h", e.in, "g", h))
	startRouter(t, r)
	e.publish(1)
}

// outWithPrefix counts the messages on e.out whose UUID starts with prefix.
func (e *env) outWithPrefix(prefix string) int {
	return e.count(`SELECT count(*) FROM `+e.tr.MessagesTable(e.out)+` WHERE starts_with(uuid, $1)`, prefix)
}
