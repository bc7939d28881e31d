package kafka_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"strings"
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
	"github.com/pgsaga/pgsaga/internal/testpg"
	"github.com/pgsaga/pgsaga/internal/transport"
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

// brokers returns KAFKA_BROKERS, or skips: no Kafka broker runs where
// pgsaga is developed (docker compose up -d kafka starts one).
func brokers(t *testing.T) []string {
	t.Helper()
	env := os.Getenv("KAFKA_BROKERS")
	if env == "" {
		t.Skip("no Kafka broker: set KAFKA_BROKERS=127.0.0.1:9092 (docker compose up -d kafka starts one)")
	}
	list := strings.Split(env, ",")
	conn, err := net.DialTimeout("tcp", list[0], 2*time.Second)
	if err != nil {
		t.Skipf("no Kafka broker answers at %s (KAFKA_BROKERS): %v", list[0], err)
	}
	_ = conn.Close()
	return list
}

// With a broker: a topic relayed in order, received whole, by the same
// bridge code as NATS JetStream.
func TestRelayAndReceiveThroughKafka(t *testing.T) {
	list := brokers(t)
	quiet := slog.New(slog.NewTextHandler(io.Discard, nil))
	br, err := kafka.New(kafka.Config{Brokers: list, Partitions: 1, Logger: quiet})
	require.NoError(t, err)
	t.Cleanup(func() { _ = br.Close() })
	out, in := testdb.Fresh(t), testdb.Fresh(t)
	b := make([]byte, 5)
	_, _ = rand.Read(b)
	topic := "pgsagatest." + hex.EncodeToString(b)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()

	trOut, err := transport.New(transport.Config{DB: out.SQL, Logger: quiet, IdlePollInterval: testdb.NoSafetyPoll})
	require.NoError(t, err)
	trIn, err := transport.New(transport.Config{DB: in.SQL, Logger: quiet, IdlePollInterval: testdb.NoSafetyPoll})
	require.NoError(t, err)
	require.NoError(t, trIn.Subscribe(ctx, transport.Subscription{Topic: topic, ConsumerGroup: "local"}))
	for _, side := range []struct {
		tr  *transport.Transport
		cfg broker.Config
	}{
		{trOut, broker.Config{Broker: br, Relay: []string{topic}, Logger: quiet}},
		{trIn, broker.Config{Broker: br, Receive: []string{topic}, Group: "g" + hex.EncodeToString(b), Consumers: 1, Logger: quiet}},
	} {
		bg, err := bridge.New(side.tr, side.cfg)
		require.NoError(t, err)
		require.NoError(t, bg.Start(ctx))
		t.Cleanup(func() { _ = bg.Stop() })
	}
	var ids []string
	for i := range 20 {
		msg := message.NewMessage(uuid.NewString(), fmt.Appendf(nil, `{"i":%d}`, i))
		msg.Metadata.Set(metadata.PartitionKey, "stream-1")
		tx, err := out.SQL.Begin()
		require.NoError(t, err)
		require.NoError(t, trOut.Publisher(tx).Publish(topic, msg))
		require.NoError(t, tx.Commit())
		ids = append(ids, msg.UUID)
	}
	// What the receiving database queued, in the order it was queued.
	var got []string
	require.Eventually(t, func() bool {
		rows, err := in.SQL.QueryContext(ctx, `SELECT uuid FROM pgsaga_queue WHERE topic = $1 ORDER BY id`, topic)
		require.NoError(t, err)
		defer rows.Close()
		got = got[:0]
		for rows.Next() {
			var id string
			require.NoError(t, rows.Scan(&id))
			got = append(got, id)
		}
		return len(got) >= len(ids)
	}, 2*time.Minute, 50*time.Millisecond)
	assert.Equal(t, ids, got)
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
// for good. (Against sarama's own protocol-level fake broker: no Kafka
// runs here.)
func TestPermanentPublishFailures(t *testing.T) {
	t.Parallel()
	mb := sarama.NewMockBroker(t, 1)
	defer mb.Close()
	mb.SetHandlerByMap(map[string]sarama.MockResponse{
		"ApiVersionsRequest":    sarama.NewMockApiVersionsResponse(t),
		"MetadataRequest":       sarama.NewMockMetadataResponse(t).SetBroker(mb.Addr(), mb.BrokerID()).SetLeader("t1", 0, mb.BrokerID()),
		"InitProducerIDRequest": sarama.NewMockInitProducerIDResponse(t),
		"ProduceRequest":        sarama.NewMockProduceResponse(t),
	})
	b, err := kafka.New(kafka.Config{Brokers: []string{mb.Addr()}, PublishTimeout: time.Second})
	require.NoError(t, err)
	defer b.Close()
	ctx := context.Background()
	require.NoError(t, b.Publish(ctx, "t1", message.NewMessage(uuid.NewString(), []byte("small"))))
	err = b.Publish(ctx, "t1", message.NewMessage(uuid.NewString(), []byte(strings.Repeat("x", 1_100_000))))
	require.Error(t, err)
	assert.True(t, b.Permanent(err), "too large: %v", err)

	assert.False(t, b.Permanent(fmt.Errorf("publishing: %w", sarama.ErrInvalidMessage)), "a CRC mismatch is retried")
	assert.False(t, b.Permanent(sarama.ConfigurationError("Producing headers requires Kafka at least v0.11")), "a configuration that refuses every message is no message's fault")
	assert.True(t, b.Permanent(fmt.Errorf("publishing: %w", sarama.ErrMessageSizeTooLarge)))
	assert.False(t, b.Permanent(fmt.Errorf("publishing: %w", sarama.ErrNotLeaderForPartition)))
}
