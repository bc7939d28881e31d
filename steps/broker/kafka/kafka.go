// Package kafka is Apache Kafka as a pgsaga broker (steps/broker), through
// watermill-kafka: its synchronous publisher (a publish returns once every
// in-sync replica has the message) and its consumer-group subscriber.
//
// Each topic is a Kafka topic of the same name (Provision creates the
// missing ones with Config.Partitions and Config.ReplicationFactor). A
// message's partition key is its event stream (metadata partition_key),
// else its saga (saga_id), else its UUID, so that an event stream's
// versions and a saga's commands keep their order in one partition. A
// message's UUID and metadata travel as record headers (Watermill's
// default marshaler): any bytes survive.
//
// Kafka deduplicates only the retries of one producer session (the
// idempotent producer, on here): a relay that dies between Kafka's
// acknowledgement and its own commit publishes the message again as a new
// record. pgsaga's receiving side absorbs that as it absorbs any
// redelivery; other consumers must deduplicate by the message's UUID (or
// an event's stream_version).
//
// Its tests run the real client against a cluster in the test's process
// that speaks Kafka's protocol (internal/testkafka), or KAFKA_BROKERS's.
package kafka

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	wmkafka "github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/pgsaga/pgsaga/internal/metadata"
	"github.com/pgsaga/pgsaga/steps/broker"
)

// Defaults of Config.
const (
	PartitionsDefault        = 3
	ReplicationFactorDefault = 1
	PublishTimeoutDefault    = 3 * time.Second
)

// Config configures a Broker. Zero values take the defaults.
type Config struct {
	// Brokers are the bootstrap brokers, host:port each. Required.
	Brokers []string
	// Partitions and ReplicationFactor of the topics Provision creates.
	// Defaults: PartitionsDefault, ReplicationFactorDefault.
	Partitions        int32
	ReplicationFactor int16
	// PublishTimeout bounds a publish. Default: PublishTimeoutDefault.
	PublishTimeout time.Duration
	// Sarama, if set, is the base client configuration (TLS, SASL, …);
	// the broker sets what it relies on over it: an idempotent, synchronous
	// producer acknowledged by every in-sync replica, and consumers that
	// start from the oldest offset of a new group.
	Sarama *sarama.Config
	// Logger. Default: slog.Default().
	Logger *slog.Logger
}

// Broker is Kafka as a pgsaga broker.
type Broker struct {
	cfg  Config
	wlog watermill.LoggerAdapter
	pub  *wmkafka.Publisher
}

var _ broker.Broker = (*Broker)(nil)

// New connects a producer to the brokers and returns the broker.
func New(cfg Config) (*Broker, error) {
	if len(cfg.Brokers) == 0 {
		return nil, fmt.Errorf("%w: kafka: Brokers is required", broker.ErrInvalidConfig)
	}
	if cfg.Partitions == 0 {
		cfg.Partitions = PartitionsDefault
	}
	if cfg.ReplicationFactor == 0 {
		cfg.ReplicationFactor = ReplicationFactorDefault
	}
	if cfg.PublishTimeout == 0 {
		cfg.PublishTimeout = PublishTimeoutDefault
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.Partitions < 0 || cfg.ReplicationFactor < 0 || cfg.PublishTimeout < 0 {
		return nil, fmt.Errorf("%w: kafka: Partitions, ReplicationFactor and PublishTimeout must not be negative", broker.ErrInvalidConfig)
	}
	b := &Broker{cfg: cfg,
		wlog: watermill.NewSlogLoggerWithLevelMapping(cfg.Logger.With("broker", "kafka"), map[slog.Level]slog.Level{slog.LevelInfo: slog.LevelDebug})}
	pub, err := wmkafka.NewPublisher(wmkafka.PublisherConfig{
		Brokers:               cfg.Brokers,
		Marshaler:             marshaler,
		OverwriteSaramaConfig: b.producerConfig(),
	}, b.wlog)
	if err != nil {
		return nil, fmt.Errorf("kafka: %w", err)
	}
	b.pub = pub
	return b, nil
}

// base is a copy of the configured sarama base, or a new one.
func (b *Broker) base() *sarama.Config {
	c := sarama.NewConfig()
	if b.cfg.Sarama != nil {
		cp := *b.cfg.Sarama
		c = &cp
	}
	if !c.Version.IsAtLeast(sarama.V2_1_0_0) {
		c.Version = sarama.V2_1_0_0
	}
	c.ClientID = "pgsaga"
	return c
}

func (b *Broker) producerConfig() *sarama.Config {
	c := b.base()
	c.Producer.Return.Successes = true
	c.Producer.Return.Errors = true
	c.Producer.RequiredAcks = sarama.WaitForAll
	c.Producer.Idempotent = true
	c.Net.MaxOpenRequests = 1
	// A publish is bounded (see MaxPublishDuration): each network wait by
	// PublishTimeout, two retries.
	c.Producer.Retry.Max = 2
	c.Producer.Retry.Backoff = 100 * time.Millisecond
	c.Producer.Timeout = b.cfg.PublishTimeout
	c.Net.DialTimeout, c.Net.ReadTimeout, c.Net.WriteTimeout = b.cfg.PublishTimeout, b.cfg.PublishTimeout, b.cfg.PublishTimeout
	return c
}

// MaxPublishDuration bounds one Publish: three tries, each of a dial, a
// write and a read bounded by PublishTimeout (see broker.PublishBound).
func (b *Broker) MaxPublishDuration() time.Duration { return 3*3*b.cfg.PublishTimeout + time.Second }

// marshaler is Watermill's default (UUID and metadata as headers), with a
// partition key that keeps a stream's or a saga's messages in order; a
// record of another producer, with no Watermill UUID, takes
// "kafka:<topic>:<partition>:<offset>", the same on redelivery.
var marshaler = codec{wmkafka.NewWithPartitioningMarshaler(func(_ string, msg *message.Message) (string, error) {
	for _, k := range []string{metadata.PartitionKey, metadata.SagaID} {
		if v := msg.Metadata.Get(k); v != "" {
			return v, nil
		}
	}
	return msg.UUID, nil
})}

type codec struct{ wmkafka.MarshalerUnmarshaler }

// Unmarshal never fails: a record it cannot read whole is handed out
// marked malformed (broker.MalformedKey).
func (c codec) Unmarshal(m *sarama.ConsumerMessage) (*message.Message, error) {
	msg, err := c.MarshalerUnmarshaler.Unmarshal(m)
	if err != nil || msg == nil {
		msg = message.NewMessage("", m.Value)
		msg.Metadata.Set(broker.MalformedKey, fmt.Sprintf("its record cannot be read: %v", err))
	}
	if msg.UUID == "" {
		msg.UUID = fmt.Sprintf("kafka:%s:%d:%d", m.Topic, m.Partition, m.Offset)
	}
	return msg, nil
}

// Provision creates the topics that do not exist.
func (b *Broker) Provision(_ context.Context, topics ...string) error {
	admin, err := sarama.NewClusterAdmin(b.cfg.Brokers, b.base())
	if err != nil {
		return fmt.Errorf("kafka: connecting to the cluster: %w", err)
	}
	defer admin.Close()
	for _, topic := range topics {
		err := admin.CreateTopic(topic, &sarama.TopicDetail{NumPartitions: b.cfg.Partitions, ReplicationFactor: b.cfg.ReplicationFactor}, false)
		var te *sarama.TopicError
		if err != nil && !(errors.As(err, &te) && te.Err == sarama.ErrTopicAlreadyExists) && !errors.Is(err, sarama.ErrTopicAlreadyExists) {
			return fmt.Errorf("kafka: creating topic %s: %w", topic, err)
		}
	}
	return nil
}

// Reset deletes the topics (see broker.Resetter).
func (b *Broker) Reset(_ context.Context, topics ...string) error {
	admin, err := sarama.NewClusterAdmin(b.cfg.Brokers, b.base())
	if err != nil {
		return fmt.Errorf("kafka: connecting to the cluster: %w", err)
	}
	defer admin.Close()
	for _, topic := range topics {
		if err := admin.DeleteTopic(topic); err != nil && !errors.Is(err, sarama.ErrUnknownTopicOrPartition) {
			return fmt.Errorf("kafka: deleting topic %s: %w", topic, err)
		}
	}
	return nil
}

// Publish publishes msg and waits for its acknowledgement.
func (b *Broker) Publish(ctx context.Context, topic string, msg *message.Message) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	return b.pub.Publish(topic, msg)
}

// Permanent reports whether a Publish error refuses the message for good:
// too large (said by the broker, or by sarama itself before sending, as a
// ConfigurationError naming Producer.MaxMessageBytes), or an invalid
// topic. A CRC mismatch (ErrInvalidMessage) is not: sarama retries it too.
func (b *Broker) Permanent(err error) bool {
	var conf sarama.ConfigurationError
	if errors.As(err, &conf) && strings.Contains(string(conf), "MaxMessageBytes") {
		return true
	}
	return errors.Is(err, sarama.ErrMessageSizeTooLarge) || errors.Is(err, sarama.ErrInvalidTopic)
}

// Subscriber returns a subscriber of the Kafka consumer group group. A
// message handed back is delivered again after 100ms, holding its
// partition until then.
func (b *Broker) Subscriber(group string) (message.Subscriber, error) {
	c := b.base()
	c.Consumer.Offsets.Initial = sarama.OffsetOldest
	c.Consumer.Return.Errors = true
	sub, err := wmkafka.NewSubscriber(wmkafka.SubscriberConfig{
		Brokers:               b.cfg.Brokers,
		Unmarshaler:           marshaler,
		OverwriteSaramaConfig: c,
		ConsumerGroup:         group,
	}, b.wlog)
	if err != nil {
		return nil, fmt.Errorf("kafka: %w", err)
	}
	return sub, nil
}

// Close closes the producer (subscribers are closed by their owners).
func (b *Broker) Close() error { return b.pub.Close() }
