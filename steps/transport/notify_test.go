package transport_test

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/internal/testdb"
	"github.com/pgsaga/pgsaga/steps/transport"
)

// never makes polling useless: a test that passes with it proves the
// wake-ups did the work.
const never = time.Hour

// listeners counts the LISTEN connections on channel in the test database.
func (e *env) listeners(channel string) int {
	return e.count(`SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND query = $1`,
		"LISTEN "+pgx.Identifier{channel}.Sanitize())
}

// wakeEnv is an env whose subscribers never poll on their own.
func wakeEnv(t *testing.T, mutate func(*transport.Config)) (*env, string) {
	channel := "wake_" + randomID()
	e := newEnv(t, func(c *transport.Config) {
		c.PollInterval, c.IdlePollInterval, c.NotifyChannel = never, never, channel
		if mutate != nil {
			mutate(c)
		}
	})
	return e, channel
}

// countingRouter runs a router whose handler on e.in counts messages.
func (e *env) countingRouter(handled *atomic.Int32, opts ...func(*message.Message)) {
	r, err := e.tr.NewRouter()
	require.NoError(e.t, err)
	require.NoError(e.t, r.AddHandler("h", e.in, "g", func(msg *message.Message) error {
		for _, o := range opts {
			o(msg)
		}
		handled.Add(1)
		return nil
	}))
	startRouter(e.t, r)
}

// An idle subscriber is woken by a publish's notification: with polling
// set to an hour, messages still arrive, each time.
func TestPublishWakesIdleSubscribers(t *testing.T) {
	t.Parallel()
	e, channel := wakeEnv(t, nil)
	var handled atomic.Int32
	e.countingRouter(&handled)
	waitFor(t, 10*time.Second, "the listener", func() bool { return e.listeners(channel) == 1 })
	for round := int32(1); round <= 3; round++ {
		e.publish(1)
		waitFor(t, 10*time.Second, "a woken subscriber", func() bool { return handled.Load() == round })
	}
}

// A notification is sent in the publishing transaction: none for a rolled
// back publish, and its payload names the physical topic and the
// publisher's transaction id.
func TestPublishNotifiesOnCommitOnly(t *testing.T) {
	t.Parallel()
	e, channel := wakeEnv(t, nil)
	conn, err := pgx.Connect(context.Background(), e.db.URL)
	require.NoError(t, err)
	defer conn.Close(context.Background())
	_, err = conn.Exec(context.Background(), "LISTEN "+pgx.Identifier{channel}.Sanitize())
	require.NoError(t, err)

	tx, err := e.db.SQL.Begin()
	require.NoError(t, err)
	require.NoError(t, e.tr.Publisher(tx).Publish(e.in, message.NewMessage("rolled-back", []byte(`{}`))))
	require.NoError(t, tx.Rollback())
	tx, err = e.db.SQL.Begin()
	require.NoError(t, err)
	var xid string
	require.NoError(t, tx.QueryRow(`SELECT pg_current_xact_id()::text`).Scan(&xid))
	require.NoError(t, e.tr.Publisher(tx).Publish(e.in, message.NewMessage("a", []byte(`{}`)), message.NewMessage("b", []byte(`{}`))))
	require.NoError(t, e.tr.Publisher(tx).Publish(e.in, message.NewMessage("c", []byte(`{}`))))
	require.NoError(t, tx.Commit())

	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	n, err := conn.WaitForNotification(ctx)
	require.NoError(t, err)
	assert.Equal(t, e.in+" "+xid, n.Payload)
	// One notification for the transaction, however many inserts.
	ctx2, cancel2 := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel2()
	_, err = conn.WaitForNotification(ctx2)
	assert.Error(t, err, "no second notification")
}

// A message announced while an older transaction is still open stays
// behind watermill-sql's visibility fence; the subscriber keeps looking,
// briefly, and delivers it as soon as the fence moves, not an hour later.
func TestFencedMessageIsDeliveredWhenTheFenceMoves(t *testing.T) {
	t.Parallel()
	e, channel := wakeEnv(t, nil)
	var handled atomic.Int32
	e.countingRouter(&handled)
	waitFor(t, 10*time.Second, "the listener", func() bool { return e.listeners(channel) == 1 })

	// An older transaction with an id, open across the publish.
	older, err := e.db.SQL.Begin()
	require.NoError(t, err)
	defer older.Rollback() //nolint:errcheck
	_, err = older.Exec(`SELECT pg_current_xact_id()`)
	require.NoError(t, err)
	e.publish(1)
	// It cannot be delivered yet.
	deadline := time.Now().Add(300 * time.Millisecond)
	for time.Now().Before(deadline) {
		require.Zero(t, handled.Load(), "delivered across the fence")
		time.Sleep(10 * time.Millisecond)
	}
	require.NoError(t, older.Commit())
	waitFor(t, 10*time.Second, "delivery once the fence moved", func() bool { return handled.Load() == 1 })
}

// A message committed before its subscriber started, so announced to
// nobody, but behind the fence at the subscriber's first poll, is delivered
// when the fence moves.
func TestFencedMessageFromBeforeTheSubscriber(t *testing.T) {
	t.Parallel()
	e, _ := wakeEnv(t, nil)
	older, err := e.db.SQL.Begin()
	require.NoError(t, err)
	defer older.Rollback() //nolint:errcheck
	_, err = older.Exec(`SELECT pg_current_xact_id()`)
	require.NoError(t, err)
	e.publish(1)
	var handled atomic.Int32
	e.countingRouter(&handled)
	assert.Never(t, func() bool { return handled.Load() > 0 }, 300*time.Millisecond, 10*time.Millisecond, "delivered across the fence")
	require.NoError(t, older.Commit())
	waitFor(t, 10*time.Second, "delivery once the fence moved", func() bool { return handled.Load() == 1 })
}

// The listening connection lost: a message published meanwhile (its
// notification lost with the connection) is found when the listener comes
// back, and wake-ups work again.
func TestWakeUpsSurviveALostListener(t *testing.T) {
	t.Parallel()
	e, channel := wakeEnv(t, func(c *transport.Config) { c.RetryInterval = 500 * time.Millisecond })
	var handled atomic.Int32
	e.countingRouter(&handled)
	waitFor(t, 10*time.Second, "the listener", func() bool { return e.listeners(channel) == 1 })
	listenerPID := func() int {
		var pid int
		err := e.db.SQL.QueryRow(`SELECT coalesce(max(pid), 0) FROM pg_stat_activity WHERE datname = current_database() AND query = $1`,
			"LISTEN "+pgx.Identifier{channel}.Sanitize()).Scan(&pid)
		require.NoError(t, err)
		return pid
	}
	first := listenerPID()
	e.count(`SELECT count(pg_terminate_backend($1))`, first)
	e.publish(1) // while nobody listens
	waitFor(t, 10*time.Second, "a new listener", func() bool {
		pid := listenerPID()
		return pid != 0 && pid != first && e.listeners(channel) == 1
	})
	waitFor(t, 10*time.Second, "the message published while nobody listened", func() bool { return handled.Load() == 1 })
	e.publish(2)
	waitFor(t, 10*time.Second, "wake-ups after the reconnect", func() bool { return handled.Load() == 3 })
}

// One listening connection serves every subscription of a transport, over
// any number of handlers and lanes, and goes away with the last of them.
func TestOneListenerPerTransport(t *testing.T) {
	t.Parallel()
	e, channel := wakeEnv(t, func(c *transport.Config) { c.Lanes = 4 })
	require.NoError(t, e.tr.CreateTopics(context.Background(), e.in, e.out))
	var handled atomic.Int32
	var stops []func()
	for i := range 3 {
		r, err := e.tr.NewRouter()
		require.NoError(t, err)
		for _, topic := range []string{e.in, e.out} {
			require.NoError(t, r.AddHandler("h-"+topic, topic, "g"+string(rune('a'+i)), func(*message.Message) error {
				handled.Add(1)
				return nil
			}))
		}
		stops = append(stops, startRouter(t, r))
	}
	waitFor(t, 10*time.Second, "the listener", func() bool { return e.listeners(channel) == 1 })
	assert.Never(t, func() bool { return e.listeners(channel) > 1 }, 300*time.Millisecond, 20*time.Millisecond)
	e.publish(8)
	waitFor(t, 10*time.Second, "every group to handle every message", func() bool { return handled.Load() == 24 })
	for _, stop := range stops {
		stop()
	}
	waitFor(t, 10*time.Second, "the listener to go", func() bool { return e.listeners(channel) == 0 })
}

// With wake-ups off, nothing listens and publishes notify nobody; polling
// delivers.
func TestDisableNotify(t *testing.T) {
	t.Parallel()
	channel := "off_" + randomID()
	e := newEnv(t, func(c *transport.Config) { c.DisableNotify, c.NotifyChannel = true, channel })
	var handled atomic.Int32
	e.countingRouter(&handled)
	e.publish(3)
	waitFor(t, 10*time.Second, "polling", func() bool { return handled.Load() == 3 })
	assert.Zero(t, e.listeners(channel))
}

func TestNotifyConfig(t *testing.T) {
	t.Parallel()
	db := testdb.Shared(t)
	for _, cfg := range []transport.Config{
		{DB: db.SQL, NotifyChannel: "has space"},
		{DB: db.SQL, IdlePollInterval: -time.Second},
		{DB: db.SQL, Lanes: -1},
		{DB: db.SQL, Lanes: transport.MaxLanes + 1},
		{DB: db.SQL, TopicLanes: map[string]int{"t": 0}},
	} {
		_, err := transport.New(cfg)
		require.Error(t, err, "%+v", cfg)
	}
}
