package steps_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/idempotency"
	"github.com/pgsaga/pgsaga/steps"
)

// booking is what the outside service answers.
type booking struct {
	ID       string `json:"id"`
	Declined bool   `json:"declined"`
}

// hotel is an outside service that books once per key, as an idempotent
// API does, and counts the calls it got.
type hotel struct {
	mu    sync.Mutex
	calls []string // the key of each call
	fail  int      // the first fail calls end with an unknown outcome
}

func (h *hotel) book(ctx context.Context, key string) (booking, error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.calls = append(h.calls, key)
	if len(h.calls) <= h.fail {
		return booking{}, fmt.Errorf("hotel: 503 (call %d)", len(h.calls))
	}
	return booking{ID: fmt.Sprintf("b-%d", len(h.calls))}, nil
}

func (h *hotel) keys() []string {
	h.mu.Lock()
	defer h.mu.Unlock()
	return append([]string(nil), h.calls...)
}

// callStep is a step that books through Call and replies with the
// booking.
func (e *env) callStep(h *hotel) {
	e.step = steps.Define("book-"+e.id, e.cmds, func(ctx context.Context, tx *steps.Tx, cmd addCmd) (steps.Message, error) {
		b, err := steps.Call(ctx, tx, h.book)
		if err != nil {
			return nil, err
		}
		if b.Declined {
			return nil, steps.Fail(refused{Why: "declined"}, "declined")
		}
		return added{Account: b.ID, Total: cmd.Amount}, nil
	})
	require.NoError(e.t, e.tr.Subscribe(context.Background(), e.rt.Subscriptions(e.step)...))
}

// Ten deliveries of a command: one call, with the command's key, and ten
// replies, each with the call's answer, read from its record.
func TestCallCallsOnceAndAnswersEveryDelivery(t *testing.T) {
	t.Parallel()
	for _, m := range modes {
		t.Run(m.name, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t)
			h := &hotel{}
			e.callStep(h)
			m.deliver(e, e.command("ada", 3), 10)

			assert.Equal(t, []string{"key-ada"}, h.keys(), "one call, with the command's key")
			replies := e.messages(e.replies)
			require.Len(t, replies, 10)
			for _, r := range replies {
				assert.JSONEq(t, `{"account":"b-1","total":3}`, r.Payload)
			}
			assert.Equal(t, 1, e.count(`SELECT count(*) FROM idempotency_keys WHERE scope = $1 AND key = 'key-ada' AND status = 'completed'
				AND convert_from(response, 'UTF8')::jsonb = '{"id":"b-1","declined":false}'`, "steps.call:book-"+e.id), "the answer is recorded")
		})
	}
}

// A call whose outcome is unknown records nothing and frees its key: the
// command's retry calls again, with the same key, at once (not after the
// lease: the delivery would not finish in time), and answers from that.
func TestCallAnUnknownOutcomeCallsAgainWithTheSameKey(t *testing.T) {
	t.Parallel()
	for _, m := range modes {
		t.Run(m.name, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t)
			h := &hotel{fail: 2}
			e.callStep(h)
			m.deliver(e, e.command("bob", 5), 1)

			assert.Equal(t, []string{"key-bob", "key-bob", "key-bob"}, h.keys())
			replies := e.messages(e.replies)
			require.Len(t, replies, 1)
			assert.JSONEq(t, `{"account":"b-3","total":5}`, replies[0].Payload)
		})
	}
}

// A worker that died mid-call left its lease: the next delivery waits it
// out, takes the key over and calls once more, with the same key.
func TestCallTakesTheKeyOverFromAWorkerThatDied(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	h := &hotel{}
	e.callStep(h)
	store, err := idempotency.NewStore(idempotency.Config{DB: e.db.SQL})
	require.NoError(t, err)
	msg := e.command("cyd", 7)
	dead, err := store.AcquireFor(context.Background(), idempotency.Request{
		Scope: "steps.call:book-" + e.id, Key: "key-cyd", Hash: idempotency.Fingerprint(msg.Payload),
	}, 300*time.Millisecond)
	require.NoError(t, err)
	require.NotNil(t, dead.Lease, "the dead worker's lease")

	modes[1].deliver(e, msg, 1)

	assert.Equal(t, []string{"key-cyd"}, h.keys(), "called once, after the lease, with the same key")
	var attempt int
	require.NoError(t, e.db.SQL.QueryRow(`SELECT attempts FROM idempotency_keys WHERE scope = $1 AND key = 'key-cyd'`, "steps.call:book-"+e.id).Scan(&attempt))
	assert.Equal(t, 2, attempt, "taken over")
	replies := e.messages(e.replies)
	require.Len(t, replies, 1)
	assert.JSONEq(t, `{"account":"b-1","total":7}`, replies[0].Payload)
}

// A decline is an answer: recorded, and every delivery is refused from it
// without calling again.
func TestCallADeclineIsAnsweredFromItsRecord(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	calls := 0
	e.step = steps.Define("decline-"+e.id, e.cmds, func(ctx context.Context, tx *steps.Tx, cmd addCmd) (steps.Message, error) {
		b, err := steps.Call(ctx, tx, func(ctx context.Context, key string) (booking, error) {
			calls++
			return booking{Declined: true}, nil
		})
		if err != nil {
			return nil, err
		}
		if b.Declined {
			return nil, steps.Fail(refused{Why: "declined"}, "declined")
		}
		return added{}, nil
	})
	require.NoError(t, e.tr.Subscribe(context.Background(), e.rt.Subscriptions(e.step)...))
	modes[1].deliver(e, e.command("dee", 1), 3)
	assert.Equal(t, 1, calls)
	replies := e.messages(e.replies)
	require.Len(t, replies, 3)
	for _, r := range replies {
		assert.Equal(t, steps.OutcomeFailed, r.Metadata[steps.MetaOutcome])
	}
}

// A call that fails for good (Permanent) dead-letters its command at
// once, and leaves nothing recorded.
func TestCallAPermanentFailureDeadLetters(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	calls := 0
	e.step = steps.Define("bad-"+e.id, e.cmds, func(ctx context.Context, tx *steps.Tx, cmd addCmd) (steps.Message, error) {
		_, err := steps.Call(ctx, tx, func(ctx context.Context, key string) (booking, error) {
			calls++
			return booking{}, steps.Permanent(errors.New("hotel: 400 no such room"))
		})
		return nil, err
	})
	require.NoError(t, e.tr.Subscribe(context.Background(), e.rt.Subscriptions(e.step)...))
	modes[1].deliver(e, e.command("eve", 1), 1)
	assert.Equal(t, 1, calls)
	assert.Len(t, e.deadLetters(), 1)
	assert.Equal(t, 0, e.count(`SELECT count(*) FROM idempotency_keys WHERE scope = $1 AND status = 'completed'`, "steps.call:bad-"+e.id))
}
