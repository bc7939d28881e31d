package saga_test

import (
	"context"
	"errors"
	"testing"

	"github.com/google/uuid"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/internal/transport"
	"github.com/pgsaga/pgsaga/saga"
	"github.com/pgsaga/pgsaga/steps"
)

// reply is a reply of pay to saga id's command in flight, with the token
// given, applied by the engine in a transaction of the test's, which
// commits if the engine took it.
func (e *env) reply(id uuid.UUID, token string, outcome, refusal string) error {
	e.t.Helper()
	key, _ := e.sent(id, "pay")
	msg, err := steps.NewMessage(tripReply{Op: "pay"}, steps.Envelope{SagaID: id.String(), Step: "pay", Key: key,
		Outcome: outcome, Reason: "pay said so", Refusal: refusal, ReplyToken: token})
	require.NoError(e.t, err)
	ctx := context.Background()
	tx, err := e.db.SQL.BeginTx(ctx, nil)
	require.NoError(e.t, err)
	defer tx.Rollback() //nolint:errcheck // no-op after Commit
	msg.SetContext(transport.ContextWithTx(ctx, tx))
	if err := e.engine.HandleReply(msg); err != nil {
		return err
	}
	require.NoError(e.t, tx.Commit())
	return nil
}

// A reply to the command in flight is taken only with the command's reply
// token: anyone who can publish on the reply topic (a plain broker
// client, PublishTx in the database) but could not read the command
// cannot complete a step that never ran. A forged reply is refused
// permanently (dead-lettered) and changes nothing; the true one then goes
// through.
func TestAForgedReplyChangesNothing(t *testing.T) {
	t.Parallel()
	e := newEnv(t, options{silent: []string{"pay"}})
	id := e.start("faro")
	before := e.wait(id, "pay in flight", func(i saga.Instance) bool { return i.Step == "pay" && i.Attempt == 1 })
	_, token := e.sent(id, "pay")
	require.Len(t, token, 32, "the command carries a token")

	for name, forged := range map[string]string{"no token": "", "a wrong token": "0123456789abcdef0123456789abcdef",
		"the token of another step": tokenOf(t, e, id, "book")} {
		err := e.reply(id, forged, steps.OutcomeOK, "")
		require.ErrorIs(t, err, saga.ErrForgedReply, name)
		assert.True(t, transport.IsPermanent(err), "%s: dead-lettered, never retried", name)
		after, gerr := e.engine.Get(context.Background(), id)
		require.NoError(t, gerr)
		assert.Equal(t, before.Version, after.Version, "%s: the instance did not move", name)
	}
	require.NoError(t, e.reply(id, token, steps.OutcomeOK, ""))
	assert.Equal(t, saga.StatusCompleted, e.terminal(id).Status)
}

func tokenOf(t *testing.T, e *env, id uuid.UUID, op string) string {
	t.Helper()
	_, token := e.sent(id, op)
	require.NotEmpty(t, token)
	return token
}

// An instance started by an earlier release has no reply secret: its
// commands carry no token and its replies are taken without one, so an
// upgrade does not strand the sagas in flight.
func TestAnInstanceOfAnEarlierReleaseTakesRepliesWithoutAToken(t *testing.T) {
	t.Parallel()
	e := newEnv(t, options{silent: []string{"pay"}})
	id := e.start("ulm")
	e.wait(id, "pay in flight", func(i saga.Instance) bool { return i.Step == "pay" && i.Attempt == 1 })
	_, err := e.db.SQL.Exec(`UPDATE saga_instances SET reply_secret = NULL WHERE id = $1`, id)
	require.NoError(t, err)
	require.NoError(t, e.reply(id, "", steps.OutcomeOK, ""))
	assert.Equal(t, saga.StatusCompleted, e.terminal(id).Status)
}

// A participant that refuses an action past its not-after did not run it
// then, but an earlier run may have acted on its own before it died: the
// saga compensates that step too, as when the engine gives up on it. A
// business failure is compensated from the step before.
func TestAnExpiredCommandIsCompensatedToo(t *testing.T) {
	t.Parallel()
	for name, c := range map[string]struct {
		refusal string
		refunds int
	}{"refused as expired": {steps.RefusalExpired, 1}, "a business failure": {"", 0}} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t, options{silent: []string{"pay"}})
			id := e.start("bonn")
			e.wait(id, "pay in flight", func(i saga.Instance) bool { return i.Step == "pay" && i.Attempt == 1 })
			require.NoError(t, e.reply(id, tokenOf(t, e, id, "pay"), steps.OutcomeFailed, c.refusal))
			inst := e.terminal(id)
			assert.Equal(t, saga.StatusCompensated, inst.Status)
			assert.Equal(t, "pay: pay said so", inst.FailureReason)
			assert.Equal(t, c.refunds, e.callsOf("refund"))
			assert.Equal(t, 1, e.callsOf("cancel"))
		})
	}
}

// A reply for an instance of a definition version this process does not
// know (another release's, during a rolling deploy) is handed back
// untouched, for a process of the group that knows it: it used to be
// dead-lettered, and the saga given up on although its step had run.
func TestAReplyOfAnUnknownVersionIsHandedBack(t *testing.T) {
	t.Parallel()
	e := newEnv(t, options{silent: []string{"pay"}})
	id := e.start("graz")
	e.wait(id, "pay in flight", func(i saga.Instance) bool { return i.Step == "pay" && i.Attempt == 1 })
	_, err := e.db.SQL.Exec(`UPDATE saga_instances SET definition_version = 2 WHERE id = $1`, id)
	require.NoError(t, err)
	err = e.reply(id, tokenOf(t, e, id, "pay"), steps.OutcomeOK, "")
	require.Error(t, err)
	assert.True(t, transport.IsHandBack(err), "handed back: %v", err)
	assert.False(t, transport.IsPermanent(err), "never dead-lettered")
	assert.True(t, errors.Is(err, saga.ErrUnknownDefinition))
}
