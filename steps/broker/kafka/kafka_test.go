package kafka_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"io"
	"log/slog"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/internal/bridge"
	"github.com/pgsaga/pgsaga/internal/metadata"
	"github.com/pgsaga/pgsaga/internal/testdb"
	"github.com/pgsaga/pgsaga/internal/testkafka"
	"github.com/pgsaga/pgsaga/internal/testpg"
	"github.com/pgsaga/pgsaga/internal/transport"
	"github.com/pgsaga/pgsaga/saga/sagatest"
	"github.com/pgsaga/pgsaga/steps/broker"
	"github.com/pgsaga/pgsaga/steps/broker/kafka"
)

func TestMain(m *testing.M) { testpg.Main(m) }

// A message's partition key keeps an event stream's versions, and a saga's
// commands, in one partition: its stream, else its saga, else its UUID.
func TestPartitionKey(t *testing.T) {
	t.Parallel()
	for name, c := range map[string]struct {
		md   message.Metadata
		want string
	}{
		"event":   {message.Metadata{metadata.PartitionKey: "order-1", metadata.SagaID: "s"}, "order-1"},
		"command": {message.Metadata{metadata.SagaID: "saga-7"}, "saga-7"},
		"other":   {message.Metadata{}, "the-uuid"},
	} {
		msg := message.NewMessage("the-uuid", []byte("{}"))
		msg.Metadata = c.md
		pm, err := kafka.Marshaler.Marshal("topic", msg)
		require.NoError(t, err, name)
		key, err := pm.Key.Encode()
		require.NoError(t, err)
		assert.Equal(t, c.want, string(key), name)
	}
}

// Whatever a message's id and metadata hold, they travel as record
// headers unchanged.
func TestWireRoundTrip(t *testing.T) {
	t.Parallel()
	msg := message.NewMessage("id with spaces\nand a line break", []byte("payload\x00\xff"))
	msg.Metadata = message.Metadata{"reason": "a\r\nb", "padded": "  x  ", "": "empty key", "naïve": "日本"}
	pm, err := kafka.Marshaler.Marshal("topic", msg)
	require.NoError(t, err)
	value, err := pm.Value.Encode()
	require.NoError(t, err)
	cm := &sarama.ConsumerMessage{Topic: "topic", Value: value}
	for _, h := range pm.Headers {
		cm.Headers = append(cm.Headers, &sarama.RecordHeader{Key: h.Key, Value: h.Value})
	}
	back, err := kafka.Marshaler.Unmarshal(cm)
	require.NoError(t, err)
	assert.Equal(t, msg.UUID, back.UUID)
	assert.Equal(t, msg.Payload, back.Payload)
	assert.Equal(t, msg.Metadata, back.Metadata)
}

// pair is two databases joined by a Kafka topic: out relays it, in
// receives it into its queue.
type pair struct {
	t     *testing.T
	out   *testdb.DB
	in    *testdb.DB
	trOut *transport.Transport
	topic string
}

// newPair relays and receives a topic of its own through the brokers,
// with faults (nil for none) at the bridges' boundaries.
func newPair(t *testing.T, brokers []string, faults broker.Faults) *pair {
	t.Helper()
	br, err := kafka.New(kafka.Config{Brokers: brokers, Partitions: 1, PublishTimeout: time.Second, Logger: quietLogger()})
	require.NoError(t, err)
	t.Cleanup(func() { _ = br.Close() })
	p := &pair{t: t, out: testdb.Fresh(t), in: testdb.Fresh(t)}
	id := make([]byte, 5)
	_, _ = rand.Read(id)
	p.topic = "pgsagatest." + hex.EncodeToString(id)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cfg := func(db *testdb.DB) transport.Config {
		return transport.Config{DB: db.SQL, Logger: quietLogger(), IdlePollInterval: testdb.NoSafetyPoll,
			RetryInterval: 20 * time.Millisecond, MaxRetryInterval: 200 * time.Millisecond}
	}
	p.trOut, err = transport.New(cfg(p.out))
	require.NoError(t, err)
	trIn, err := transport.New(cfg(p.in))
	require.NoError(t, err)
	require.NoError(t, trIn.Subscribe(ctx, transport.Subscription{Topic: p.topic, ConsumerGroup: "local"}))
	for _, side := range []struct {
		tr  *transport.Transport
		cfg broker.Config
	}{
		{p.trOut, broker.Config{Broker: br, Relay: []string{p.topic}, BatchSize: 5, Faults: faults, Logger: quietLogger()}},
		{trIn, broker.Config{Broker: br, Receive: []string{p.topic}, Group: "g" + hex.EncodeToString(id), Consumers: 1, Faults: faults, Logger: quietLogger()}},
	} {
		bg, err := bridge.New(side.tr, side.cfg)
		require.NoError(t, err)
		require.NoError(t, bg.Start(ctx))
		t.Cleanup(func() { _ = bg.Stop() })
	}
	return p
}

// publish publishes n messages of one partition key from out, each in a
// transaction of its own, and returns their UUIDs in order.
func (p *pair) publish(n int) []string {
	p.t.Helper()
	var ids []string
	for i := range n {
		msg := message.NewMessage(uuid.NewString(), fmt.Appendf(nil, `{"i":%d}`, i))
		msg.Metadata.Set(metadata.PartitionKey, "stream-1")
		tx, err := p.out.SQL.Begin()
		require.NoError(p.t, err)
		require.NoError(p.t, p.trOut.Publisher(tx).Publish(p.topic, msg))
		require.NoError(p.t, tx.Commit())
		ids = append(ids, msg.UUID)
	}
	return ids
}

// received waits until in has queued every one of ids, and returns the
// UUIDs it queued in the order it queued them, copies included.
func (p *pair) received(ids []string) []string {
	p.t.Helper()
	var got []string
	require.Eventually(p.t, func() bool {
		var err error
		got, err = sagatest.Rows(context.Background(), p.in.SQL, `SELECT uuid::text FROM pgsaga_queue WHERE topic = $1 ORDER BY id`, p.topic)
		require.NoError(p.t, err)
		for _, id := range ids {
			if !slices.Contains(got, id) {
				return false
			}
		}
		return true
	}, 2*time.Minute, 50*time.Millisecond)
	return got
}

// A topic relayed in order, received whole, by the same bridge code as
// NATS JetStream, through a Kafka cluster (the test's own, in process, or
// KAFKA_BROKERS's).
func TestRelayAndReceiveThroughKafka(t *testing.T) {
	t.Parallel()
	p := newPair(t, testkafka.Brokers(t), nil)
	ids := p.publish(20)
	assert.Equal(t, ids, p.received(ids))
}

// faults crashes the relay after every third publish (before its batch
// commits: Kafka stores the batch's messages again) and hands back every
// fourth message received (Kafka delivers it again), each up to max times.
type faults struct {
	max                 int64
	published, received atomic.Int64
	crashed, handedBack atomic.Int64
}

func (f *faults) CrashAfterPublish(string, *message.Message) bool {
	return f.published.Add(1)%3 == 0 && f.crashed.Add(1) <= f.max
}

func (f *faults) RedeliverAfterStore(string, *message.Message) bool {
	return f.received.Add(1)%4 == 0 && f.handedBack.Add(1) <= f.max
}

// Kafka deduplicates only one producer session's retries: a relay that
// dies between Kafka's acknowledgement and its commit publishes again, as
// new records, and a message handed back is delivered again. The
// receiving database loses nothing and keeps the order: each message is
// queued, first where it belongs, and a copy is a copy (the same UUID,
// which its consumers' idempotency keys absorb as any redelivery). Through
// a restart of the whole cluster too: the relay holds what was queued
// while Kafka was down, and the receiver goes on once it is back.
func TestKafkaCopiesAndARestartLoseNothingAndKeepOrder(t *testing.T) {
	t.Parallel()
	cluster := testkafka.Start(t)
	f := &faults{max: 3}
	p := newPair(t, cluster.Brokers(), f)
	ids := p.publish(15)
	p.received(ids)

	cluster.Stop()
	ids = append(ids, p.publish(15)...) // queued at the relay while Kafka is down
	var held int
	require.NoError(t, p.out.SQL.QueryRow(`SELECT count(*) FROM pgsaga_queue WHERE topic = $1 AND consumer_group = $2`, p.topic, transport.RelayGroup).Scan(&held))
	assert.Equal(t, 15, held, "the relay holds what it cannot publish")
	cluster.Start()
	got := p.received(ids)
	var first []string
	seen := map[string]bool{}
	for _, id := range got {
		if !seen[id] {
			first = append(first, id)
			seen[id] = true
		}
	}
	assert.Equal(t, ids, first, "every message queued, in order")
	assert.Greater(t, len(got), len(ids), "copies came through, as Kafka delivered them")
	assert.EqualValues(t, 3, min(f.crashed.Load(), f.max), "the relay crashed after publishing")
	assert.EqualValues(t, 3, min(f.handedBack.Load(), f.max), "the receiver handed messages back")
	var records int64
	for _, part := range cluster.Kafka().PartitionInfos(p.topic) {
		records += part.HighWatermark
	}
	assert.Greater(t, records, int64(len(ids)), "Kafka holds copies: %d records of %d messages", records, len(ids))
}

// A record of another producer, with no Watermill UUID, takes a stable id
// from its position.
func TestForeignRecordGetsAnID(t *testing.T) {
	t.Parallel()
	msg, err := kafka.Marshaler.Unmarshal(&sarama.ConsumerMessage{Topic: "t", Partition: 2, Offset: 41, Value: []byte("{}")})
	require.NoError(t, err)
	assert.Equal(t, "kafka:t:2:41", msg.UUID)
}

// What the relay does with a failed publish hangs on Permanent: a message
// refused for good is dead-lettered and the topic goes on; any other
// failure holds the topic's head until it passes. Sarama refuses a message
// over Producer.MaxMessageBytes itself, before any broker sees it, with a
// ConfigurationError (not ErrMessageSizeTooLarge): that refusal is for
// good, or the relay would retry it for ever and relay nothing behind it.
// A CRC mismatch (ErrInvalidMessage) is what sarama itself retries: not
// for good.
func TestPermanentPublishFailures(t *testing.T) {
	t.Parallel()
	b, err := kafka.New(kafka.Config{Brokers: testkafka.Brokers(t), PublishTimeout: time.Second, Logger: quietLogger()})
	require.NoError(t, err)
	defer b.Close()
	ctx := context.Background()
	require.NoError(t, b.Provision(ctx, "t1"))
	require.NoError(t, b.Publish(ctx, "t1", message.NewMessage(uuid.NewString(), []byte("small"))))
	err = b.Publish(ctx, "t1", message.NewMessage(uuid.NewString(), []byte(strings.Repeat("x", 1_100_000))))
	require.Error(t, err)
	assert.True(t, b.Permanent(err), "too large: %v", err)

	assert.False(t, b.Permanent(fmt.Errorf("publishing: %w", sarama.ErrInvalidMessage)), "a CRC mismatch is retried")
	assert.False(t, b.Permanent(sarama.ConfigurationError("Producing headers requires Kafka at least v0.11")), "a configuration that refuses every message is no message's fault")
	assert.True(t, b.Permanent(fmt.Errorf("publishing: %w", sarama.ErrMessageSizeTooLarge)))
	assert.False(t, b.Permanent(fmt.Errorf("publishing: %w", sarama.ErrNotLeaderForPartition)))
}

func quietLogger() *slog.Logger { return slog.New(slog.NewTextHandler(io.Discard, nil)) }

// A message Kafka's producer refuses for good (larger than it sends) is
// dead-lettered by the relay with the reason, and the messages after it
// are relayed and received, in order, as over JetStream.
func TestRelayDeadLettersWhatKafkaRefuses(t *testing.T) {
	t.Parallel()
	p := newPair(t, testkafka.Brokers(t), nil)
	before := p.publish(2)
	huge := message.NewMessage(uuid.NewString(), []byte(strings.Repeat("x", 2<<20)))
	huge.Metadata.Set(metadata.PartitionKey, "stream-1")
	tx, err := p.out.SQL.Begin()
	require.NoError(t, err)
	require.NoError(t, p.trOut.Publisher(tx).Publish(p.topic, huge))
	require.NoError(t, tx.Commit())
	after := p.publish(2)
	assert.Equal(t, append(before, after...), p.received(append(before, after...)))
	var handler, reason string
	require.Eventually(t, func() bool {
		return p.out.SQL.QueryRow(`SELECT handler, reason FROM pgsaga_dead_letters WHERE uuid = $1`, huge.UUID).Scan(&handler, &reason) == nil
	}, time.Minute, 10*time.Millisecond)
	assert.Equal(t, transport.RelayHandler, handler)
	assert.Contains(t, reason, "the broker refuses it")
}
