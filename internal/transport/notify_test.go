package transport_test

import (
	"context"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/internal/testdb"
	"github.com/pgsaga/pgsaga/internal/transport"
)

// never makes polling useless: a test that passes with it proves the
// wake-ups did the work.
const never = time.Hour

// listeners counts the LISTEN connections on channel in the test database.
func (e *env) listeners(channel string) int {
	return e.count(`SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND query = $1`,
		"LISTEN "+pgx.Identifier{channel}.Sanitize())
}

// wakeEnv is an env, on a database of its own (whose processes share its
// channel), whose consumers never poll on their own.
func wakeEnv(t *testing.T, mutate func(*transport.Config)) (*env, string) {
	channel := "wake_" + randomID()
	e := newEnvOn(t, testdb.Fresh(t), func(c *transport.Config) {
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
// back publish, one per topic for a committed one, naming the topic.
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
	require.NoError(t, e.tr.Publisher(tx).Publish(e.in, message.NewMessage("a", []byte(`{}`)), message.NewMessage("b", []byte(`{}`))))
	require.NoError(t, e.tr.Publisher(tx).Publish(e.in, message.NewMessage("c", []byte(`{}`))))
	require.NoError(t, tx.Commit())

	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	n, err := conn.WaitForNotification(ctx)
	require.NoError(t, err)
	assert.Equal(t, e.in, n.Payload)
	// One notification for the transaction, however many inserts.
	ctx2, cancel2 := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel2()
	_, err = conn.WaitForNotification(ctx2)
	assert.Error(t, err, "no second notification")
}

// A message is delivered as soon as its publisher commits, even while an
// older transaction that wrote something is still open in the same
// database: nothing waits for older transactions to end.
func TestOlderOpenTransactionDoesNotHoldBackDelivery(t *testing.T) {
	t.Parallel()
	e, channel := wakeEnv(t, nil)
	var handled atomic.Int32
	e.countingRouter(&handled)
	waitFor(t, 10*time.Second, "the listener", func() bool { return e.listeners(channel) == 1 })

	older, err := e.db.SQL.Begin()
	require.NoError(t, err)
	defer older.Rollback() //nolint:errcheck
	_, err = older.Exec(`INSERT INTO ` + e.eff + ` (msg, part) VALUES ('older', 'open')`)
	require.NoError(t, err)
	e.publish(3)
	waitFor(t, 10*time.Second, "delivery while the older transaction is open", func() bool { return handled.Load() == 3 })
}

// Messages published one by one, in parallel, while the consumer is busy,
// are all delivered with polling set to an hour: no wake-up is lost.
func TestNoWakeUpIsLost(t *testing.T) {
	t.Parallel()
	e, channel := wakeEnv(t, func(c *transport.Config) { c.BatchSize = 3 })
	var handled atomic.Int32
	e.countingRouter(&handled, func(msg *message.Message) {
		if msg.UUID[0] < '4' {
			time.Sleep(2 * time.Millisecond) // busy while more arrive
		}
	})
	waitFor(t, 10*time.Second, "the listener", func() bool { return e.listeners(channel) == 1 })
	const publishers, each = 4, 50
	var wg sync.WaitGroup
	for range publishers {
		wg.Go(func() {
			for range each {
				require.NoError(t, e.tr.Publisher(e.db.SQL).Publish(e.in, message.NewMessage(uuid.NewString(), nil)))
			}
		})
	}
	wg.Wait()
	waitFor(t, 30*time.Second, "every message", func() bool { return handled.Load() == publishers*each })
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

// One listening connection serves every consumer of a transport, over any
// number of handlers and consumers, and goes away with the last of them.
func TestOneListenerPerTransport(t *testing.T) {
	t.Parallel()
	e, channel := wakeEnv(t, func(c *transport.Config) { c.Consumers = 4 })
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

// With wake-ups off, nothing listens; polling delivers.
func TestDisableNotify(t *testing.T) {
	t.Parallel()
	channel := "off_" + randomID()
	e := newEnvOn(t, testdb.Fresh(t), func(c *transport.Config) { c.DisableNotify, c.NotifyChannel = true, channel })
	var handled atomic.Int32
	e.countingRouter(&handled)
	e.publish(3)
	waitFor(t, 10*time.Second, "polling", func() bool { return handled.Load() == 3 })
	assert.Zero(t, e.listeners(channel))
}

// A process that does not listen still wakes those that do: its publishes
// notify.
func TestPublishesOfANonListeningProcessWake(t *testing.T) {
	t.Parallel()
	e, channel := wakeEnv(t, nil)
	var handled atomic.Int32
	e.countingRouter(&handled)
	waitFor(t, 10*time.Second, "the listener", func() bool { return e.listeners(channel) == 1 })
	quiet, err := transport.New(transport.Config{DB: e.db.SQL, DisableNotify: true, NotifyChannel: channel, Logger: testLogger()})
	require.NoError(t, err)
	require.NoError(t, quiet.Publisher(e.db.SQL).Publish(e.in, message.NewMessage(uuid.NewString(), nil)))
	waitFor(t, 10*time.Second, "the listening consumer woken", func() bool { return handled.Load() == 1 })
}

// Processes on one database must wake each other on one channel: the first
// records it, and one configured with another is refused at start, saying
// which to use; messages are never left for a consumer nobody wakes.
func TestProcessesMustShareTheNotifyChannel(t *testing.T) {
	t.Parallel()
	db := testdb.Fresh(t)
	first, err := transport.New(transport.Config{DB: db.SQL, NotifyChannel: "chan_a", Logger: testLogger()})
	require.NoError(t, err)
	require.NoError(t, first.Subscribe(context.Background(), transport.Subscription{Topic: "t", ConsumerGroup: "g"}))
	other, err := transport.New(transport.Config{DB: testdb.Open(t, db.URL, 2).SQL, NotifyChannel: "chan_b", Logger: testLogger()})
	require.NoError(t, err)
	r, err := other.NewRouter()
	require.NoError(t, err)
	require.NoError(t, r.AddHandler("h", "t", "g", func(*message.Message) error { return nil }))
	err = r.Run(context.Background())
	require.ErrorIs(t, err, transport.ErrSettingsDiffer)
	assert.Contains(t, err.Error(), `configure "chan_a"`)
	same, err := transport.New(transport.Config{DB: db.SQL, NotifyChannel: "chan_a", Logger: testLogger()})
	require.NoError(t, err)
	require.NoError(t, same.Subscribe(context.Background(), transport.Subscription{Topic: "t", ConsumerGroup: "g"}))
}

func TestNotifyConfig(t *testing.T) {
	t.Parallel()
	db := testdb.Shared(t)
	for _, cfg := range []transport.Config{
		{DB: db.SQL, NotifyChannel: "has space"},
		{DB: db.SQL, NotifyChannel: strings.Repeat("c", 64)},
		{DB: db.SQL, IdlePollInterval: -time.Second},
	} {
		_, err := transport.New(cfg)
		require.Error(t, err, "%+v", cfg)
	}
}

// Processes that start together agree on the settings: one that finds the
// other's first record still uncommitted waits for it, then reads it.
func TestProcessesStartingTogetherAgree(t *testing.T) {
	t.Parallel()
	db := testdb.Fresh(t)
	first, err := db.SQL.Begin()
	require.NoError(t, err)
	defer first.Rollback() //nolint:errcheck
	_, err = first.Exec(`INSERT INTO pgsaga_settings (name, value) VALUES ('notify_channel', 'pgsaga_wakeup')`)
	require.NoError(t, err)
	tr, err := transport.New(transport.Config{DB: db.SQL, Logger: testLogger()})
	require.NoError(t, err)
	started := make(chan error, 1)
	go func() {
		started <- tr.Subscribe(context.Background(), transport.Subscription{Topic: "t", ConsumerGroup: "g"})
	}()
	waitFor(t, 10*time.Second, "the second process to wait for the first one's record", func() bool {
		var n int
		require.NoError(t, db.SQL.QueryRow(`SELECT count(*) FROM pg_stat_activity
			WHERE datname = $1 AND wait_event_type = 'Lock' AND query LIKE '%pgsaga_settings%'`, db.Name).Scan(&n))
		return n == 1
	})
	require.NoError(t, first.Commit())
	require.NoError(t, <-started)
}
