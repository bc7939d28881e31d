package transport_test

import (
	"context"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/idempotency"
	"github.com/pgsaga/pgsaga/internal/testdb"
	"github.com/pgsaga/pgsaga/internal/transport"
)

// A router that cannot run makes Start return the reason at once, instead
// of leaving its caller waiting on Running, which never closes then.
func TestStartReturnsWhyTheRouterCannotRun(t *testing.T) {
	t.Parallel()
	db := testdb.Custom(t, "TEMPLATE template0 ENCODING 'SQL_ASCII' LC_COLLATE 'C' LC_CTYPE 'C'")
	tr, err := transport.New(transport.Config{DB: db.SQL, Logger: testLogger()})
	require.NoError(t, err)
	r, err := tr.NewRouter()
	require.NoError(t, err)
	require.NoError(t, r.AddHandler("h", "t", "g", func(*message.Message) error { return nil }))

	err = r.Start(context.Background())
	require.ErrorIs(t, err, transport.ErrNotUTF8)
	select {
	case <-r.Stopped():
	default:
		t.Fatal("Stopped is not closed after a failed start")
	}
	require.ErrorIs(t, r.Err(), transport.ErrNotUTF8)
	require.ErrorIs(t, r.Stop(), transport.ErrNotUTF8, "Stop reports what the run ended with")
}

// Start runs the router until Stop; a router starts once; a start that
// outlives its context gives up and leaves nothing running.
func TestStartAndStop(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	r, err := e.tr.NewRouter()
	require.NoError(t, err)
	handled := make(chan string, 1)
	require.NoError(t, r.AddHandler("h", e.in, "g", func(msg *message.Message) error {
		handled <- msg.UUID
		return nil
	}))
	require.NoError(t, r.Start(context.Background()))
	require.ErrorIs(t, r.Start(context.Background()), transport.ErrRouterClosed, "a router starts once")
	ids := e.publish(1)
	select {
	case id := <-handled:
		assert.Equal(t, ids[0], id)
	case <-time.After(30 * time.Second):
		t.Fatal("the started router handled nothing")
	}
	select {
	case <-r.Stopped():
		t.Fatal("Stopped closed while the router runs")
	default:
	}
	require.NoError(t, r.Stop())
	<-r.Stopped()
	require.NoError(t, r.Err())

	r2, err := e.tr.NewRouter()
	require.NoError(t, err)
	require.NoError(t, r2.AddHandler("h", e.in, "g", func(*message.Message) error { return nil }))
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	require.ErrorIs(t, r2.Start(ctx), context.Canceled)
	require.NoError(t, r2.Stop(), "nothing ran")
}

// Start's context bounds the start: recording the subscriptions behind a
// lock held elsewhere gives up when it ends, instead of waiting for the
// lock.
func TestStartGivesUpWithItsContext(t *testing.T) {
	t.Parallel()
	e := newEnv(t, func(c *transport.Config) { c.LockTimeout = time.Minute; c.StatementTimeout = time.Minute })
	holder, err := e.db.SQL.Begin()
	require.NoError(t, err)
	defer holder.Rollback() //nolint:errcheck
	_, err = holder.Exec(`LOCK TABLE pgsaga_subscriptions IN ACCESS EXCLUSIVE MODE`)
	require.NoError(t, err)

	r, err := e.tr.NewRouter()
	require.NoError(t, err)
	require.NoError(t, r.AddHandler("h", e.in, "g", func(*message.Message) error { return nil }))
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	started := make(chan error, 1)
	go func() { started <- r.Start(ctx) }()
	select {
	case err := <-started:
		require.Error(t, err)
	case <-time.After(20 * time.Second):
		t.Fatal("Start waited for the lock past its context")
	}
	require.NoError(t, holder.Rollback())
	<-r.Stopped()
}

// A Start that fails while Watermill subscribes the handlers (here the
// second handler's subscription is refused) leaves nothing running, and
// Stop returns at once instead of waiting CloseTimeout for handlers that
// never started.
func TestStopAfterAFailedStartReturnsAtOnce(t *testing.T) {
	t.Parallel()
	db := testdb.Fresh(t)
	_, err := db.SQL.Exec(`CREATE SEQUENCE upd;
CREATE FUNCTION refuse() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN IF nextval('upd') > 1 THEN RAISE EXCEPTION 'refused'; END IF; RETURN NEW; END $$;
CREATE TRIGGER refuse BEFORE UPDATE ON pgsaga_subscriptions FOR EACH ROW EXECUTE FUNCTION refuse();`)
	require.NoError(t, err)
	cfg := fastConfig(db)
	cfg.CloseTimeout = time.Hour
	tr, err := transport.New(cfg)
	require.NoError(t, err)
	r, err := tr.NewRouter()
	require.NoError(t, err)
	h := func(*message.Message) error { return nil }
	require.NoError(t, r.AddHandler("h1", "topic_a", "g", h))
	require.NoError(t, r.AddHandler("h2", "topic_b", "g", h))
	require.ErrorContains(t, r.Start(context.Background()), "refused")

	stopped := make(chan error, 1)
	go func() { stopped <- r.Stop() }()
	select {
	case err := <-stopped:
		require.ErrorContains(t, err, "refused", "Stop reports why the run ended")
	case <-time.After(20 * time.Second):
		t.Fatal("Stop waited for handlers that never started")
	}
}

// A business failure that reaches the transport (a handler that refuses a
// message for good, outside the step runtime) is not retried: it is
// dead-lettered after its one attempt, with its reason.
func TestBusinessFailureIsNotRetried(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	tries := newAttempts()
	e.runOne(t, func(msg *message.Message) error {
		tries.next(msg.UUID)
		return idempotency.Reject("card declined")
	})
	waitFor(t, 30*time.Second, "the dead letter", func() bool { return len(e.deadLetters(e.in)) == 1 })
	dead := e.deadLetters(e.in)[0]
	assert.Equal(t, 1, dead.Attempts)
	assert.Contains(t, dead.Reason, "card declined")
	assert.Equal(t, 1, tries.of(dead.UUID))
}
