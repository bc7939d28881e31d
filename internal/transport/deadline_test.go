package transport_test

import (
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/idempotency"
	"github.com/pgsaga/pgsaga/internal/testdb"
	"github.com/pgsaga/pgsaga/internal/transport"
)

// A handler that outlives its attempt's deadline, sleeping or stuck in a
// statement, is cut off and rolled back before anything commits: none of
// its writes, no outgoing message, and its idempotency key stays free; the
// message that shared its batch is committed; later the message is handled
// exactly once, key completed.
func TestSlowHandlerIsRolledBackAndCompletesOnceLater(t *testing.T) {
	t.Parallel()
	for name, stall := range map[string]func(tx transport.Tx, msg *message.Message){
		"sleeping": func(transport.Tx, *message.Message) { time.Sleep(3 * time.Second) },
		"in a statement": func(tx transport.Tx, msg *message.Message) {
			_, _ = tx.ExecContext(msg.Context(), `SELECT pg_sleep(30)`)
		},
		"ignoring errors": func(tx transport.Tx, msg *message.Message) { <-msg.Context().Done() },
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t, func(c *transport.Config) { c.AttemptTimeout = 300 * time.Millisecond })
			store, err := idempotency.NewStore(idempotency.Config{DB: e.db.SQL})
			require.NoError(t, err)
			scope := "slow-" + e.id
			r, err := e.tr.NewRouter()
			require.NoError(t, err)
			seen := newAttempts()
			var lateErr atomic.Value
			require.NoError(t, r.AddHandler("h", e.in, "g", func(msg *message.Message) error {
				tx, _ := transport.TxFromContext(msg.Context())
				req := idempotency.Request{Scope: scope, Key: msg.UUID, Hash: idempotency.Fingerprint(msg.Payload)}
				claim, err := store.ClaimTx(msg.Context(), tx, req)
				if err != nil {
					return err
				}
				if !claim.Execute {
					return errors.New("the key was already taken")
				}
				if err := effect(msg, e.eff, "a"); err != nil {
					return err
				}
				if err := e.tr.Publisher(tx).Publish(e.out, message.NewMessage(replyID(msg), nil)); err != nil {
					return err
				}
				if msg.Metadata.Get("slow") == "yes" && seen.next(msg.UUID) == 1 {
					stall(tx, msg)
					err := effect(msg, e.eff, "late") // after the cut-off
					lateErr.Store(&err)
					return nil
				}
				if err := effect(msg, e.eff, "b"); err != nil {
					return err
				}
				return store.CompleteTx(msg.Context(), tx, req, idempotency.StatusCompleted, idempotency.Response{})
			}))
			startRouter(t, r)

			slow := message.NewMessage("slow-"+e.id, []byte(`{}`))
			slow.Metadata.Set("slow", "yes")
			quick := message.NewMessage("quick-"+e.id, []byte(`{}`))
			require.NoError(t, e.tr.Publisher(e.db.SQL).Publish(e.in, slow, quick)) // one batch

			waitFor(t, 10*time.Second, "the cut-off recorded", func() bool {
				return e.count(`SELECT count(*) FROM pgsaga_queue WHERE uuid = $1 AND attempts = 1`, slow.UUID) == 1 ||
					e.count(`SELECT count(*) FROM `+e.eff+` WHERE msg = $1`, slow.UUID) > 0
			})
			e.drained(e.in, "g", 20*time.Second)
			assertExactlyOnce(t, e, 2)
			assert.Equal(t, 2, seen.of(slow.UUID), "cut off once, then done")
			assert.Equal(t, 2, e.published(), "one outgoing message each")
			var status string
			require.NoError(t, e.db.SQL.QueryRow(`SELECT status FROM idempotency_keys WHERE scope = $1 AND key = $2`, scope, slow.UUID).Scan(&status))
			assert.Equal(t, "completed", status)
			assert.Empty(t, e.deadLetters(e.in))
			if name == "sleeping" {
				waitFor(t, 10*time.Second, "the stalled handler to return", func() bool { return lateErr.Load() != nil })
				assert.ErrorIs(t, *lateErr.Load().(*error), transport.ErrAttemptOver, "nothing it does after the cut-off reaches the database")
			}
		})
	}
}

// No delivery transaction stays open much longer than the attempt's
// deadline, whatever its handler does: a handler that ignores its context
// and sleeps for seconds leaves no transaction behind once it is cut off.
func TestDeliveryTransactionsAreBounded(t *testing.T) {
	t.Parallel()
	db := testdb.Fresh(t) // any transaction here is the transport's
	e := newEnvOn(t, db, func(c *transport.Config) {
		c.AttemptTimeout = 200 * time.Millisecond
		c.Retry = transport.RetryPolicy{MaxAttempts: 2, InitialBackoff: time.Hour, MaxBackoff: time.Hour}
	})
	r, err := e.tr.NewRouter()
	require.NoError(t, err)
	started := make(chan struct{}, 1)
	require.NoError(t, r.AddHandler("h", e.in, "g", func(msg *message.Message) error {
		started <- struct{}{}
		time.Sleep(5 * time.Second)
		return nil
	}))
	startRouter(t, r)
	e.publish(1)
	<-started
	waitFor(t, 3*time.Second, "the cut-off's failure recorded", func() bool {
		return e.count(`SELECT count(*) FROM pgsaga_queue WHERE topic = $1 AND attempts = 1`, e.in) == 1
	})
	// The handler sleeps on for seconds; no transaction lasts longer than
	// the attempt's deadline and a little.
	assert.Never(t, func() bool {
		return e.count(`SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()
			AND clock_timestamp() - xact_start > interval '400 milliseconds'`) > 0
	}, 2*time.Second, 20*time.Millisecond, "a transaction outlived the attempt's deadline")
	assert.Less(t, e.tr.Config().MaxTransactionDuration(), time.Minute)
}

// A batch stops starting attempts after BatchTimeout and commits what it
// did, releasing the rest: a message handled early in a batch of slow ones
// is committed, and visible to the next step, long before the batch's last
// message would have been handled.
func TestBatchTimeoutCommitsEarlyWork(t *testing.T) {
	t.Parallel()
	e := newEnv(t, func(c *transport.Config) { c.BatchSize, c.BatchTimeout = 10, 300*time.Millisecond })
	r, err := e.tr.NewRouter()
	require.NoError(t, err)
	var handled atomic.Int32
	require.NoError(t, r.AddHandler("h", e.in, "g", func(msg *message.Message) error {
		defer handled.Add(1)
		if err := effect(msg, e.eff, "row"); err != nil {
			return err
		}
		tx, _ := transport.TxFromContext(msg.Context())
		_, err := tx.ExecContext(msg.Context(), `SELECT pg_sleep(0.15)`)
		return err
	}))
	startRouter(t, r)
	ids := e.publish(10) // one claim takes them all
	waitFor(t, 20*time.Second, "the first message's effect committed", func() bool {
		return e.count(`SELECT count(*) FROM `+e.eff+` WHERE msg = $1`, ids[0]) == 1
	})
	assert.Less(t, int(handled.Load()), 10, "committed before the whole batch was handled")
	e.drained(e.in, "g", 20*time.Second)
	assert.Equal(t, 10, e.count(`SELECT count(*) FROM `+e.eff))
}
