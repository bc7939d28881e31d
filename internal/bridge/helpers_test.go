package bridge_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/internal/bridge"
	"github.com/pgsaga/pgsaga/internal/testdb"
	"github.com/pgsaga/pgsaga/internal/testnats"
	"github.com/pgsaga/pgsaga/internal/testout"
	"github.com/pgsaga/pgsaga/internal/testpg"
	"github.com/pgsaga/pgsaga/internal/transport"
	"github.com/pgsaga/pgsaga/steps/broker"
	"github.com/pgsaga/pgsaga/steps/broker/natsjs"
)

func TestMain(m *testing.M) { testpg.Main(m) }

// testLogger is the tests' logger (PGSAGA_TEST_LOG shows it).
var testLogger = testout.Logger

func randomID() string {
	b := make([]byte, 5)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// transportConfig polls and retries quickly; idle consumers and relays
// wait an hour for a wake-up, so that a lost one fails the test.
func transportConfig(db *testdb.DB) transport.Config {
	return transport.Config{
		DB:               db.SQL,
		Logger:           testLogger(),
		IdlePollInterval: testdb.NoSafetyPoll,
		RetryInterval:    20 * time.Millisecond,
		MaxRetryInterval: 200 * time.Millisecond,
		// Queuing a received message is bounded by two of these, within
		// the broker's ack wait of the tests (5s).
		StatementTimeout: 2 * time.Second,
		Retry:            transport.RetryPolicy{MaxAttempts: 5, InitialBackoff: 10 * time.Millisecond, MaxBackoff: 50 * time.Millisecond},
	}
}

// fixture is one test's database, transport, broker and topic.
type fixture struct {
	t     testing.TB
	db    *testdb.DB
	tr    *transport.Transport
	url   string
	br    *natsjs.Broker
	js    jetstream.JetStream
	topic string
}

func newFixture(t testing.TB, url string, db *testdb.DB) *fixture {
	t.Helper()
	tr, err := transport.New(transportConfig(db))
	require.NoError(t, err)
	br, err := natsjs.New(natsjs.Config{URL: url, Logger: testLogger(), AckWait: 5 * time.Second})
	require.NoError(t, err)
	t.Cleanup(func() { _ = br.Close() })
	_, js := testnats.ConnectTo(t, url)
	f := &fixture{t: t, db: db, tr: tr, url: url, br: br, js: js, topic: "pgsagatest." + randomID() + ".events"}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_ = js.DeleteStream(ctx, natsjs.StreamName(f.topic))
	})
	return f
}

// bridge starts a bridge over the fixture's transport and broker.
func (f *fixture) bridge(cfg broker.Config) *bridge.Bridge {
	f.t.Helper()
	return f.bridgeOn(f.tr, cfg)
}

// bridgeOn starts a bridge over tr and the fixture's broker.
func (f *fixture) bridgeOn(tr *transport.Transport, cfg broker.Config) *bridge.Bridge {
	f.t.Helper()
	if cfg.Broker == nil {
		cfg.Broker = f.br
	}
	cfg.Logger = testLogger()
	b, err := bridge.New(tr, cfg)
	require.NoError(f.t, err)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	require.NoError(f.t, b.Start(ctx))
	f.t.Cleanup(func() { _ = b.Stop() })
	return b
}

// publish publishes n messages to topic, each in a transaction of its own,
// one after the other, and returns their UUIDs in order.
func (f *fixture) publish(topic string, n int, md message.Metadata) []string {
	f.t.Helper()
	ids := make([]string, n)
	for i := range n {
		msg := message.NewMessage(uuid.NewString(), fmt.Appendf(nil, `{"i":%d}`, i))
		for k, v := range md {
			msg.Metadata.Set(k, v)
		}
		tx, err := f.db.SQL.Begin()
		require.NoError(f.t, err)
		require.NoError(f.t, f.tr.Publisher(tx).Publish(topic, msg))
		require.NoError(f.t, tx.Commit())
		ids[i] = msg.UUID
	}
	return ids
}

// stored returns the Watermill UUIDs of what the topic's stream holds, in
// stream order, once it holds at least n messages and nothing is left to
// relay (waiting up to a minute): a copy published late would be seen.
func (f *fixture) stored(topic string, n int) []string {
	f.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	for {
		var msgs uint64
		stream, err := f.js.Stream(ctx, natsjs.StreamName(topic))
		if err != nil && !errors.Is(err, jetstream.ErrStreamNotFound) {
			require.NoError(f.t, err)
		}
		var info *jetstream.StreamInfo
		if err == nil {
			info, err = stream.Info(ctx)
			require.NoError(f.t, err)
			msgs = info.State.Msgs
		}
		if info != nil && int(msgs) >= n && f.queued(topic, transport.RelayGroup) == 0 {
			var out []string
			for seq := info.State.FirstSeq; seq <= info.State.LastSeq; seq++ {
				m, err := stream.GetMsg(ctx, seq)
				require.NoError(f.t, err)
				out = append(out, m.Header.Get(natsjs.HeaderUUID))
			}
			return out
		}
		select {
		case <-ctx.Done():
			f.t.Fatalf("the stream of %s holds %d messages, want %d", topic, msgs, n)
		case <-time.After(20 * time.Millisecond): // polls the broker's state, not a result of ours
		}
	}
}

// queued counts what is queued for group on topic.
func (f *fixture) queued(topic, group string) int {
	f.t.Helper()
	var n int
	require.NoError(f.t, f.db.SQL.QueryRow(`SELECT count(*) FROM pgsaga_queue WHERE topic = $1 AND consumer_group = $2`, topic, group).Scan(&n))
	return n
}

// collector is a router handler that records what it receives.
type collector struct {
	mu   sync.Mutex
	msgs []*message.Message
	seen chan struct{}
}

func newCollector() *collector { return &collector{seen: make(chan struct{}, 1)} }

func (c *collector) handle(msg *message.Message) error {
	c.mu.Lock()
	c.msgs = append(c.msgs, msg.Copy())
	c.mu.Unlock()
	select {
	case c.seen <- struct{}{}:
	default:
	}
	return nil
}

// wait waits until the collector has at least n messages and returns them.
func (c *collector) wait(t testing.TB, n int) []*message.Message {
	t.Helper()
	return c.waitWithin(t, n, time.Minute)
}

// waitWithin is wait, failing the test after d.
func (c *collector) waitWithin(t testing.TB, n int, d time.Duration) []*message.Message {
	t.Helper()
	deadline := time.After(d)
	for {
		c.mu.Lock()
		got := append([]*message.Message(nil), c.msgs...)
		c.mu.Unlock()
		if len(got) >= n {
			return got
		}
		select {
		case <-c.seen:
		case <-deadline:
			t.Fatalf("received %d messages, want %d", len(got), n)
		}
	}
}

// consume runs a router with the collector as group's handler of topic.
func (f *fixture) consume(topic, group string, c *collector) {
	f.t.Helper()
	ctx := context.Background()
	require.NoError(f.t, f.tr.Subscribe(ctx, transport.Subscription{Topic: topic, ConsumerGroup: group}))
	r, err := f.tr.NewRouter()
	require.NoError(f.t, err)
	require.NoError(f.t, r.AddHandler(group, topic, group, c.handle))
	require.NoError(f.t, r.Start(ctx))
	f.t.Cleanup(func() { _ = r.Close() })
}

// newReceiver is a fixture on the shared database whose bridge receives its
// topic as group with one consumer, queued for a local group the collector
// handles.
func newReceiver(t testing.TB) (f *fixture, c *collector, group string) {
	t.Helper()
	f = newFixture(t, testnats.URL(t), testdb.Shared(t))
	c = newCollector()
	f.consume(f.topic, "local", c)
	group = "g" + randomID()
	f.bridge(broker.Config{Receive: []string{f.topic}, Group: group, Consumers: 1})
	return f, c, group
}
