package transport_test

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/internal/transport"
)

// told records the commit hooks that ran: which message, from which
// attempt, and how many of the message's effects another connection saw
// then (1: the hook ran after the commit).
type told struct {
	mu   sync.Mutex
	runs map[string][]string
}

func newTold() *told { return &told{runs: map[string][]string{}} }

func (tl *told) add(id, what string) {
	tl.mu.Lock()
	defer tl.mu.Unlock()
	tl.runs[id] = append(tl.runs[id], what)
}

func (tl *told) of(id string) []string {
	tl.mu.Lock()
	defer tl.mu.Unlock()
	return append([]string(nil), tl.runs[id]...)
}

// hook registers a commit hook for msg that records what another
// connection sees of its effects when it runs.
func (e *env) hook(tl *told, msg *message.Message, tx transport.Tx, label string) bool {
	id := msg.UUID
	return transport.OnCommit(tx, func() {
		n := e.count(`SELECT count(*) FROM `+e.eff+` WHERE msg = $1`, id)
		tl.add(id, label+" seeing "+string(rune('0'+n)))
	})
}

// A commit hook runs once, after the commit of the attempt that kept the
// work: not for an attempt that failed, nor for what a rolled-back
// savepoint did.
func TestOnCommitRunsOnceAfterTheCommit(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	tl := newTold()
	calls := newAttempts()
	e.route(t, func(msg *message.Message) error {
		n := calls.next(msg.UUID)
		tx, _ := transport.TxFromContext(msg.Context())
		if err := effect(msg, e.eff, "a"); err != nil {
			return err
		}
		if !e.hook(tl, msg, tx, "attempt "+string(rune('0'+n))) || !transport.InAttempt(tx) {
			return errors.New("a delivery attempt's Tx is not one")
		}
		err := transport.Savepoint(msg.Context(), tx, func(tx transport.Tx) error {
			e.hook(tl, msg, tx, "savepoint")
			return errors.New("undone")
		})
		if err == nil {
			return errors.New("the savepoint was not rolled back")
		}
		if n == 1 {
			return errors.New("the first attempt fails")
		}
		return nil
	})
	ids := e.publish(5)
	e.drained(e.in, "g", 20*time.Second)
	// Hooks run just after the commit that drained the queue.
	waitFor(t, 10*time.Second, "every message told", func() bool {
		for _, id := range ids {
			if len(tl.of(id)) == 0 {
				return false
			}
		}
		return true
	})
	for _, id := range ids {
		assert.Equal(t, []string{"attempt 2 seeing 1"}, tl.of(id), "once, after the second attempt committed")
	}
	assert.Empty(t, e.deadLetters(e.in))
}

// A transaction that is not a delivery attempt's is not one the transport
// can see commit: OnCommit says so and registers nothing.
func TestOnCommitOutsideAnAttempt(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	ran := false
	assert.False(t, transport.OnCommit(e.db.SQL, func() { ran = true }))
	assert.False(t, transport.InAttempt(e.db.SQL))
	tx, err := e.db.SQL.Begin()
	require.NoError(t, err)
	assert.False(t, transport.OnCommit(tx, func() { ran = true }))
	require.NoError(t, tx.Commit())
	assert.False(t, ran)
}

// The work of a kept attempt in a batch that cannot commit (another
// message of it ended the transaction) is told when it commits later, and
// only then; the message that broke the batch is never told.
func TestOnCommitNotRunForABatchThatRolledBack(t *testing.T) {
	t.Parallel()
	e := newEnv(t, func(c *transport.Config) {
		c.Retry = transport.RetryPolicy{MaxAttempts: 1}
	})
	tl := newTold()
	var broke atomic.Bool
	e.route(t, func(msg *message.Message) error {
		tx, _ := transport.TxFromContext(msg.Context())
		if err := effect(msg, e.eff, "a"); err != nil {
			return err
		}
		e.hook(tl, msg, tx, "kept")
		if isBad(msg) {
			broke.Store(true)
			_, err := tx.ExecContext(msg.Context(), `ROLLBACK`)
			return err
		}
		return nil
	})
	// One batch: the good message's attempt is kept, then the bad one ends
	// the transaction.
	good := message.NewMessage("good-"+e.id, []byte(`{}`))
	bad := message.NewMessage("bad-"+e.id, []byte(`{}`))
	bad.Metadata.Set("bad", "yes")
	require.NoError(t, e.tr.Publisher(e.db.SQL).Publish(e.in, good, bad))
	e.drained(e.in, "g", 20*time.Second)
	require.True(t, broke.Load())
	// The good message is told once its redelivery commits, after the
	// broken batch ended.
	waitFor(t, 10*time.Second, "the good message told", func() bool { return len(tl.of(good.UUID)) > 0 })
	require.Len(t, e.deadLetters(e.in), 1)
	assert.Empty(t, tl.of(bad.UUID), "the message that broke its batch is never told")
	assert.Equal(t, []string{"kept seeing 1"}, tl.of(good.UUID), "told once, when its work committed")
}

// An in-process delivery's hooks go with its publisher's attempt: told
// once the publisher's batch commits; a failed in-process try tells
// nothing (its message is queued and told when handled there).
func TestOnCommitOfInProcessDeliveries(t *testing.T) {
	t.Parallel()
	e := newLocalEnv(t, nil)
	tl := newTold()
	var tries atomic.Int32
	e.routeLocal(t, forward(e), func(msg *message.Message) error {
		tx, _ := transport.TxFromContext(msg.Context())
		origin := msg.Metadata.Get("origin")
		if _, err := tx.ExecContext(msg.Context(), `INSERT INTO `+e.eff+` (msg, part) VALUES ($1, 'l')`, origin); err != nil {
			return err
		}
		inProcess := transport.InProcessFromContext(msg.Context())
		label := "queued"
		if inProcess {
			label = "in process"
		}
		id := origin
		transport.OnCommit(tx, func() {
			n := e.count(`SELECT count(*) FROM `+e.eff+` WHERE msg = $1`, id)
			tl.add(id, label+" seeing "+string(rune('0'+n)))
		})
		if tries.Add(1) == 1 {
			return errors.New("the first in-process try fails")
		}
		return nil
	})
	ids := e.publish(2)
	e.drained(e.in, "g", 10*time.Second)
	e.drained(e.out, "local", 10*time.Second)
	runs := func() []string { return append(tl.of(ids[0]), tl.of(ids[1])...) }
	waitFor(t, 10*time.Second, "both told", func() bool { return len(runs()) >= 2 })
	e.drained(e.in, "g", 10*time.Second)
	assert.ElementsMatch(t, []string{"queued seeing 2", "in process seeing 2"}, runs(),
		"the failed try told nothing; its message was told once handled from the queue, the other once its publisher committed")
}

// HandleInTx tells once its own transaction commits.
func TestOnCommitInHandleInTx(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	tl := newTold()
	var n atomic.Int32
	msg := message.NewMessage("own-"+e.id, []byte(`{}`))
	err := e.tr.HandleInTx(context.Background(), "own", e.in, msg, func(m *message.Message) error {
		tx, _ := transport.TxFromContext(m.Context())
		if err := effect(m, e.eff, "a"); err != nil {
			return err
		}
		e.hook(tl, m, tx, "own")
		if n.Add(1) == 1 {
			return errors.New("the first attempt fails")
		}
		return nil
	})
	require.NoError(t, err)
	assert.Equal(t, []string{"own seeing 1"}, tl.of(msg.UUID))
}
