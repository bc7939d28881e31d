package steps_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/steps"
)

// dbNow is the database server's clock.
func (e *env) dbNow() time.Time {
	e.t.Helper()
	var now time.Time
	require.NoError(e.t, e.db.SQL.QueryRow(`SELECT clock_timestamp()`).Scan(&now))
	return now
}

// commandUntil is command(account, amount) carrying a not-after and a
// reply token.
func (e *env) commandUntil(account string, amount int, notAfter time.Time) *message.Message {
	e.t.Helper()
	msg, err := steps.NewMessage(addCmd{Account: account, Amount: amount}, steps.Envelope{
		Key: "key-" + account, ReplyTo: e.replies, CorrelationID: "corr-" + account, SagaID: "saga-" + account, Step: "add",
		NotAfter: notAfter, ReplyToken: "token-" + account,
	})
	require.NoError(e.t, err)
	return msg
}

// A command that arrives past its not-after (on the database's clock) is
// refused, never run: its key is stored failed with the refusal, which is
// answered (outcome failed, refusal expired, the command's reply token),
// and every later copy gets the same answer from the store. That is what
// lets a saga give up on a command only once its not-after has passed: a
// participant back from an outage does not run what was given up on.
func TestACommandPastItsNotAfterIsRefusedUnrun(t *testing.T) {
	t.Parallel()
	for _, m := range modes {
		t.Run(m.name, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t)
			m.deliver(e, e.commandUntil("late", 10, e.dbNow().Add(-time.Second)), 2)

			assert.Zero(t, e.attempts["late"], "the handler never ran")
			assert.Zero(t, e.count(`SELECT count(*) FROM `+e.ledger))
			assert.Equal(t, "failed", e.keyStatus("key-late"))
			replies := e.messages(e.replies)
			require.Len(t, replies, 2, "each copy is answered")
			for _, r := range replies {
				assert.Equal(t, replies[0].UUID, r.UUID, "the copy's answer is the stored one")
				assert.Equal(t, steps.OutcomeFailed, r.Metadata[steps.MetaOutcome])
				assert.Equal(t, steps.RefusalExpired, r.Metadata[steps.MetaRefusal])
				assert.Contains(t, r.Metadata[steps.MetaReason], "past its not-after")
				assert.Equal(t, "token-late", r.Metadata[steps.MetaReplyToken], "the reply carries the command's token back")
			}
		})
	}
}

// Before its not-after a command runs, and its reply carries the
// command's reply token back, the replayed copy's too.
func TestACommandBeforeItsNotAfterRuns(t *testing.T) {
	t.Parallel()
	for _, m := range modes {
		t.Run(m.name, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t)
			m.deliver(e, e.commandUntil("early", 10, e.dbNow().Add(time.Hour)), 2)

			assert.Equal(t, 1, e.attempts["early"])
			assert.Equal(t, "completed", e.keyStatus("key-early"))
			replies := e.messages(e.replies)
			require.Len(t, replies, 2)
			for _, r := range replies {
				assert.Equal(t, steps.OutcomeOK, r.Metadata[steps.MetaOutcome])
				assert.Empty(t, r.Metadata[steps.MetaRefusal])
				assert.Equal(t, "token-early", r.Metadata[steps.MetaReplyToken])
			}
		})
	}
}

// A not-after that cannot be read is refused permanently (dead-lettered,
// the handler never run) and its text is never echoed.
func TestAnUnreadableNotAfterIsDeadLettered(t *testing.T) {
	t.Parallel()
	for _, m := range modes {
		t.Run(m.name, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t)
			msg := e.command("garbled", 10)
			msg.Metadata.Set(steps.MetaNotAfter, "<script>tomorrow</script>")
			m.deliver(e, msg, 1)

			assert.Zero(t, e.attempts["garbled"])
			dead := e.deadLetters()
			require.Len(t, dead, 1)
			var reason string
			require.NoError(t, e.db.SQL.QueryRow(`SELECT reason FROM pgsaga_dead_letters WHERE uuid = $1`, dead[0].UUID).Scan(&reason))
			assert.Contains(t, reason, steps.ErrBadNotAfter.Error())
			assert.NotContains(t, reason, "script")
		})
	}
}

// The run after an awaited call is not refused when the not-after passed
// during the call: the handler has acted (a charge at a gateway, say),
// and refusing would leave what it did unanswered and uncompensated.
func TestTheRunAfterAnAwaitedCallIsNotRefused(t *testing.T) {
	t.Parallel()
	for _, m := range modes {
		t.Run(m.name, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t)
			notAfter := e.dbNow().Add(300 * time.Millisecond)
			calls, runs := 0, 0
			e.step = steps.Define("awaits-"+e.id, e.cmds, func(ctx context.Context, tx *steps.Tx, cmd addCmd) (steps.Message, error) {
				runs++
				if steps.Awaited(ctx) {
					return added{Account: cmd.Account, Total: calls}, nil
				}
				return nil, steps.Await(time.Minute, func(ctx context.Context) error {
					calls++
					// The call outlives the command's not-after.
					for e.dbNow().Before(notAfter.Add(50 * time.Millisecond)) {
						select {
						case <-ctx.Done():
							return ctx.Err()
						case <-time.After(20 * time.Millisecond):
						}
					}
					return nil
				})
			})
			require.NoError(t, e.tr.Subscribe(context.Background(), e.rt.Subscriptions(e.step)...))
			m.deliver(e, e.commandUntil("slow", 10, notAfter), 1)

			assert.Equal(t, 1, calls)
			assert.Equal(t, 2, runs, "the handler ran again after its call")
			replies := e.messages(e.replies)
			require.Len(t, replies, 1)
			assert.Equal(t, steps.OutcomeOK, replies[0].Metadata[steps.MetaOutcome], "answered from what it did, not refused")
		})
	}
}

type out struct{}

func (*out) MessageType() string { return "test.Out" }

// A handler that returns a nil pointer as its reply made a mistake: the
// command is dead-lettered with ErrNilReply, nothing of its attempt kept
// (it used to panic inside pgsaga).
func TestANilPointerReplyIsDeadLettered(t *testing.T) {
	t.Parallel()
	for _, m := range modes {
		t.Run(m.name, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t)
			e.step = steps.Define("nil-"+e.id, e.cmds, func(ctx context.Context, tx *steps.Tx, cmd addCmd) (steps.Message, error) {
				if _, err := tx.ExecContext(ctx, `INSERT INTO `+e.ledger+` VALUES ($1, $2)`, cmd.Account, cmd.Amount); err != nil {
					return nil, err
				}
				var reply *out
				return reply, nil
			})
			require.NoError(t, e.tr.Subscribe(context.Background(), e.rt.Subscriptions(e.step)...))
			m.deliver(e, e.command("nil", 10), 1)

			require.Len(t, e.deadLetters(), 1)
			var reason string
			require.NoError(t, e.db.SQL.QueryRow(`SELECT reason FROM pgsaga_dead_letters WHERE topic = $1`, e.cmds).Scan(&reason))
			assert.Contains(t, reason, steps.ErrNilReply.Error())
			assert.Zero(t, e.count(`SELECT count(*) FROM `+e.ledger), "nothing of the attempt was kept")
			assert.Empty(t, e.messages(e.replies))
			assert.True(t, errors.Is(steps.Permanent(steps.ErrNilReply), steps.ErrNilReply))
		})
	}
}
