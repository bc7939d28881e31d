package saga_test

import (
	"context"
	"database/sql"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/saga"
	"github.com/pgsaga/pgsaga/saga/delivery"
	"github.com/pgsaga/pgsaga/steps"
)

// Define refuses a step's name that would make a command key PostgreSQL
// or a broker cannot carry (it used to be accepted, and every command of
// the step was dead-lettered at run time), without echoing the name.
func TestDefineRefusesStepNamesAKeyCannotCarry(t *testing.T) {
	t.Parallel()
	step := steps.Define[tripCmd]("s", "s", nil)
	for name, bad := range map[string]string{
		"too long":        strings.Repeat("x", saga.MaxStepName+1),
		"a NUL":           "pay\x00",
		"a line break":    "pay\nnow",
		"not UTF-8":       "pay\xff",
		"a control (DEL)": "pay\x7f",
	} {
		_, err := saga.Define(saga.Spec[tripData]{Name: "hostile", Trigger: saga.On("t", func(s started) (string, tripData, error) { return s.Trip, tripData{}, nil }),
			Steps: []saga.Step[tripData]{{Name: bad, Action: saga.Send(step, func(tripData) tripCmd { return tripCmd{} })}}})
		require.ErrorIs(t, err, saga.ErrInvalidName, name)
		assert.NotContains(t, err.Error(), bad, "%s: not echoed", name)
	}
	_, err := saga.Define(saga.Spec[tripData]{Name: "fine", Trigger: saga.On("t", func(s started) (string, tripData, error) { return s.Trip, tripData{}, nil }),
		Steps: []saga.Step[tripData]{{Name: strings.Repeat("é", saga.MaxStepName/2), Action: saga.Send(step, func(tripData) tripCmd { return tripCmd{} })}}})
	assert.NoError(t, err, "a long name within the bound, in UTF-8")
}

// A trigger's key must be UTF-8 without NUL: on its way through JSON and
// PostgreSQL invalid bytes become U+FFFD, and two keys that differ only
// there used to start one saga. StartTx refuses it, writing nothing.
func TestATriggersKeyMustBeUTF8(t *testing.T) {
	t.Parallel()
	c, def, db := newSignupClient(t)
	require.NoError(t, c.Setup(context.Background()))
	ctx := context.Background()
	for _, key := range []string{"a\xff@example.com", "a\xfe@example.com", "nul\x00@example.com"} {
		tx, err := db.SQL.BeginTx(ctx, nil)
		require.NoError(t, err)
		_, err = c.StartTx(ctx, tx, def.Name, trigger(key))
		require.ErrorIs(t, err, saga.ErrInvalidName)
		require.NoError(t, tx.Rollback())
	}
	var n int
	require.NoError(t, db.SQL.QueryRow(`SELECT count(*) FROM pgsaga_queue`).Scan(&n))
	assert.Zero(t, n)
}

// StartTx writes a saga and its trigger in the caller's transaction: given
// none, or a *sql.DB or *sql.Conn (every statement its own transaction), it
// refuses instead of writing what would not roll back with the caller's
// work. PublishTx writes in one statement, so a *sql.DB is fine for it; a
// nil tx or message is refused by both, not a panic.
func TestStartTxAndPublishTxNeedATransaction(t *testing.T) {
	t.Parallel()
	c, def, db := newSignupClient(t)
	ctx := context.Background()
	conn, err := db.SQL.Conn(ctx)
	require.NoError(t, err)
	defer conn.Close()
	var nilTx *sql.Tx
	for name, tx := range map[string]delivery.DBTX{"a *sql.DB": db.SQL, "a *sql.Conn": conn, "nil": nil, "a nil *sql.Tx": nilTx} {
		_, err := c.StartTx(ctx, tx, def.Name, trigger("x@example.com"))
		assert.ErrorIs(t, err, saga.ErrNotATransaction, "StartTx, %s", name)
		if isNil := name == "nil" || name == "a nil *sql.Tx"; isNil {
			assert.ErrorIs(t, c.PublishTx(ctx, tx, "signups", message.NewMessage(uuid.NewString(), nil)), saga.ErrNotATransaction, "PublishTx, %s", name)
		} else {
			assert.NoError(t, c.PublishTx(ctx, tx, "signups", message.NewMessage(uuid.NewString(), nil)), "PublishTx, %s", name)
		}
	}
	tx, err := db.SQL.BeginTx(ctx, nil)
	require.NoError(t, err)
	defer tx.Rollback() //nolint:errcheck
	assert.ErrorIs(t, c.PublishTx(ctx, tx, "signups", message.NewMessage(uuid.NewString(), nil), nil), saga.ErrNilMessage)
}

// Two sagas on one trigger topic: a trigger StartTx publishes starts the
// saga it names only (it used to start both); one published there by
// anyone else starts both, as a message on a topic reaches every group.
func TestStartTxStartsOnlyTheSagaItNames(t *testing.T) {
	t.Parallel()
	c, def, db := newSignupClient(t)
	open := steps.Define("accounts.welcome", "accounts.welcome", func(ctx context.Context, tx *steps.Tx, cmd OpenAccount) (steps.Message, error) {
		return nil, nil
	})
	other := saga.MustDefine(saga.Spec[signup]{
		Name:    "welcome",
		Trigger: saga.On(def.Trigger, func(s SignedUp) (string, signup, error) { return s.Email, signup(s), nil }),
		Steps:   []saga.Step[signup]{{Name: "welcome", Action: saga.Send(open, func(s signup) OpenAccount { return OpenAccount(s) })}},
	})
	require.NoError(t, c.Register(other))
	require.NoError(t, c.AddSteps(open))
	startRunning(t, c)
	signUp(t, c, def, "only-signup@example.com", true)
	waitFinished(t, c, def, "only-signup@example.com")

	ctx := context.Background()
	msg, err := steps.NewMessage(trigger("both@example.com"), steps.Envelope{})
	require.NoError(t, err)
	tx, err := db.SQL.BeginTx(ctx, nil)
	require.NoError(t, err)
	require.NoError(t, c.PublishTx(ctx, tx, def.Trigger, msg))
	require.NoError(t, tx.Commit())
	waitFinished(t, c, def, "both@example.com")
	waitFinished(t, c, other, "both@example.com")
	// Both groups have taken their copies of every trigger by now.
	var left int
	require.NoError(t, db.SQL.QueryRow(`SELECT count(*) FROM pgsaga_queue WHERE topic = $1`, def.Trigger).Scan(&left))
	require.Zero(t, left)
	_, err = c.Get(ctx, saga.ID(other.Name, "only-signup@example.com"))
	assert.ErrorIs(t, err, saga.ErrNoSuchSaga, "the trigger StartTx published for signup did not start welcome")
}

// A finished-channel name PostgreSQL would refuse (or quote differently)
// is refused by NewClient, like the transport's wake-up channel.
func TestClientRefusesABadFinishedChannel(t *testing.T) {
	t.Parallel()
	for _, name := range []string{"has space", "semi;colon", strings.Repeat("x", 64), "naïve"} {
		_, err := saga.NewClientFromDB(&sql.DB{}, saga.ClientConfig{FinishedChannel: name})
		assert.ErrorContains(t, err, "FinishedChannel", name)
	}
}

// A retry of a saga whose command has not left this database (its
// participant is down) sends no copy: it would only queue behind the
// first (every retry of an outage used to add one). Its attempts start
// over from that send. Once the command has left, a retry sends it again.
func TestRetryDoesNotResendACommandThatHasNotLeft(t *testing.T) {
	t.Parallel()
	e := newEnv(t, options{absent: []string{"pay"}})
	id := e.start("oslo")
	e.wait(id, "pay in flight", func(i saga.Instance) bool { return i.Step == "pay" && i.Attempt == 1 })
	queued := func() int {
		var n int
		require.NoError(t, e.db.SQL.QueryRow(`SELECT count(*) FROM `+archived(e.topics["pay"])+` WHERE metadata->>'saga_id' = $1`, id.String()).Scan(&n))
		return n
	}
	ctx := context.Background()
	require.NoError(t, e.engine.Retry(ctx, id))
	require.NoError(t, e.engine.Retry(ctx, id))
	assert.Equal(t, 1, queued(), "no copy queued behind the waiting command")
	inst, err := e.engine.Get(ctx, id)
	require.NoError(t, err)
	assert.Equal(t, 1, inst.Attempt)
	last := inst.History[len(inst.History)-1]
	assert.Equal(t, "retried", last.Kind)
	assert.Contains(t, last.Detail, "not sent again")

	s := newEnv(t, options{silent: []string{"pay"}})
	id = s.start("oslo")
	s.wait(id, "pay taken", func(i saga.Instance) bool { return i.Step == "pay" && s.callsOf("pay") == 1 })
	// Taken is not left: the participant's transaction commits after its
	// handler returns.
	require.Eventually(t, func() bool {
		var n int
		require.NoError(t, s.db.SQL.QueryRow(`SELECT count(*) FROM pgsaga_queue WHERE topic = $1 AND consumer_group <> 'archive' AND metadata->>'saga_id' = $2`, s.topics["pay"], id.String()).Scan(&n))
		return n == 0
	}, 30*time.Second, 10*time.Millisecond, "the pay command left the queue")
	require.NoError(t, s.engine.Retry(ctx, id))
	inst, err = s.engine.Get(ctx, id)
	require.NoError(t, err)
	h := inst.History[len(inst.History)-2:]
	assert.Equal(t, []string{"retried", "sent"}, []string{h[0].Kind, h[1].Kind}, "it left: sent again")
	var copies int
	require.NoError(t, s.db.SQL.QueryRow(`SELECT count(*) FROM `+archived(s.topics["pay"])+` WHERE metadata->>'saga_id' = $1`, id.String()).Scan(&copies))
	assert.Equal(t, 2, copies)
}

// A selection fixed by FixFilter is the same sagas however long the
// paging through it takes: its age is a cutoff on the database's clock,
// so a saga started (or moved on) afterwards is not in it. (A bulk cancel
// paging through "running, older than 1s" used to take in sagas started
// after its confirmation.)
func TestAFixedSelectionTakesInNoLaterSaga(t *testing.T) {
	t.Parallel()
	e := newEnv(t, options{silent: []string{"pay"}})
	early := e.start("early")
	e.wait(early, "pay in flight", func(i saga.Instance) bool { return i.Step == "pay" })
	ctx := context.Background()
	_, err := e.db.SQL.Exec(`UPDATE saga_instances SET updated_at = clock_timestamp() - interval '1 hour' WHERE id = $1`, early)
	require.NoError(t, err)
	c, err := saga.NewClientFromDB(e.db.SQL, saga.ClientConfig{Logger: logger()})
	require.NoError(t, err)
	f, err := c.FixFilter(ctx, saga.Filter{Type: e.def.Name, Statuses: []saga.Status{saga.StatusRunning}, OlderThan: time.Minute})
	require.NoError(t, err)
	assert.Zero(t, f.OlderThan)
	assert.False(t, f.UpdatedBefore.IsZero())

	late := e.start("late")
	e.wait(late, "pay in flight", func(i saga.Instance) bool { return i.Step == "pay" })
	_, err = e.db.SQL.Exec(`UPDATE saga_instances SET updated_at = $2::timestamptz + interval '1 second' WHERE id = $1`, late, f.UpdatedBefore)
	require.NoError(t, err) // started after the selection was fixed, older than a minute by the time it is paged through
	ids, err := c.SelectedIDs(ctx, f, uuid.Nil)
	require.NoError(t, err)
	assert.Equal(t, []uuid.UUID{early}, ids)
	n, err := c.CountSelected(ctx, saga.Filter{Type: e.def.Name, Statuses: []saga.Status{saga.StatusRunning}, OlderThan: time.Minute})
	require.NoError(t, err)
	assert.Equal(t, 1, n, "OlderThan is measured on the database's clock")
}

// Operators' requests carried out longer ago than the timelines are kept
// are pruned with them; one never carried out stays.
func TestPruneDeletesOldRequests(t *testing.T) {
	t.Parallel()
	e := newEnv(t, options{})
	old, pending := uuid.New(), uuid.New()
	_, err := e.db.SQL.Exec(`INSERT INTO saga_requests (id, saga_id, kind, done_at, outcome) VALUES
		($1, $3, 'retry', clock_timestamp() - interval '2 days', 'done'), ($2, $3, 'retry', NULL, NULL)`, old, pending, uuid.New())
	require.NoError(t, err)
	res, err := e.engine.Prune(context.Background(), saga.PruneConfig{History: 24 * time.Hour})
	require.NoError(t, err)
	assert.GreaterOrEqual(t, res.Requests, 1)
	var left []string
	rows, err := e.db.SQL.Query(`SELECT id FROM saga_requests WHERE id = ANY ($1::uuid[])`, []string{old.String(), pending.String()})
	require.NoError(t, err)
	defer rows.Close()
	for rows.Next() {
		var id string
		require.NoError(t, rows.Scan(&id))
		left = append(left, id)
	}
	assert.Equal(t, []string{pending.String()}, left)
}
