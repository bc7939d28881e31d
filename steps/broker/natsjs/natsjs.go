// Package natsjs is NATS JetStream as a pgsaga broker (steps/broker),
// through watermill-nats: its NATS publisher, with JetStream, publishes
// (synchronously: it returns once the stream stored the message), and its
// JetStream subscriber consumes, from durable pull consumers this package
// creates.
//
// Each topic is a subject of the same name, kept by a stream: one that
// already captures the subject (an operator's), else one created here,
// named after the topic (StreamName), with a deduplication window
// (Config.DuplicateWindow) within which a message published again with the
// same Nats-Msg-Id (the message's UUID) is stored once. A receiving group
// is a durable consumer per topic (ConsumerName), with explicit acks:
// a message not acknowledged within Config.AckWait, or handed back, is
// delivered again, without limit.
//
// Past the window, JetStream stores a message published again, so a
// consumer can see a message twice (a relay that published it, then could
// not record that for longer than the window): pgsaga's receiving side
// absorbs it as it absorbs any redelivery, and other consumers of the
// stream must deduplicate by the message's UUID (or an event's
// stream_version). Set the window to the longest outage of the relay's
// database to absorb; it cannot exceed a stream's MaxAge.
package natsjs

import (
	"context"
	"errors"
	"fmt"
	"hash/fnv"
	"log/slog"
	"net/url"
	"strings"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wmjs "github.com/ThreeDotsLabs/watermill-nats/v2/pkg/jetstream"
	wmnats "github.com/ThreeDotsLabs/watermill-nats/v2/pkg/nats"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/pgsaga/pgsaga/internal/brokers/brokerurl"
	"github.com/pgsaga/pgsaga/steps/broker"
)

// Defaults of Config.
const (
	DuplicateWindowDefault = 2 * time.Minute
	AckWaitDefault         = 30 * time.Second
	PublishTimeoutDefault  = 5 * time.Second
	// NakDelayDefault is the first wait before a message handed back is
	// delivered again; it doubles with each delivery up to MaxNakDelay.
	NakDelayDefault = 100 * time.Millisecond
	MaxNakDelay     = 5 * time.Second
)

// Config configures a Broker. Zero values take the defaults.
type Config struct {
	// URL of the NATS servers (nats://127.0.0.1:4222, comma-separated for
	// several). Required. A '/', '#', '?', '%' or ',' in a password must be
	// percent-encoded; errors name the servers, never the password.
	URL string
	// Options for the connections the broker opens, after its own: it
	// names them "pgsaga", reconnects for ever and bounds each connect
	// attempt to 5s.
	Options []nats.Option
	// DuplicateWindow of the streams this package creates. Default:
	// DuplicateWindowDefault.
	DuplicateWindow time.Duration
	// Stream, if set, returns the stream to create for topic when no
	// stream captures its subject: its name, subjects, retention, limits.
	// Default: DefaultStream.
	Stream func(topic string, window time.Duration) jetstream.StreamConfig
	// AckWait of the durable consumers this package creates: a delivery
	// neither acknowledged nor handed back within it is delivered again.
	// Default: AckWaitDefault.
	AckWait time.Duration
	// PublishTimeout bounds a publish: the wait for the stream's
	// acknowledgement. Default: PublishTimeoutDefault.
	PublishTimeout time.Duration
	// Logger. Default: slog.Default().
	Logger *slog.Logger
}

// Broker is NATS JetStream as a pgsaga broker.
type Broker struct {
	cfg  Config
	log  *slog.Logger
	wlog watermill.LoggerAdapter
	nc   *nats.Conn // publishing and provisioning
	js   jetstream.JetStream
	pub  *wmnats.Publisher

	mu    sync.Mutex
	conns []*nats.Conn // the subscribers'
}

var _ broker.Broker = (*Broker)(nil)

// New connects to NATS and returns the broker.
func New(cfg Config) (*Broker, error) {
	if cfg.URL == "" {
		return nil, fmt.Errorf("%w: natsjs: URL is required", broker.ErrInvalidConfig)
	}
	// nats.go's errors about a URL it cannot parse quote it, password and all.
	if _, err := brokerurl.Parse(cfg.URL); err != nil {
		return nil, fmt.Errorf("%w: natsjs: %w", broker.ErrInvalidConfig, err)
	}
	if cfg.DuplicateWindow == 0 {
		cfg.DuplicateWindow = DuplicateWindowDefault
	}
	if cfg.AckWait == 0 {
		cfg.AckWait = AckWaitDefault
	}
	if cfg.PublishTimeout == 0 {
		cfg.PublishTimeout = PublishTimeoutDefault
	}
	if cfg.Stream == nil {
		cfg.Stream = DefaultStream
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.DuplicateWindow < 0 || cfg.AckWait < 0 || cfg.PublishTimeout < 0 {
		return nil, fmt.Errorf("%w: natsjs: DuplicateWindow, AckWait and PublishTimeout must not be negative", broker.ErrInvalidConfig)
	}
	b := &Broker{cfg: cfg, log: cfg.Logger.With("broker", "nats"),
		wlog: watermill.NewSlogLoggerWithLevelMapping(cfg.Logger, map[slog.Level]slog.Level{slog.LevelInfo: slog.LevelDebug})}
	nc, err := b.connect("publisher")
	if err != nil {
		return nil, err
	}
	b.nc = nc
	if b.js, err = jetstream.New(nc); err != nil {
		nc.Close()
		return nil, fmt.Errorf("natsjs: %w", err)
	}
	b.pub, err = wmnats.NewPublisherWithNatsConn(nc, wmnats.PublisherPublishConfig{
		Marshaler:         codec{},
		SubjectCalculator: wmnats.DefaultSubjectCalculator,
		JetStream: wmnats.JetStreamConfig{
			ConnectOptions: []nats.JSOpt{nats.MaxWait(cfg.PublishTimeout)},
		},
	}, b.wlog)
	if err != nil {
		nc.Close()
		return nil, fmt.Errorf("natsjs: %w", err)
	}
	return b, nil
}

func (b *Broker) connect(role string) (*nats.Conn, error) {
	opts := append([]nats.Option{
		nats.Name("pgsaga " + role),
		nats.MaxReconnects(-1),
		nats.ReconnectWait(250 * time.Millisecond),
		nats.Timeout(5 * time.Second),
		nats.DisconnectErrHandler(func(_ *nats.Conn, err error) {
			if err != nil {
				b.log.Warn("disconnected from NATS; reconnecting", "role", role, "err", err)
			}
		}),
		nats.ReconnectHandler(func(nc *nats.Conn) {
			// Not ConnectedUrlRedacted: it shows a token (a user alone).
			b.log.Info("reconnected to NATS", "role", role, "url", brokerurl.Describe(nc.ConnectedUrl()))
		}),
	}, b.cfg.Options...)
	nc, err := nats.Connect(b.cfg.URL, opts...)
	if uerr := (*url.Error)(nil); errors.As(err, &uerr) { // it quotes the URL
		err = errors.New("nats.go cannot parse the URL")
	}
	if err != nil {
		return nil, fmt.Errorf("natsjs: connecting to %s: %w", brokerurl.Describe(b.cfg.URL), err)
	}
	return nc, nil
}

// Close closes the broker's connections (its subscribers' too).
func (b *Broker) Close() error {
	b.mu.Lock()
	conns := b.conns
	b.conns = nil
	b.mu.Unlock()
	for _, c := range conns {
		c.Close()
	}
	b.nc.Close()
	return nil
}

// DefaultStream is the stream created for a topic: named StreamName(topic),
// capturing the topic's subject alone, kept on file, deduplicating within
// window, limited by nothing but the server's defaults (add MaxAge or
// MaxBytes through Config.Stream).
func DefaultStream(topic string, window time.Duration) jetstream.StreamConfig {
	return jetstream.StreamConfig{
		Name:        StreamName(topic),
		Description: "pgsaga topic " + topic,
		Subjects:    []string{topic},
		Storage:     jetstream.FileStorage,
		Retention:   jetstream.LimitsPolicy,
		Duplicates:  window,
	}
}

// StreamName is the name of the stream created for topic: "pgsaga_" and
// the topic with its dots as underscores, and a hash of the topic when it
// holds characters a stream name cannot ("$", ":") or underscores (so that
// "a.b" and "a_b" get different streams).
func StreamName(topic string) string { return "pgsaga_" + token(topic) }

// ConsumerName is the name of group's durable consumer of topic.
func ConsumerName(group, topic string) string {
	return "pgsaga_" + token(group) + "__" + token(topic)
}

// token is s as a stream or consumer name part: [A-Za-z0-9_-], dots as
// underscores, with a hash when that may collide.
func token(s string) string {
	var b strings.Builder
	exact := true
	for i := 0; i < len(s); i++ {
		c := s[i]
		switch {
		case c >= 'a' && c <= 'z', c >= 'A' && c <= 'Z', c >= '0' && c <= '9', c == '-':
			b.WriteByte(c)
		case c == '.':
			b.WriteByte('_')
		default:
			b.WriteByte('_')
			exact = false
		}
	}
	if !exact {
		h := fnv.New32a()
		h.Write([]byte(s))
		fmt.Fprintf(&b, "_%08x", h.Sum32())
	}
	return b.String()
}

// subject checks that topic is a usable NATS subject.
func subject(topic string) error {
	if strings.HasPrefix(topic, "$") {
		return fmt.Errorf("%w: %q starts with $, which NATS keeps for its own subjects", ErrUnsupportedTopic, topic)
	}
	for _, tok := range strings.Split(topic, ".") {
		if tok == "" {
			return fmt.Errorf("%w: %q has an empty token", ErrUnsupportedTopic, topic)
		}
	}
	return nil
}

// Provision creates a stream for each topic no stream captures yet. A
// stream that captures it already (an operator's, or one created before)
// is left as it is; one without a deduplication window is reported.
func (b *Broker) Provision(ctx context.Context, topics ...string) error {
	for _, topic := range topics {
		if err := subject(topic); err != nil {
			return err
		}
		name, err := b.js.StreamNameBySubject(ctx, topic)
		switch {
		case err == nil:
			s, err := b.js.Stream(ctx, name)
			if err != nil {
				return fmt.Errorf("natsjs: reading stream %s of topic %s: %w", name, topic, err)
			}
			if w := s.CachedInfo().Config.Duplicates; w < b.cfg.DuplicateWindow {
				b.log.Warn("the stream of a topic deduplicates over a shorter window than configured: a relay that publishes again after it stores a message twice",
					"topic", topic, "stream", name, "duplicate_window", w, "configured", b.cfg.DuplicateWindow)
			}
			continue
		case !errors.Is(err, jetstream.ErrStreamNotFound):
			return fmt.Errorf("natsjs: finding the stream of topic %s: %w", topic, err)
		}
		sc := b.cfg.Stream(topic, b.cfg.DuplicateWindow)
		_, err = b.js.CreateStream(ctx, sc)
		if errors.Is(err, jetstream.ErrStreamNameAlreadyInUse) {
			// Created meanwhile by another process, or a stream of that
			// name that captures other subjects: then the topic still
			// has none.
			if _, err = b.js.StreamNameBySubject(ctx, topic); err != nil {
				return fmt.Errorf("natsjs: topic %s: a stream named %s exists and does not capture the topic: %w", topic, sc.Name, err)
			}
			continue
		}
		if err != nil {
			return fmt.Errorf("natsjs: creating stream %s for topic %s: %w", sc.Name, topic, err)
		}
		b.log.Info("stream created", "topic", topic, "stream", sc.Name, "duplicate_window", sc.Duplicates)
	}
	return nil
}

// Reset deletes the streams that capture topics, with their consumers
// (see broker.Resetter).
func (b *Broker) Reset(ctx context.Context, topics ...string) error {
	for _, topic := range topics {
		name, err := b.js.StreamNameBySubject(ctx, topic)
		if errors.Is(err, jetstream.ErrStreamNotFound) {
			continue
		}
		if err == nil {
			err = b.js.DeleteStream(ctx, name)
		}
		if err != nil && !errors.Is(err, jetstream.ErrStreamNotFound) {
			return fmt.Errorf("natsjs: resetting topic %s: %w", topic, err)
		}
	}
	return nil
}

// Publish publishes msg to topic's subject and waits for the stream's
// acknowledgement (at most Config.PublishTimeout). ctx is not consulted
// once the publish is sent: the wait is bounded by the timeout. When no
// stream answers (one deleted under a running relay), it provisions the
// topic again and publishes once more.
func (b *Broker) Publish(ctx context.Context, topic string, msg *message.Message) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	if err := subject(topic); err != nil {
		return err
	}
	err := b.pub.Publish(topic, msg)
	if errors.Is(err, nats.ErrNoStreamResponse) {
		pctx, cancel := context.WithTimeout(ctx, b.cfg.PublishTimeout)
		perr := b.Provision(pctx, topic)
		cancel()
		if perr != nil {
			return errors.Join(err, perr)
		}
		err = b.pub.Publish(topic, msg)
	}
	return err
}

// JetStream's error codes for a message larger than its stream allows
// (JSStreamMessageExceedsMaximumErr) and for headers larger than it
// stores (JSStreamHeaderExceedsMaximumErr).
const (
	errCodeMessageTooLarge = 10054
	errCodeHeadersTooLarge = 10097
)

// Permanent reports whether a Publish error refuses the message for
// good: larger than the server or its stream take (payload or headers), or
// a topic that cannot be a subject.
func (b *Broker) Permanent(err error) bool {
	if errors.Is(err, nats.ErrMaxPayload) || errors.Is(err, ErrUnsupportedTopic) || errors.Is(err, nats.ErrBadSubject) || errors.Is(err, ErrHeadersTooLarge) {
		return true
	}
	var api *nats.APIError
	return errors.As(err, &api) && (api.ErrorCode == errCodeMessageTooLarge || api.ErrorCode == errCodeHeadersTooLarge)
}

// MaxPublishDuration bounds one Publish: the publish, a provisioning of
// the topic if no stream answered, and the publish again, each bounded by
// Config.PublishTimeout (see broker.PublishBound).
func (b *Broker) MaxPublishDuration() time.Duration { return 3 * b.cfg.PublishTimeout }

// AckWait is how long the broker waits for a delivery's acknowledgement
// before delivering it again (see broker.AckWaiter).
func (b *Broker) AckWait() time.Duration { return b.cfg.AckWait }

// Subscriber returns a subscriber of group, over a connection of its own
// (closed with it): each Subscribe(topic) is one more pull consumer of the
// group's durable consumer of topic, created if missing (its stream too),
// and created again should it be deleted while it runs. Messages handed
// back (nack) are delivered again after a delay that doubles from
// NakDelayDefault up to MaxNakDelay. Close waits for the deliveries under
// way and hands the buffered ones back.
func (b *Broker) Subscriber(group string) (message.Subscriber, error) {
	nc, err := b.connect("subscriber " + group)
	if err != nil {
		return nil, err
	}
	b.mu.Lock()
	b.conns = append(b.conns, nc)
	b.mu.Unlock()
	forget := func() {
		b.mu.Lock()
		defer b.mu.Unlock()
		for i, c := range b.conns {
			if c == nc {
				b.conns = append(b.conns[:i], b.conns[i+1:]...)
				break
			}
		}
		nc.Close()
	}
	g := &gate{}
	sub, err := wmjs.NewSubscriber(wmjs.SubscriberConfig{
		Conn:                nc,
		Logger:              b.wlog,
		AckWaitTimeout:      b.cfg.AckWait,
		ResourceInitializer: b.consumer(group, g),
		NakDelay:            nakDelay{},
		Unmarshaler:         codec{},
		// A consumer asks for one message at a time, once free for it: the
		// broker's AckWait runs from a message's delivery, so one taken
		// early would wait for the inserts of those before it, past the
		// AckWait, and be delivered (and queued) again. One insert's bound
		// fits the AckWait (broker.New checks it). A request expires soon
		// (pullExpiry): a message another client published that passes for
		// a status message of the server's (no data, a Status header) uses
		// up the request without reaching a handler, and the consumer asks
		// again only when it expires.
		ConsumeOptions: []jetstream.PullConsumeOpt{jetstream.PullMaxMessages(1), jetstream.PullExpiry(pullExpiry(b.cfg.AckWait))},
	})
	if err != nil {
		forget()
		return nil, fmt.Errorf("natsjs: %w", err)
	}
	return &subscriber{Subscriber: sub, gate: g, done: forget}, nil
}

// pullExpiry is how long a consumer's request for a message stands: half
// the AckWait, at most 5s, at least 1s (nats.go's heartbeats every half
// of it).
func pullExpiry(ackWait time.Duration) time.Duration {
	return min(max(ackWait/2, time.Second), 5*time.Second)
}

// consumer is the subscriber's ResourceInitializer: group's durable
// consumer of a topic, consumed through the gate (see consume.go); pgsaga
// never deletes it.
func (b *Broker) consumer(group string, g *gate) wmjs.ResourceInitializer {
	return func(ctx context.Context, js jetstream.JetStream, topic string) (jetstream.Consumer, func(context.Context, watermill.LoggerAdapter), error) {
		c, err := b.ensureConsumer(ctx, js, group, topic)
		if err != nil {
			return nil, nil, err
		}
		return &consumer{Consumer: c, b: b, js: js, group: group, topic: topic, gate: g}, nil, nil
	}
}

// ensureConsumer creates (or updates) group's durable consumer of topic on
// the stream that captures it, provisioning the stream if none does.
func (b *Broker) ensureConsumer(ctx context.Context, js jetstream.JetStream, group, topic string) (jetstream.Consumer, error) {
	if err := subject(topic); err != nil {
		return nil, err
	}
	stream, err := js.StreamNameBySubject(ctx, topic)
	if errors.Is(err, jetstream.ErrStreamNotFound) {
		if err = b.Provision(ctx, topic); err == nil {
			stream, err = js.StreamNameBySubject(ctx, topic)
		}
	}
	if err != nil {
		return nil, fmt.Errorf("natsjs: finding the stream of topic %s: %w", topic, err)
	}
	c, err := js.CreateOrUpdateConsumer(ctx, stream, jetstream.ConsumerConfig{
		Durable:       ConsumerName(group, topic),
		Description:   "pgsaga group " + group + " of topic " + topic,
		FilterSubject: topic,
		DeliverPolicy: jetstream.DeliverAllPolicy,
		AckPolicy:     jetstream.AckExplicitPolicy,
		AckWait:       b.cfg.AckWait,
		MaxDeliver:    -1,
	})
	if err != nil {
		return nil, fmt.Errorf("natsjs: consumer %s of stream %s: %w", ConsumerName(group, topic), stream, err)
	}
	return c, nil
}

// nakDelay is the wait before a message handed back is delivered again.
type nakDelay struct{}

func (nakDelay) WaitTime(delivered uint64) time.Duration {
	d := NakDelayDefault
	for i := uint64(1); i < delivered && d < MaxNakDelay; i++ {
		d *= 2
	}
	return min(d, MaxNakDelay)
}
