package saga_test

import (
	"context"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/internal/testdb"
	"github.com/pgsaga/pgsaga/internal/transport"
	"github.com/pgsaga/pgsaga/saga"
)

// Cancel compensates a running saga on purpose: the step in flight too
// (its action may yet happen), then those before it; repeating it changes
// nothing; a completed saga cannot be cancelled.
func TestCancelCompensatesARunningSaga(t *testing.T) {
	t.Parallel()
	e := newEnv(t, options{silent: []string{"pay"}}) // pay never answers: the saga waits at it
	id := e.start("bern")
	e.wait(id, "the pay command sent", func(i saga.Instance) bool { return i.Step == "pay" })
	ctx := context.Background()
	require.NoError(t, e.engine.Cancel(ctx, id, "customer called"))
	inst := e.terminal(id)
	assert.Equal(t, saga.StatusCompensated, inst.Status)
	assert.Equal(t, "cancelled by an operator: customer called", inst.FailureReason)
	assert.Equal(t, []string{"started", "sent:book", "reply_ok:book", "sent:pay", "cancelled:pay", "sent:pay", "reply_ok:pay", "sent:book", "reply_ok:book", "compensated"},
		kinds(inst.History), "the step in flight is compensated (refund), then book (cancel)")
	assert.Equal(t, 1, e.callsOf("refund"))
	assert.Equal(t, 1, e.callsOf("cancel"))

	require.NoError(t, e.engine.Cancel(ctx, id, "again"), "compensated already: nothing to do")
	again, err := e.engine.Get(ctx, id)
	require.NoError(t, err)
	assert.Equal(t, inst.Version, again.Version, "nothing changed")

	e2 := newEnv(t, options{})
	completed := e2.terminal(e2.start("bonn"))
	require.Equal(t, saga.StatusCompleted, completed.Status)
	assert.ErrorIs(t, e2.engine.Cancel(ctx, completed.ID, ""), saga.ErrNotCancellable)
}

// A request asked by a tool that runs no saga (Ask) is carried out by the
// workers once and its outcome recorded: a retry of a parked saga is done,
// a cancel of a completed one refused; asking again for the saga as it is
// now is the same request, carried out once.
func TestAskedRequestsAreCarriedOutOnce(t *testing.T) {
	t.Parallel()
	e := newEnv(t, options{})
	e.set("pay", refuse)
	e.set("cancel", refuse)
	parked := e.terminal(e.start("graz"))
	require.Equal(t, saga.StatusFailed, parked.Status)
	e.set("cancel", succeed)
	ctx := context.Background()

	req, err := saga.Ask(ctx, e.tr, e.db.SQL, parked.ID, saga.RequestRetry, "")
	require.NoError(t, err)
	done := waitRequest(t, e, req.ID)
	assert.Equal(t, saga.RequestDone, done.Outcome)
	assert.Equal(t, saga.StatusCompensated, e.terminal(parked.ID).Status)

	e2 := newEnv(t, options{})
	completed := e2.terminal(e2.start("linz"))
	require.Equal(t, saga.StatusCompleted, completed.Status)
	first, err := saga.Ask(ctx, e2.tr, e2.db.SQL, completed.ID, saga.RequestCancel, "too late")
	require.NoError(t, err)
	refused := waitRequest(t, e2, first.ID)
	assert.Equal(t, saga.RequestRefused, refused.Outcome)
	assert.Contains(t, refused.Detail, "cannot be cancelled")
	second, err := saga.Ask(ctx, e2.tr, e2.db.SQL, completed.ID, saga.RequestCancel, "too late")
	require.NoError(t, err)
	assert.Equal(t, first.ID, second.ID, "the same request")
	assert.Equal(t, refused.DoneAt, second.DoneAt, "carried out once")

	// The request's message delivered again (a duplicate): nothing is done
	// twice.
	dup := message.NewMessage(uuid.NewString(), []byte(`{"request_id":"`+first.ID.String()+`"}`))
	require.NoError(t, e2.tr.Publisher(e2.db.SQL).Publish(saga.RequestTopic(e2.def.Name), dup))
	deadline := time.Now().Add(30 * time.Second)
	for {
		var left int
		require.NoError(t, e2.db.SQL.QueryRow(`SELECT count(*) FROM pgsaga_queue WHERE uuid = $1 AND consumer_group <> 'archive'`, dup.UUID).Scan(&left))
		if left == 0 {
			break
		}
		require.True(t, time.Now().Before(deadline), "the duplicate was never handled")
		time.Sleep(10 * time.Millisecond)
	}
	third, err := saga.RequestStatus(ctx, e2.db.SQL, first.ID)
	require.NoError(t, err)
	assert.Equal(t, refused.DoneAt, third.DoneAt, "the duplicate changed nothing")
	dead, err := e2.tr.DeadLetters(ctx, transport.DeadLetterFilter{Topic: saga.RequestTopic(e2.def.Name)})
	require.NoError(t, err)
	assert.Empty(t, dead)

	_, err = saga.Ask(ctx, e2.tr, e2.db.SQL, completed.ID, "explode", "")
	assert.ErrorIs(t, err, saga.ErrUnknownRequest)
	_, err = saga.Ask(ctx, e2.tr, e2.db.SQL, saga.ID("nope", "nope"), saga.RequestRetry, "")
	assert.ErrorIs(t, err, saga.ErrNoSuchSaga)
}

func waitRequest(t *testing.T, e *env, id uuid.UUID) saga.Request {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		r, err := saga.RequestStatus(context.Background(), e.db.SQL, id)
		require.NoError(t, err)
		if r.DoneAt != nil {
			return r
		}
		require.True(t, time.Now().Before(deadline), "request %x not carried out", id)
		time.Sleep(10 * time.Millisecond)
	}
}

// Asking again publishes the request again only when it is lost: neither
// carried out nor still queued (its message was dead-lettered). While it is
// queued, or once it was carried out, asking again publishes nothing.
func TestAskAgainPublishesOnlyALostRequest(t *testing.T) {
	t.Parallel()
	db := testdb.Shared(t)
	ctx := context.Background()
	tr, err := transport.New(transport.Config{DB: db.SQL, Logger: logger()})
	require.NoError(t, err)
	name := "lost-" + uuid.NewString()[:8]
	topic := saga.RequestTopic(name)
	require.NoError(t, tr.Subscribe(ctx, transport.Subscription{Topic: topic, ConsumerGroup: topic}))
	id := uuid.New()
	_, err = db.SQL.Exec(`INSERT INTO saga_instances (id, saga_type, definition_version, status, data, current_step) VALUES ($1, $2, 1, 'running', '{}', 0)`, id, name)
	require.NoError(t, err)
	queued := func() int {
		var n int
		require.NoError(t, db.SQL.QueryRow(`SELECT count(*) FROM pgsaga_queue WHERE topic = $1`, topic).Scan(&n))
		return n
	}

	first, err := saga.Ask(ctx, tr, db.SQL, id, saga.RequestCancel, "")
	require.NoError(t, err)
	assert.Equal(t, 1, queued())
	assert.True(t, first.Queued)
	assert.False(t, first.Lost())
	again, err := saga.Ask(ctx, tr, db.SQL, id, saga.RequestCancel, "")
	require.NoError(t, err)
	assert.Equal(t, first.ID, again.ID)
	assert.Equal(t, 1, queued(), "still queued: not published again")

	_, err = db.SQL.Exec(`DELETE FROM pgsaga_queue WHERE topic = $1`, topic) // as dead-lettering does
	require.NoError(t, err)
	lost, err := saga.RequestStatus(ctx, db.SQL, first.ID)
	require.NoError(t, err)
	assert.True(t, lost.Lost(), "neither carried out nor queued")
	again, err = saga.Ask(ctx, tr, db.SQL, id, saga.RequestCancel, "")
	require.NoError(t, err)
	assert.Equal(t, first.ID, again.ID, "the same request")
	assert.Equal(t, 1, queued(), "lost: published again")
	assert.True(t, again.Queued)

	_, err = db.SQL.Exec(`WITH handled AS (DELETE FROM pgsaga_queue WHERE topic = $1)
		UPDATE saga_requests SET done_at = now(), outcome = 'refused', detail = 'no' WHERE id = $2`, topic, first.ID)
	require.NoError(t, err)
	again, err = saga.Ask(ctx, tr, db.SQL, id, saga.RequestCancel, "")
	require.NoError(t, err)
	require.NotNil(t, again.DoneAt)
	assert.Equal(t, saga.RequestRefused, again.Outcome)
	assert.False(t, again.Lost(), "carried out")
	assert.Zero(t, queued(), "carried out: not published again")
}
