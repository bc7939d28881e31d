package transport_test

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/internal/transport"
)

var errNotMine = errors.New("not mine: another release's")

// A handler that hands its message back (HandBack) spends no attempt: its
// work is rolled back, the message waits a while (longer each time) and is
// claimed again, however often, and never dead-lettered for it. So a
// process that cannot handle a message (a saga engine that does not know
// its definition version, during a rolling deploy) leaves it to one that
// can.
func TestAHandedBackMessageSpendsNoAttempt(t *testing.T) {
	t.Parallel()
	e := newEnv(t, func(c *transport.Config) { c.Retry.MaxAttempts = 2 })
	type seen struct {
		at         time.Time // the database's clock
		attempts   int
		handedBack string
	}
	var (
		mu         sync.Mutex
		deliveries []seen
	)
	e.route(t, func(msg *message.Message) error {
		tx, _ := transport.TxFromContext(msg.Context())
		var s seen
		if err := tx.QueryRowContext(msg.Context(), `SELECT clock_timestamp(), attempts, coalesce(metadata->>'_pgsaga_handed_back', '')
			FROM pgsaga_queue WHERE uuid = $1`, msg.UUID).Scan(&s.at, &s.attempts, &s.handedBack); err != nil {
			return err
		}
		mu.Lock()
		deliveries = append(deliveries, s)
		n := len(deliveries)
		mu.Unlock()
		if err := effect(msg, e.eff, "a"); err != nil {
			return err
		}
		if err := effect(msg, e.eff, "b"); err != nil {
			return err
		}
		if n <= 3 {
			return transport.HandBack(errNotMine) // rolled back with the attempt
		}
		return nil
	})
	e.publish(1)
	e.drained(e.in, "g", 30*time.Second)

	assertExactlyOnce(t, e, 1)
	assert.Empty(t, e.deadLetters(e.in), "handed back three times with two attempts allowed: never dead-lettered")
	mu.Lock()
	defer mu.Unlock()
	require.Len(t, deliveries, 4)
	for i, d := range deliveries {
		assert.Zero(t, d.attempts, "delivery %d: no attempt counted", i+1)
		if i > 0 {
			assert.Equal(t, string(rune('0'+i)), d.handedBack, "delivery %d: the hand-backs are counted in the row", i+1)
			wait := 250 * time.Millisecond << (i - 1)
			assert.GreaterOrEqual(t, d.at.Sub(deliveries[i-1].at), wait, "hand-back %d waited at least %s", i, wait)
		}
	}
}

// Outside a queue (HandleInTx) there is nothing to hand back to: the
// hand-back is the caller's, neither retried nor dead-lettered.
func TestAHandBackOutsideAQueueIsTheCallers(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	calls := 0
	err := e.tr.HandleInTx(context.Background(), "h", e.in, message.NewMessage("m-"+e.id, nil), func(msg *message.Message) error {
		calls++
		return transport.HandBack(errNotMine)
	})
	require.ErrorIs(t, err, errNotMine)
	assert.True(t, transport.IsHandBack(err))
	assert.Equal(t, 1, calls, "not retried")
	assert.Empty(t, e.deadLetters(e.in))
}

// A delivery attempt knows the database's clock without a statement of
// its own (the claim read it); any other transaction does not, and Now
// reads it there.
func TestAnAttemptKnowsTheDatabasesClock(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	type reading struct {
		known      bool
		dbNow, now time.Time
	}
	got := make(chan reading, 2)
	read := func(msg *message.Message) error {
		tx, _ := transport.TxFromContext(msg.Context())
		var r reading
		var err error
		if r.dbNow, r.known = transport.DBNow(tx); !r.known {
			return errors.New("no clock")
		}
		if r.now, err = transport.Now(msg.Context(), tx); err != nil {
			return err
		}
		got <- r
		return nil
	}
	e.route(t, read)
	e.publish(1)
	require.NoError(t, e.tr.HandleInTx(context.Background(), "own", e.in, message.NewMessage("own-"+e.id, nil), read))
	for range 2 {
		r := <-got
		var server time.Time
		require.NoError(t, e.db.SQL.QueryRow(`SELECT clock_timestamp()`).Scan(&server))
		assert.WithinDuration(t, server, r.dbNow, 5*time.Second)
		assert.False(t, r.now.Before(r.dbNow), "Now takes the attempt's clock")
	}

	tx, err := e.db.SQL.Begin()
	require.NoError(t, err)
	defer tx.Rollback() //nolint:errcheck
	_, known := transport.DBNow(tx)
	assert.False(t, known, "a caller's transaction: the transport does not know its clock")
	now, err := transport.Now(context.Background(), tx)
	require.NoError(t, err)
	assert.False(t, now.IsZero())
}
