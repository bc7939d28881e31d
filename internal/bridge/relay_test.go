package bridge_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/internal/testdb"
	"github.com/pgsaga/pgsaga/internal/testnats"
	"github.com/pgsaga/pgsaga/internal/transport"
	"github.com/pgsaga/pgsaga/steps/broker"
	"github.com/pgsaga/pgsaga/steps/broker/natsjs"
)

// Messages published one after the other reach the stream in that order,
// each once, and leave the relay's queue. The relay is woken by each
// publish (no safety poll runs in tests).
func TestRelayKeepsOrder(t *testing.T) {
	t.Parallel()
	f := newFixture(t, testnats.URL(t), testdb.Shared(t))
	f.bridge(broker.Config{Relay: []string{f.topic}, BatchSize: 7})
	ids := f.publish(f.topic, 50, nil)
	assert.Equal(t, ids, f.stored(f.topic, len(ids)))
	require.Eventually(t, func() bool { return f.queued(f.topic, transport.RelayGroup) == 0 }, time.Minute, 10*time.Millisecond)
}

// A relay that dies after the broker stored a message and before its
// batch commits publishes the batch again; the broker deduplicates by the
// message's UUID, so the stream holds each message once.
func TestRelayCrashBetweenPublishAndCommitStoresOnce(t *testing.T) {
	t.Parallel()
	f := newFixture(t, testnats.URL(t), testdb.Shared(t))
	crashes := &crashAt{every: 3, max: 4}
	f.bridge(broker.Config{Relay: []string{f.topic}, BatchSize: 5, Faults: crashes})
	ids := f.publish(f.topic, 30, nil)
	require.Eventually(t, func() bool { return f.queued(f.topic, transport.RelayGroup) == 0 }, time.Minute, 10*time.Millisecond)
	assert.Equal(t, ids, f.stored(f.topic, len(ids)), "each message stored once, in order")
	assert.EqualValues(t, 4, crashes.crashed.Load(), "the relay crashed after publishing, before committing")
}

// crashAt crashes the relay after every n-th publish, max times.
type crashAt struct {
	every, max int64
	n          atomic.Int64
	crashed    atomic.Int64
}

func (c *crashAt) CrashAfterPublish(string, *message.Message) bool {
	if c.n.Add(1)%c.every == 0 && c.crashed.Load() < c.max {
		c.crashed.Add(1)
		return true
	}
	return false
}

func (*crashAt) RedeliverAfterStore(string, *message.Message) bool { return false }

// failing is a broker whose publishes fail while fail says so.
type failing struct {
	broker.Broker
	fail func(msg *message.Message) error
}

func (f failing) Publish(ctx context.Context, topic string, msg *message.Message) error {
	if err := f.fail(msg); err != nil {
		return err
	}
	return f.Broker.Publish(ctx, topic, msg)
}

// A publish that fails stops the batch at that message; it is tried again
// after a backoff, before anything queued after it: the stream keeps the
// order. Nothing is dead-lettered for a failure the broker may get over.
func TestRelayStopsAtAFailedPublish(t *testing.T) {
	t.Parallel()
	f := newFixture(t, testnats.URL(t), testdb.Shared(t))
	var (
		mu       sync.Mutex
		failures = map[string]int{}
	)
	br := failing{Broker: f.br, fail: func(msg *message.Message) error {
		mu.Lock()
		defer mu.Unlock()
		if msg.Metadata.Get("batch") == "more" && string(msg.Payload) == `{"i":4}` && failures[msg.UUID] < 3 {
			failures[msg.UUID]++
			return errors.New("injected: the broker did not answer")
		}
		return nil
	}}
	f.bridge(broker.Config{Relay: []string{f.topic}, Broker: br, BatchSize: 10})
	ids := f.publish(f.topic, 1, nil)
	f.stored(f.topic, 1)
	more := f.publish(f.topic, 20, message.Metadata{"batch": "more"})
	later := f.publish(f.topic, 20, nil)
	got := f.stored(f.topic, 41)
	assert.Equal(t, append(append(ids, more...), later...), got)
	mu.Lock()
	assert.Equal(t, 3, failures[more[4]])
	mu.Unlock()
	var dead int
	require.NoError(t, f.db.SQL.QueryRow(`SELECT count(*) FROM pgsaga_dead_letters WHERE topic = $1`, f.topic).Scan(&dead))
	assert.Zero(t, dead)
}

// A message the broker refuses for good (larger than the server takes) is
// dead-lettered with the reason; the messages after it are relayed.
func TestRelayDeadLettersWhatTheBrokerRefuses(t *testing.T) {
	t.Parallel()
	f := newFixture(t, testnats.URL(t), testdb.Shared(t))
	f.bridge(broker.Config{Relay: []string{f.topic}})
	before := f.publish(f.topic, 2, nil)
	// A payload larger than the server takes, and metadata larger than
	// JetStream stores as headers (a long reason with line breaks, which
	// travels encoded).
	huge := message.NewMessage("huge-"+randomID(), []byte(strings.Repeat("x", 2<<20)))
	wordy := message.NewMessage("wordy-"+randomID(), []byte("{}"))
	wordy.Metadata.Set("reason", strings.Repeat("a line\n", 10_000))
	tx, err := f.db.SQL.Begin()
	require.NoError(t, err)
	require.NoError(t, f.tr.Publisher(tx).Publish(f.topic, huge, wordy))
	require.NoError(t, tx.Commit())
	after := f.publish(f.topic, 2, nil)
	assert.Equal(t, append(before, after...), f.stored(f.topic, 4))
	for _, m := range []*message.Message{huge, wordy} {
		var handler, reason string
		require.Eventually(t, func() bool {
			return f.db.SQL.QueryRow(`SELECT handler, reason FROM pgsaga_dead_letters WHERE uuid = $1`, m.UUID).Scan(&handler, &reason) == nil
		}, time.Minute, 10*time.Millisecond)
		assert.Equal(t, transport.RelayHandler, handler)
		assert.Contains(t, reason, "the broker refuses it")
	}
}

// A stream of the name pgsaga would give a topic, capturing other
// subjects, is no stream of the topic: provisioning says so.
func TestProvisionRefusesANameThatCapturesOtherSubjects(t *testing.T) {
	t.Parallel()
	f := newFixture(t, testnats.URL(t), testdb.Shared(t))
	ctx := context.Background()
	_, err := f.js.CreateStream(ctx, jetstream.StreamConfig{Name: natsjs.StreamName(f.topic), Subjects: []string{f.topic + ".other"}, Storage: jetstream.MemoryStorage})
	require.NoError(t, err)
	err = f.br.Provision(ctx, f.topic)
	require.Error(t, err)
	assert.Contains(t, err.Error(), "does not capture the topic")
}

// Two relays of one topic (two processes) relay each message once, in
// order: one holds the topic at a time.
func TestTwoRelaysOfOneTopic(t *testing.T) {
	t.Parallel()
	url := testnats.URL(t)
	db := testdb.Shared(t)
	f := newFixture(t, url, db)
	other := newFixture(t, url, db)
	other.topic = f.topic
	a := f.bridge(broker.Config{Relay: []string{f.topic}, BatchSize: 3})
	b := other.bridge(broker.Config{Relay: []string{f.topic}, BatchSize: 3})
	ids := f.publish(f.topic, 40, nil)
	assert.Equal(t, ids, f.stored(f.topic, len(ids)))
	assert.Equal(t, int64(len(ids)), a.Stats().Relayed+b.Stats().Relayed, "no message published by both (the broker's deduplication would hide it)")
}

// While one relay batch of a topic is open, another is refused at once
// rather than waiting for its rows: the relay of the topic is held.
func TestClaimRelayIsHeldByOne(t *testing.T) {
	t.Parallel()
	db := testdb.Shared(t)
	tr, err := transport.New(transportConfig(db))
	require.NoError(t, err)
	topic := "pgsagatest." + randomID() + ".held"
	ctx := context.Background()
	require.NoError(t, tr.Subscribe(ctx, transport.Subscription{Topic: topic, ConsumerGroup: transport.RelayGroup}))
	tx, err := db.SQL.Begin()
	require.NoError(t, err)
	require.NoError(t, tr.Publisher(tx).Publish(topic, message.NewMessage("a-"+randomID(), []byte("{}"))))
	require.NoError(t, tx.Commit())

	first, err := tr.ClaimRelay(ctx, topic, 10)
	require.NoError(t, err)
	require.Len(t, first.Messages, 1)
	second, err := tr.ClaimRelay(ctx, topic, 10)
	require.ErrorIs(t, err, transport.ErrRelayHeld)
	assert.Nil(t, second)
	first.Relayed(0)
	require.NoError(t, first.Commit())
	third, err := tr.ClaimRelay(ctx, topic, 10)
	require.NoError(t, err)
	assert.Empty(t, third.Messages, "the relayed message left the queue")
	third.Rollback()
}

// A stream deleted under a running relay (an operator's mistake) is
// created again, and the relay goes on; nothing queued is lost.
func TestRelayRecreatesADeletedStream(t *testing.T) {
	t.Parallel()
	f := newFixture(t, testnats.URL(t), testdb.Shared(t))
	f.bridge(broker.Config{Relay: []string{f.topic}})
	first := f.publish(f.topic, 3, nil)
	f.stored(f.topic, len(first))
	require.NoError(t, f.js.DeleteStream(context.Background(), natsjs.StreamName(f.topic)))
	again := f.publish(f.topic, 3, nil)
	assert.Equal(t, again, f.stored(f.topic, len(again)))
}

// The bridge counts what it relayed and received (Stats, and the
// telemetry counters, when its batch committed or its message was queued).
func TestBridgeCounts(t *testing.T) {
	t.Parallel()
	url := testnats.URL(t)
	db := testdb.Shared(t)
	reg := prometheus.NewRegistry()
	cfg := transportConfig(db)
	cfg.Metrics = reg
	tr, err := transport.New(cfg)
	require.NoError(t, err)
	f := newFixture(t, url, db)
	f.tr = tr
	c := newCollector()
	in := "pgsagatest." + randomID() + ".in"
	t.Cleanup(func() { _ = f.js.DeleteStream(context.Background(), natsjs.StreamName(in)) })
	f.consume(in, "local", c)
	b := f.bridge(broker.Config{Relay: []string{f.topic}, Receive: []string{in}, Group: "g" + randomID()})
	f.publish(f.topic, 4, nil)
	f.stored(f.topic, 4)
	for range 3 {
		require.NoError(t, f.br.Publish(context.Background(), in, message.NewMessage(uuid.NewString(), []byte("{}"))))
	}
	c.wait(t, 3)
	require.Eventually(t, func() bool { st := b.Stats(); return st.Relayed == 4 && st.Received == 3 }, time.Minute, 10*time.Millisecond)
	assert.Equal(t, 4.0, counted(t, reg, "pgsaga_broker_relayed_total", f.topic))
	assert.Equal(t, 3.0, counted(t, reg, "pgsaga_broker_received_total", in))
	assert.Equal(t, int64(0), b.Stats().DeadLettered)
}

// counted is the value of counter name with label topic.
func counted(t *testing.T, reg *prometheus.Registry, name, topic string) float64 {
	t.Helper()
	families, err := reg.Gather()
	require.NoError(t, err)
	for _, f := range families {
		if f.GetName() != name {
			continue
		}
		for _, m := range f.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "topic" && l.GetValue() == topic {
					return m.GetCounter().GetValue()
				}
			}
		}
	}
	return 0
}

// Reset deletes what the broker keeps of a topic (a benchmark's fresh
// start); a topic it does not keep is no error.
func TestReset(t *testing.T) {
	t.Parallel()
	f := newFixture(t, testnats.URL(t), testdb.Shared(t))
	ctx := context.Background()
	require.NoError(t, f.br.Provision(ctx, f.topic))
	require.NoError(t, f.br.Publish(ctx, f.topic, message.NewMessage(uuid.NewString(), []byte("{}"))))
	require.NoError(t, f.br.Reset(ctx, f.topic, "pgsagatest."+randomID()+".never"))
	_, err := f.js.Stream(ctx, natsjs.StreamName(f.topic))
	assert.ErrorIs(t, err, jetstream.ErrStreamNotFound)
}

// JetStream finds a message's Nats-Msg-Id by the first place its headers
// hold that text, and ignores it unless that place starts a line: metadata
// holding the text (in a key or a value, and nats.go writes headers in no
// fixed order) would turn off the deduplication the relay relies on. Such
// metadata travels encoded: a message published again and again (a relay
// whose commits fail) is stored once.
func TestBrokerStoresOnceWhateverTheMetadataHolds(t *testing.T) {
	t.Parallel()
	f := newFixture(t, testnats.URL(t), testdb.Shared(t))
	ctx := context.Background()
	for name, md := range map[string]message.Metadata{
		"key":           {"X-Nats-Msg-Id": "v"},
		"value":         {"note": "copied from Nats-Msg-Id"},
		"another case":  {"note": "nats-msg-id"},
		"another nats-": {"X-Nats-Expected-Stream": "s"},
	} {
		topic := f.topic + "." + strings.ReplaceAll(name, " ", "_")
		msg := message.NewMessage(uuid.NewString(), []byte(`{}`))
		msg.Metadata = md
		for range 20 {
			require.NoError(t, f.br.Publish(ctx, topic, msg), name)
		}
		t.Cleanup(func() { _ = f.js.DeleteStream(context.Background(), natsjs.StreamName(topic)) })
		stream, err := f.js.Stream(ctx, natsjs.StreamName(topic))
		require.NoError(t, err)
		info, err := stream.Info(ctx)
		require.NoError(t, err)
		assert.Equal(t, uint64(1), info.State.Msgs, name)
	}
}

// A broker client that panics on one message costs that message alone: it
// is dead-lettered with the panic's value (it would panic again), the
// relay goes on with the others, and the process lives.
func TestRelayDeadLettersAMessageWhosePublishPanics(t *testing.T) {
	t.Parallel()
	f := newFixture(t, testnats.URL(t), testdb.Shared(t))
	br := failing{Broker: f.br, fail: func(msg *message.Message) error {
		if msg.Metadata.Get("poison") == "yes" {
			panic("broker client bug")
		}
		return nil
	}}
	f.bridge(broker.Config{Relay: []string{f.topic}, Broker: br})
	before := f.publish(f.topic, 2, nil)
	f.publish(f.topic, 1, message.Metadata{"poison": "yes"})
	after := f.publish(f.topic, 2, nil)
	assert.Equal(t, append(before, after...), f.stored(f.topic, 4))
	var reason string
	require.Eventually(t, func() bool {
		return f.db.SQL.QueryRow(`SELECT reason FROM pgsaga_dead_letters WHERE topic = $1 AND handler = $2`, f.topic, transport.RelayHandler).Scan(&reason) == nil
	}, time.Minute, 10*time.Millisecond)
	assert.Contains(t, reason, "panicked: broker client bug")
	assert.NotContains(t, reason, "goroutine")
}

// panicOnReceive panics while the bridge receives a message marked so.
type panicOnReceive struct{}

func (panicOnReceive) CrashAfterPublish(string, *message.Message) bool { return false }
func (panicOnReceive) RedeliverAfterStore(_ string, msg *message.Message) bool {
	if msg.Metadata.Get("poison") == "yes" {
		panic("receiving bug")
	}
	return false
}

// A panic while receiving one message costs that message alone: it is
// dead-lettered with the panic's value, the others are received, and the
// process lives.
func TestReceiveDeadLettersAMessageWhoseReceivingPanics(t *testing.T) {
	t.Parallel()
	f := newFixture(t, testnats.URL(t), testdb.Shared(t))
	c := newCollector()
	f.consume(f.topic, "local", c)
	f.bridge(broker.Config{Receive: []string{f.topic}, Group: "g" + randomID(), Consumers: 1, Faults: panicOnReceive{}})
	ctx := context.Background()
	for i, poison := range []string{"no", "yes", "no"} {
		m := message.NewMessage(uuid.NewString(), []byte(`{}`))
		m.Metadata.Set("poison", poison)
		m.Metadata.Set("i", string(rune('0'+i)))
		require.NoError(t, f.br.Publish(ctx, f.topic, m))
	}
	got := c.wait(t, 3)
	var poisoned int
	for _, m := range got {
		if m.Metadata.Get("poison") == "yes" {
			poisoned++
		}
	}
	assert.Equal(t, 1, poisoned, "the poisoned message was queued before the fault hook ran; the panic came after")
	var reason string
	require.Eventually(t, func() bool {
		return f.db.SQL.QueryRow(`SELECT reason FROM pgsaga_dead_letters WHERE topic = $1 AND handler = $2`, f.topic, transport.ReceiveHandler).Scan(&reason) == nil
	}, time.Minute, 10*time.Millisecond)
	assert.Contains(t, reason, "panicked: receiving bug")
}

// A broker's refusal whose text PostgreSQL cannot keep (a NUL, bytes that
// are not UTF-8) still dead-letters that message alone, the reason made
// storable, and the relay goes on. (The batch's commit failed, invalid
// byte sequence 0x00, and was tried again for ever: nothing of the topic
// was relayed again.)
func TestRelayDeadLettersWhateverTheBrokersErrorSays(t *testing.T) {
	t.Parallel()
	f := newFixture(t, testnats.URL(t), testdb.Shared(t))
	br := failing{Broker: f.br, fail: func(msg *message.Message) error {
		if msg.Metadata.Get("poison") == "yes" {
			return fmt.Errorf("refused \x00\xff: %w", nats.ErrMaxPayload)
		}
		return nil
	}}
	f.bridge(broker.Config{Relay: []string{f.topic}, Broker: br})
	before := f.publish(f.topic, 2, nil)
	f.publish(f.topic, 1, message.Metadata{"poison": "yes"})
	after := f.publish(f.topic, 2, nil)
	var reason string
	require.Eventually(t, func() bool {
		return f.db.SQL.QueryRow(`SELECT reason FROM pgsaga_dead_letters WHERE topic = $1 AND handler = $2`, f.topic, transport.RelayHandler).Scan(&reason) == nil
	}, 20*time.Second, 10*time.Millisecond, "the refused message was never dead-lettered")
	assert.Contains(t, reason, "refused \uFFFD\uFFFD: ")
	assert.Equal(t, append(before, after...), f.stored(f.topic, 4))
}
