package saga_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/internal/transport"
	"github.com/pgsaga/pgsaga/saga"
	"github.com/pgsaga/pgsaga/steps"
)

// overdue makes the command in flight of saga id overdue now.
func (e *env) overdue(id uuid.UUID) {
	e.t.Helper()
	_, err := e.db.SQL.Exec(`UPDATE saga_instances SET deadline_at = clock_timestamp() - interval '1 second' WHERE id = $1`, id)
	require.NoError(e.t, err)
}

// sweep runs one sweep of the env's engine.
func (e *env) sweep() saga.SweepResult {
	e.t.Helper()
	res, err := e.engine.Sweep(context.Background())
	require.NoError(e.t, err)
	return res
}

// of lists the kinds of the timeline entries of step, with their phase.
func of(h []saga.HistoryEntry, step string) []string {
	var out []string
	for _, x := range h {
		if x.Step == step {
			out = append(out, x.Kind+"/"+string(x.Phase))
		}
	}
	return out
}

// A command still waiting in this database (no consumer has taken it: the
// participant is down) is not overdue: its deadline passing costs no
// attempt and sends no copy. Once it has left (taken by a participant
// that never answers), it gets a whole deadline again, then its attempts
// count as usual. It used to be re-sent, then given up on, while it only
// waited: an outage compensated sagas whose commands never left.
func TestACommandWaitingHereIsNotOverdue(t *testing.T) {
	t.Parallel()
	e := newEnv(t, options{deadline: time.Hour, maxAttempts: 2, absent: []string{"pay"}})
	ctx := context.Background()
	// The participant's group exists, and nobody runs it yet.
	group := "latecomer-" + e.id
	require.NoError(t, e.tr.Subscribe(ctx, transport.Subscription{Topic: e.topics["pay"], ConsumerGroup: group}))
	id := e.start("oslo")
	e.wait(id, "pay in flight", func(i saga.Instance) bool { return i.Step == "pay" && i.Attempt == 1 })

	for range 3 {
		e.overdue(id)
		res := e.sweep()
		assert.Equal(t, saga.SweepResult{Waiting: 1}, res)
	}
	inst, err := e.engine.Get(ctx, id)
	require.NoError(t, err)
	assert.Equal(t, saga.StatusRunning, inst.Status)
	assert.Equal(t, 1, inst.Attempt, "no attempt counted while it waited")
	require.NotNil(t, inst.DeadlineAt)
	assert.Greater(t, time.Until(*inst.DeadlineAt), 50*time.Minute, "looked at again a deadline later")
	assert.Equal(t, []string{"sent/action", "waiting/action"}, of(inst.History, "pay"), "told once, no copy sent")

	// The participant comes back, takes the command and never answers.
	r, err := e.tr.NewRouter()
	require.NoError(t, err)
	taken := make(chan struct{}, 10)
	require.NoError(t, r.AddHandler(group, e.topics["pay"], group, func(*message.Message) error {
		taken <- struct{}{}
		return nil
	}))
	require.NoError(t, r.Start(ctx))
	t.Cleanup(func() { _ = r.Stop() })
	<-taken
	e.waitConsumed(e.topics["pay"], group)

	e.overdue(id)
	assert.Equal(t, saga.SweepResult{Departed: 1}, e.sweep(), "it left: a whole deadline from now")
	inst, err = e.engine.Get(ctx, id)
	require.NoError(t, err)
	assert.Equal(t, 1, inst.Attempt)
	assert.Greater(t, time.Until(*inst.DeadlineAt), 50*time.Minute)

	e.overdue(id)
	assert.Equal(t, saga.SweepResult{Resent: 1}, e.sweep(), "no reply a deadline after it left: sent again")
	inst, err = e.engine.Get(ctx, id)
	require.NoError(t, err)
	assert.Greater(t, time.Until(*inst.DeadlineAt), 110*time.Minute, "a re-send waits twice as long")
	<-taken
	e.waitConsumed(e.topics["pay"], group)
	e.overdue(id)
	assert.Equal(t, saga.SweepResult{Awaiting: 1}, e.sweep(), "out of sends that left: no more copies")
	inst, err = e.engine.Get(ctx, id)
	require.NoError(t, err)
	assert.Equal(t, saga.StatusRunning, inst.Status, "its answer may still come, until its not-after")
	var giveUp time.Time
	require.NoError(t, e.db.SQL.QueryRow(`SELECT expires_at + interval '1 hour' FROM saga_instances WHERE id = $1`, id).Scan(&giveUp))
	assert.WithinDuration(t, giveUp, *inst.DeadlineAt, time.Millisecond, "looked at again a deadline after its not-after")

	// A deadline after its not-after, the engine gives up: the participant
	// refuses the command from then on.
	_, err = e.db.SQL.Exec(`UPDATE saga_instances SET expires_at = clock_timestamp() - interval '1 hour 1 second' WHERE id = $1`, id)
	require.NoError(t, err)
	e.overdue(id)
	assert.Equal(t, saga.SweepResult{TimedOut: 1}, e.sweep())
	inst = e.terminal(id)
	assert.Equal(t, saga.StatusCompensated, inst.Status)
	assert.Contains(t, inst.FailureReason, "pay: no answer by its not-after")
	assert.Equal(t, []string{"sent/action", "waiting/action", "deadline/action", "resent/action", "awaiting_reply/action",
		"timed_out/action", "sent/compensation"}, of(inst.History, "pay")[:7])
}

// What bounds a saga's whole wait is its own deadline (Spec.Timeout), its
// actions' not-after: a running saga a step's deadline past it gives up
// on the action in flight, waiting or not, and compensates, that step
// included. A command's deadline never runs past that.
func TestASagaPastItsTimeoutCompensates(t *testing.T) {
	t.Parallel()
	e := newEnv(t, options{deadline: 2 * time.Hour, timeout: time.Hour, absent: []string{"pay"}})
	id := e.start("lima")
	inst := e.wait(id, "pay in flight", func(i saga.Instance) bool { return i.Step == "pay" && i.Attempt == 1 })
	require.NotNil(t, inst.DeadlineAt)
	// Past its not-after but not yet a deadline past it: a command the
	// participant took just before may still be answered.
	_, err := e.db.SQL.Exec(`UPDATE saga_instances SET expires_at = clock_timestamp() - interval '1 hour' WHERE id = $1`, id)
	require.NoError(t, err)
	e.overdue(id)
	assert.Equal(t, saga.SweepResult{Waiting: 1}, e.sweep(), "a deadline after its not-after, not before")
	inst, err = e.engine.Get(context.Background(), id)
	require.NoError(t, err)
	assert.Less(t, time.Until(*inst.DeadlineAt), 61*time.Minute, "the command's deadline stops a deadline after the saga's")
	_, err = e.db.SQL.Exec(`UPDATE saga_instances SET expires_at = clock_timestamp() - interval '2 hours 1 second' WHERE id = $1`, id)
	require.NoError(t, err)
	e.overdue(id)
	assert.Equal(t, saga.SweepResult{TimedOut: 1}, e.sweep())
	inst = e.terminal(id)
	assert.Equal(t, saga.StatusCompensated, inst.Status)
	assert.Equal(t, "pay: no answer by its not-after, the saga's timeout (1h0m0s)", inst.FailureReason)
	assert.Equal(t, []string{"sent/action", "waiting/action", "timed_out/action", "sent/compensation"}, of(inst.History, "pay")[:4],
		"pay's action may yet happen: it is compensated too")
	assert.Equal(t, 1, e.callsOf("cancel"))
}

// insertBroken writes an instance of the env's saga that its definition
// cannot read: at step 5 of 2, overdue.
func (e *env) insertBroken(status string) uuid.UUID {
	e.t.Helper()
	id := uuid.New()
	_, err := e.db.SQL.Exec(`INSERT INTO saga_instances (id, saga_type, definition_version, status, data, current_step, phase, attempt, deadline_at)
		VALUES ($1, $2, 1, $3, '{"trip": "x"}', 5, 'action', 1, clock_timestamp() - interval '1 hour')`, id, e.def.Name, status)
	require.NoError(e.t, err)
	return id
}

// A saga row the definition cannot interpret (its step outside the
// definition, as after a definition lost a step without a new Version)
// crashes no worker: the sweeper parks it with the reason, and the other
// sagas complete. (It panicked the sweeper, index out of range, in every
// worker on the database at every restart.)
func TestAnInstanceItsDefinitionCannotReadIsParked(t *testing.T) {
	t.Parallel()
	e := newEnv(t, options{deadline: 200 * time.Millisecond})
	broken := e.insertBroken("running")
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() { _ = e.engine.RunSweeper(ctx) }()
	var good []uuid.UUID
	for _, trip := range []string{"bern", "graz", "linz"} {
		good = append(good, e.start(trip))
	}
	for _, id := range good {
		assert.Equal(t, saga.StatusCompleted, e.terminal(id).Status)
	}
	parked := e.terminal(broken)
	assert.Equal(t, saga.StatusFailed, parked.Status)
	assert.Equal(t, "its definition cannot read it: "+e.def.Name+" version 1 has 2 steps; the instance is at step 5", parked.FailureReason)
	assert.Equal(t, "#5", parked.Step)

	// An operator cannot retry or cancel it: refused, with why, never a
	// dead letter.
	err := e.engine.Retry(context.Background(), broken)
	assert.ErrorIs(t, err, saga.ErrNotRetryable)
	assert.ErrorIs(t, err, saga.ErrDefinitionMismatch)
}

// A reply for an instance its definition cannot read parks the instance
// and is consumed; an operator's request for one is refused with the
// reason (it was dead-lettered with a goroutine stack as its reason).
func TestRepliesAndRequestsForAnUnreadableInstance(t *testing.T) {
	t.Parallel()
	e := newEnv(t, options{deadline: time.Hour})
	broken := e.insertBroken("running")
	reply, err := steps.NewMessage(tripReply{Op: "pay"}, steps.Envelope{SagaID: broken.String(), Key: "whatever", Outcome: steps.OutcomeOK})
	require.NoError(t, err)
	require.NoError(t, e.tr.Publisher(e.db.SQL).Publish(e.def.ReplyTopic, reply))
	parked := e.terminal(broken)
	assert.Equal(t, saga.StatusFailed, parked.Status)
	assert.Contains(t, parked.FailureReason, "its definition cannot read it: ")
	e.waitConsumed(e.def.ReplyTopic, "saga."+e.def.Name+".replies")

	ctx := context.Background()
	other := e.insertBroken("running")
	for _, kind := range []saga.RequestKind{saga.RequestCancel, saga.RequestRetry} {
		req, err := saga.Ask(ctx, e.tr, e.db.SQL, other, kind, "test")
		require.NoError(t, err)
		deadline := time.Now().Add(30 * time.Second)
		for req.DoneAt == nil {
			require.True(t, time.Now().Before(deadline), "the %s was not carried out", kind)
			time.Sleep(10 * time.Millisecond)
			req, err = saga.RequestStatus(ctx, e.db.SQL, req.ID)
			require.NoError(t, err)
		}
		assert.Equal(t, saga.RequestRefused, req.Outcome, kind)
		assert.Contains(t, req.Detail, "version 1 has 2 steps; the instance is at step 5", kind)
	}
	var dead int
	require.NoError(t, e.db.SQL.QueryRow(`SELECT count(*) FROM pgsaga_dead_letters WHERE topic = $1`, saga.RequestTopic(e.def.Name)).Scan(&dead))
	assert.Zero(t, dead)
}

// insertDoomed writes an instance of the env's saga for the trip "doomed"
// at its pay action, overdue an hour.
func (e *env) insertDoomed() uuid.UUID {
	e.t.Helper()
	id := uuid.New()
	_, err := e.db.SQL.Exec(`INSERT INTO saga_instances (id, saga_type, definition_version, status, data, current_step, phase, attempt, deadline_at)
		VALUES ($1, $2, 1, 'running', '{"trip": "doomed"}', 1, 'action', 1, clock_timestamp() - interval '1 hour')`, id, e.def.Name)
	require.NoError(e.t, err)
	return id
}

// A decision that panics (a command's Build, say) is the failure of that
// one instance: parked with the panic's value, never the stack; the
// sweeper goes on with the others.
func TestAPanicDecidingOneInstanceParksItAlone(t *testing.T) {
	t.Parallel()
	e := newEnv(t, options{deadline: 200 * time.Millisecond, panicFor: "doomed", absent: []string{"pay"}})
	id := e.insertDoomed()
	others := e.start("rome")
	e.wait(others, "pay in flight", func(i saga.Instance) bool { return i.Step == "pay" })
	res := e.sweep()
	assert.Equal(t, 1, res.SetAside)
	parked := e.terminal(id)
	assert.Equal(t, saga.StatusFailed, parked.Status)
	assert.Equal(t, "deciding on the action of pay panicked: a bug in Build for doomed", parked.FailureReason)
}

// A definition whose steps change without a new Version is refused at
// start while instances of its version are unfinished: they would be
// misread. Once none is, the new steps are recorded.
func TestAChangedDefinitionIsRefusedAtStart(t *testing.T) {
	t.Parallel()
	e := newEnv(t, options{deadline: time.Hour, absent: []string{"pay"}})
	ctx := context.Background()
	require.NoError(t, e.engine.RecordDefinitions(ctx))
	id := e.start("kyiv")
	e.wait(id, "pay in flight", func(i saga.Instance) bool { return i.Step == "pay" })

	// The same name and version, one step fewer.
	shorter := saga.MustDefine(saga.Spec[tripData]{
		Name:    e.def.Name,
		Trigger: saga.On(e.def.Trigger, func(started) (string, tripData, error) { return "", tripData{}, errors.New("unused") }),
		Steps: []saga.Step[tripData]{{Name: "book",
			Action: saga.Send(steps.Define[tripCmd]("book", e.topics["book"], nil), func(d tripData) tripCmd { return tripCmd{Trip: d.Trip} })}},
	})
	client, err := saga.NewClientFromDB(e.db.SQL, saga.ClientConfig{Logger: logger(), DisableRetention: true})
	require.NoError(t, err)
	require.NoError(t, client.Register(shorter))
	err = client.Start(ctx)
	require.ErrorIs(t, err, saga.ErrDefinitionChanged)
	assert.Contains(t, err.Error(), "was started with steps [book(a/c) pay(a/c)] and is now defined with [book(a/-)], and 1 of its instances are unfinished")

	// Once no instance of the version is unfinished, the new steps are
	// recorded, and the old definition is the one refused.
	require.NoError(t, e.engine.Cancel(ctx, id, "test"))
	assert.Equal(t, saga.StatusCompensated, e.terminal(id).Status)
	other, err := saga.NewEngine(saga.Config{DB: e.db.SQL, Transport: e.tr, Logger: logger()})
	require.NoError(t, err)
	require.NoError(t, other.Register(shorter))
	require.NoError(t, other.RecordDefinitions(ctx))
	var steps string
	require.NoError(t, e.db.SQL.QueryRow(`SELECT steps::text FROM saga_definitions WHERE saga_type = $1 AND version = 1`, e.def.Name).Scan(&steps))
	assert.JSONEq(t, `[{"name": "book", "action": true, "compensation": false}]`, steps)
	started := e.start("riga")
	e.wait(started, "pay in flight", func(i saga.Instance) bool { return i.Step == "pay" })
	assert.ErrorIs(t, e.engine.RecordDefinitions(ctx), saga.ErrDefinitionChanged)
}

// A decision that panics with a value PostgreSQL cannot keep as text (a
// NUL) still parks that instance alone, the value made storable, and the
// other overdue instances are swept. (Parking failed, "invalid byte
// sequence for encoding UTF8: 0x00", left the instance overdue, and the
// sweeper took it again first, SweepBatch times a sweep, every sweep: no
// other saga's deadline was ever handled.)
func TestAPanicValueWithANulParksItsInstanceAlone(t *testing.T) {
	t.Parallel()
	e := newEnv(t, options{deadline: time.Hour, panicFor: "doomed", panicWith: "bad\x00value", silent: []string{"pay"}})
	id := e.insertDoomed()
	other := e.start("rome")
	e.wait(other, "pay in flight", func(i saga.Instance) bool { return i.Step == "pay" })
	e.waitConsumed(e.topics["pay"], "participant-pay-"+e.id)
	e.overdue(other)

	res := e.sweep()
	assert.Equal(t, saga.SweepResult{Resent: 1, SetAside: 1}, res, "the doomed one set aside once, the other one swept")
	parked, err := e.engine.Get(context.Background(), id)
	require.NoError(t, err)
	assert.Equal(t, saga.StatusFailed, parked.Status)
	assert.Equal(t, "deciding on the action of pay panicked: bad\uFFFDvalue", parked.FailureReason)
	inst, err := e.engine.Get(context.Background(), other)
	require.NoError(t, err)
	assert.Equal(t, 2, inst.Attempt, "the other saga's command was sent again")
}

// The saga's own deadline by default never cuts short what its steps
// allow: a step whose reply may take longer than TimeoutDefault (an
// approval given in days) keeps its whole deadline, attempts included.
// (The 24 h default capped it: such sagas, which waited for their reply
// before, compensated at 24 h, "took longer than its timeout".)
func TestTheDefaultTimeoutLeavesLongStepsTheirDeadlines(t *testing.T) {
	t.Parallel()
	e := newEnv(t, options{deadline: 2 * saga.TimeoutDefault, absent: []string{"book"}})
	assert.Equal(t, 2*((1+2+4)*2*saga.TimeoutDefault), e.def.Timeout, "both actions' attempts, each waiting twice as long as the one before")
	id := e.start("quito")
	inst := e.wait(id, "book in flight", func(i saga.Instance) bool { return i.Step == "book" })
	require.NotNil(t, inst.DeadlineAt)
	assert.Greater(t, time.Until(*inst.DeadlineAt), saga.TimeoutDefault+time.Hour, "the step's own deadline")
}
