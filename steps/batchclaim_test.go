package steps_test

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

	"github.com/pgsaga/pgsaga/idempotency"
	"github.com/pgsaga/pgsaga/internal/pgdb"
	"github.com/pgsaga/pgsaga/internal/stepsrt"
	"github.com/pgsaga/pgsaga/internal/testdb"
	"github.com/pgsaga/pgsaga/internal/transport"
	"github.com/pgsaga/pgsaga/steps"
)

// claimCounter counts (its note, a testdb.Tracer) the statements that
// claim idempotency keys.
type claimCounter struct{ one, many atomic.Int64 }

func (c *claimCounter) note(sql string, _ []any) {
	if !strings.HasPrefix(sql, "INSERT INTO idempotency_keys") {
		return
	}
	if strings.Contains(sql, "unnest(") {
		c.many.Add(1)
	} else {
		c.one.Add(1)
	}
}

// batchWorld runs env e's step on a transport over a pool that counts
// claims, its commands published before it starts (so that one claim of
// the queue takes them all), with attempts as given.
func batchWorld(t *testing.T, e *env, maxAttempts int, cmds ...*message.Message) *claimCounter {
	t.Helper()
	return batchWorldWith(t, e, maxAttempts, nil, cmds...)
}

// batchWorldWith is batchWorld with router middleware.
func batchWorldWith(t *testing.T, e *env, maxAttempts int, mw []message.HandlerMiddleware, cmds ...*message.Message) *claimCounter {
	t.Helper()
	var cc claimCounter
	ctx := context.Background()
	db, err := pgdb.Open(ctx, pgdb.Config{URL: e.db.URL, MaxConns: 4, Tracer: testdb.Tracer(cc.note)})
	require.NoError(t, err)
	t.Cleanup(func() { db.Close() })
	tr, err := transport.New(transport.Config{
		DB: db.SQL, Logger: logger(), IdlePollInterval: testdb.NoSafetyPoll, BatchSize: 50, BatchTimeout: time.Minute,
		RetryInterval: 20 * time.Millisecond,
		Retry:         transport.RetryPolicy{MaxAttempts: maxAttempts, InitialBackoff: 10 * time.Millisecond, MaxBackoff: 20 * time.Millisecond},
	})
	require.NoError(t, err)
	store, err := idempotency.NewStore(idempotency.Config{DB: db.SQL})
	require.NoError(t, err)
	rt, err := stepsrt.New(stepsrt.Config{Transport: tr, Store: store, Events: e.es, Logger: logger()})
	require.NoError(t, err)
	tx, err := e.db.SQL.Begin()
	require.NoError(t, err)
	for _, m := range cmds {
		require.NoError(t, tr.Publisher(tx).Publish(e.cmds, m))
	}
	require.NoError(t, tx.Commit())
	r, err := tr.NewRouter()
	require.NoError(t, err)
	r.AddMiddleware(mw...)
	require.NoError(t, rt.Register(r, e.step))
	require.NoError(t, r.Start(ctx))
	t.Cleanup(func() { require.NoError(t, r.Stop()) })
	deadline := time.Now().Add(20 * time.Second)
	for e.waiting() > 0 {
		require.True(t, time.Now().Before(deadline), "commands not consumed")
		time.Sleep(10 * time.Millisecond)
	}
	return &cc
}

// A batch of commands claims their keys in one statement, and each
// attempt finds its key claimed with no statement of its own.
func TestABatchClaimsItsKeysInOneStatement(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	var cmds []*message.Message
	for i := range 20 {
		cmds = append(cmds, e.command("acct-"+string(rune('a'+i)), 10))
	}
	cc := batchWorld(t, e, 4, cmds...)
	assert.Equal(t, 20, e.count(`SELECT count(*) FROM `+e.ledger), "each command's effect once")
	assert.Len(t, e.messages(e.replies), 20)
	assert.Equal(t, int64(1), cc.many.Load(), "one claim for the batch")
	assert.Zero(t, cc.one.Load(), "no claim of its own for any attempt")
	assert.Zero(t, e.count(`SELECT count(*) FROM idempotency_keys WHERE scope = $1 AND status = 'pending'`, e.step.Name()))
}

// A claim whose attempt fails is given back when its batch ends: the
// command's retry, in a later batch, runs (it would find a pending key,
// held by nobody, for ever).
func TestAClaimWhoseAttemptFailedIsGivenBack(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.failN = 1 // amount 0 fails its first attempt
	cmds := []*message.Message{e.command("ok-1", 10), e.command("flaky", 0), e.command("ok-2", 10)}
	batchWorld(t, e, 4, cmds...)
	assert.Empty(t, e.deadLetters())
	assert.Equal(t, 2, e.attemptsOf("flaky"), "failed once, then ran")
	assert.Equal(t, 3, e.count(`SELECT count(*) FROM `+e.ledger))
	assert.Zero(t, e.count(`SELECT count(*) FROM idempotency_keys WHERE scope = $1 AND status = 'pending'`, e.step.Name()))
}

// Copies of one command in one batch whose first attempt fails: the claim
// is free for the next copy, which runs in the same batch; the others are
// answered from the store. One effect, a reply for each copy that was
// not dead-lettered.
func TestACopyTakesTheClaimAFailedAttemptLeft(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.failN = 1
	cmd := e.command("flaky", 0)
	other := e.command("other", 10)
	batchWorld(t, e, 1, cmd, other, cmd, cmd)
	dead := e.deadLetters()
	require.Len(t, dead, 1, "the first copy's one attempt failed")
	assert.Equal(t, cmd.UUID, dead[0].UUID)
	assert.Equal(t, 2, e.attemptsOf("flaky"), "the second copy ran it")
	assert.Equal(t, 1, e.count(`SELECT count(*) FROM `+e.ledger+` WHERE account = 'flaky'`))
	replies := 0
	for _, r := range e.messages(e.replies) {
		if r.Metadata[steps.MetaKey] == "key-flaky" {
			replies++
		}
	}
	assert.Equal(t, 2, replies, "the copies that were not dead-lettered are answered")
}

func (e *env) attemptsOf(account string) int {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.attempts[account]
}

// A key claimed for one command is not another's: a command reusing a
// key with a different payload, later in the batch, is refused as it is
// without a batch claim.
func TestABatchClaimIsForItsCommandOnly(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	first := e.command("acct", 10)
	reused := e.command("acct", 99) // same key, another command
	batchWorld(t, e, 1, first, reused)
	dead := e.deadLetters()
	require.Len(t, dead, 1)
	assert.Equal(t, reused.UUID, dead[0].UUID)
	assert.Contains(t, dead[0].Metadata["dead_letter_reason"], idempotency.ErrKeyReused.Error())
	assert.Equal(t, 1, e.count(`SELECT count(*) FROM `+e.ledger))
}

// The batch's claim belongs to its transaction, whatever came before it: a
// first message no handler was called for (a middleware refused it: its
// failure is recorded, with the next attempt's savepoint opened ahead), then
// a message whose attempt fails, and the claims of the others still hold:
// each of them runs once, in that batch, and every key is stored.
func TestTheBatchClaimOutlivesAFailedAttempt(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.failN = 1
	refused := e.command("refused", 10)
	cmds := []*message.Message{refused, e.command("flaky", 0), e.command("ok-1", 10), e.command("ok-2", 10)}
	var refusals atomic.Int32
	refuse := func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			if msg.UUID == refused.UUID && refusals.Add(1) == 1 {
				return nil, assert.AnError // the handler is not called, once
			}
			return h(msg)
		}
	}
	batchWorldWith(t, e, 4, []message.HandlerMiddleware{refuse}, cmds...)
	assert.Empty(t, e.deadLetters())
	assert.Equal(t, 1, e.attemptsOf("ok-1"), "ran once: its batch was not abandoned")
	assert.Equal(t, 1, e.attemptsOf("ok-2"))
	assert.Equal(t, 4, e.count(`SELECT count(*) FROM `+e.ledger))
	assert.Equal(t, 4, e.count(`SELECT count(*) FROM idempotency_keys WHERE scope = $1 AND status = 'completed'`, e.step.Name()), "every key stored")
}

// A middleware that changes a message after its batch claimed its key:
// the attempt's request hash is what is stored, as without a batch claim,
// and a copy delivered later is answered from it.
func TestAClaimTakesTheAttemptsHash(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	cmds := []*message.Message{e.command("a", 10), e.command("b", 10)}
	upcast := func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			msg.Payload = []byte(strings.Replace(string(msg.Payload), `"amount":10`, `"amount":11`, 1))
			return h(msg)
		}
	}
	batchWorldWith(t, e, 1, []message.HandlerMiddleware{upcast}, cmds...)
	assert.Empty(t, e.deadLetters(), "not taken for a key reused")
	assert.Equal(t, 22, e.count(`SELECT sum(amount)::int FROM `+e.ledger), "the middleware's payloads ran")
	// A copy of a, as the middleware makes it, is answered from the store.
	copyOfA := e.command("a", 11)
	replies := len(e.messages(e.replies))
	e.deliverOnce(copyOfA)
	assert.Empty(t, e.deadLetters())
	assert.Len(t, e.messages(e.replies), replies+1)
	assert.Equal(t, 2, e.count(`SELECT count(*) FROM `+e.ledger), "no second effect")
}

// deliverOnce runs e's step for msg in a transaction of its own.
func (e *env) deliverOnce(msg *message.Message) {
	e.t.Helper()
	if err := e.rt.Execute(context.Background(), e.step, msg); err != nil && !errors.Is(err, transport.ErrDeadLettered) {
		require.NoError(e.t, err)
	}
}
