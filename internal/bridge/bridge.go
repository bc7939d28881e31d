// Package bridge runs a client's bridge to a message broker
// (steps/broker.Config): it relays the outbox of a database to the broker
// and queues what it receives from it. saga.Client builds one from
// ClientConfig.Broker; pgsaga's relay command builds its own.
package bridge

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/pgsaga/pgsaga/internal/transport"
	"github.com/pgsaga/pgsaga/steps/broker"
)

func setDefaults(c *broker.Config, tr *transport.Transport) {
	if c.Group == "" {
		c.Group = broker.GroupDefault
	}
	if c.Consumers == 0 {
		c.Consumers = broker.ConsumersDefault
	}
	if c.BatchSize == 0 {
		c.BatchSize = broker.BatchSizeDefault
	}
	if c.Logger == nil && tr != nil {
		c.Logger = tr.Config().Logger
	}
}

func validate(c broker.Config, tr *transport.Transport) error {
	var errs []error
	if tr == nil {
		errs = append(errs, errors.New("a transport is required"))
	}
	if c.Broker == nil {
		errs = append(errs, errors.New("Broker is required"))
	}
	if len(c.Relay) == 0 && len(c.Receive) == 0 {
		errs = append(errs, errors.New("nothing to do: give Relay or Receive topics"))
	}
	for _, topics := range [][]string{c.Relay, c.Receive} {
		for i, topic := range topics {
			if err := transport.ValidateTopic(topic); err != nil {
				errs = append(errs, err)
			}
			if slices.Contains(topics[:i], topic) {
				errs = append(errs, fmt.Errorf("topic %s is listed twice", topic))
			}
		}
	}
	for _, topic := range c.Relay {
		if slices.Contains(c.Receive, topic) {
			errs = append(errs, fmt.Errorf("topic %s is both relayed and received: what the bridge received it would relay again", topic))
		}
	}
	if err := transport.ValidateConsumerGroup(c.Group); err != nil {
		errs = append(errs, err)
	}
	if c.Consumers < 1 {
		errs = append(errs, fmt.Errorf("Consumers must be at least 1, got %d", c.Consumers))
	}
	if c.BatchSize < 1 {
		errs = append(errs, fmt.Errorf("BatchSize must be at least 1, got %d", c.BatchSize))
	}
	if tr != nil && c.Broker != nil {
		tc := tr.Config()
		if bound := publishBound(c.Broker, tc); len(c.Relay) > 0 && relayWindow(tc) < bound {
			errs = append(errs, fmt.Errorf("a publish may take %s (the broker's bound), more than a relay batch's transaction leaves it (%s of the transport's MaxTransactionDuration %s): lower the broker's publish timeout or raise the transport's AttemptTimeout",
				bound, relayWindow(tc), tc.MaxTransactionDuration()))
		}
		if w, ok := c.Broker.(broker.AckWaiter); ok && len(c.Receive) > 0 && receiveBound(tc) >= w.AckWait() {
			errs = append(errs, fmt.Errorf("queuing a received message may take %s (twice the transport's StatementTimeout), as long as the broker waits for its acknowledgement (%s): raise the broker's ack wait or lower the StatementTimeout",
				receiveBound(tc), w.AckWait()))
		}
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("%w: %w", broker.ErrInvalidConfig, err)
	}
	return nil
}

// Bridge relays topics of a database to a broker and receives topics from
// it (see the package documentation). Build it with New, then Start it;
// Stop stops it. A saga.Client runs one with its worker when its config
// names a broker.
type Bridge struct {
	cfg broker.Config
	t   *transport.Transport
	log *slog.Logger

	mu      sync.Mutex
	started bool
	cancel  context.CancelFunc
	relays  sync.WaitGroup
	inbox   sync.WaitGroup
	subs    []message.Subscriber
	stopCtx context.CancelFunc // ends the inbox before the relay

	relayed, received, deadLettered, handedBack atomic.Int64
}

// Stats returns what the bridge did so far.
func (b *Bridge) Stats() broker.Stats {
	return broker.Stats{Relayed: b.relayed.Load(), Received: b.received.Load(), DeadLettered: b.deadLettered.Load(), HandedBack: b.handedBack.Load()}
}

// New validates cfg and returns a Bridge between tr's database and
// cfg.Broker. It connects to nothing.
func New(tr *transport.Transport, cfg broker.Config) (*Bridge, error) {
	setDefaults(&cfg, tr)
	if err := validate(cfg, tr); err != nil {
		return nil, err
	}
	return &Bridge{cfg: cfg, t: tr, log: cfg.Logger.With("component", "broker")}, nil
}

// Config returns the configuration with defaults filled in.
func (b *Bridge) Config() broker.Config { return b.cfg }

// Setup records the relay's consumer group of each relayed topic, so that
// every message published to one from now on is queued for the relay
// (publish only after it, or the relay misses what came before), and
// provisions every topic at the broker. Start does it; it is idempotent
// and safe from several processes.
func (b *Bridge) Setup(ctx context.Context) error {
	subs := make([]transport.Subscription, len(b.cfg.Relay))
	for i, topic := range b.cfg.Relay {
		subs[i] = transport.Subscription{Topic: topic, ConsumerGroup: transport.RelayGroup}
	}
	if err := b.t.Subscribe(ctx, subs...); err != nil {
		return fmt.Errorf("broker: setting up the relay: %w", err)
	}
	if err := b.cfg.Broker.Provision(ctx, append(slices.Clone(b.cfg.Relay), b.cfg.Receive...)...); err != nil {
		return fmt.Errorf("broker: provisioning the topics at the broker: %w", err)
	}
	return nil
}

// Start sets up (see Setup), subscribes to the received topics at the
// broker and starts the relay; it returns once they run, or with why they
// cannot. ctx bounds the start only.
func (b *Bridge) Start(ctx context.Context) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.started {
		return broker.ErrStarted
	}
	if err := b.Setup(ctx); err != nil {
		return err
	}
	if err := b.checkLocalGroups(ctx); err != nil {
		return err
	}
	runCtx, cancel := context.WithCancel(context.Background())
	inboxCtx, stopInbox := context.WithCancel(runCtx)
	if err := b.startInbox(inboxCtx); err != nil {
		_ = b.closeSubscribers()
		stopInbox()
		cancel()
		b.inbox.Wait()
		return err
	}
	b.warnLocalGroups(ctx)
	if len(b.cfg.Relay) > 0 {
		if err := b.t.Alive(ctx, b.relaySubscriptions()...); err != nil {
			b.log.Warn("recording the relay as running failed", "err", err)
		}
		for _, topic := range b.cfg.Relay {
			r := &relay{b: b, topic: topic, bound: publishBound(b.cfg.Broker, b.t.Config())}
			b.relays.Go(func() { r.run(runCtx) })
		}
		b.relays.Go(func() { b.heartbeat(runCtx) })
	}
	b.started, b.cancel, b.stopCtx = true, cancel, stopInbox
	b.log.Info("bridge started", "relay", b.cfg.Relay, "receive", b.cfg.Receive, "group", b.cfg.Group)
	return nil
}

// checkLocalGroups fails with broker.ErrNoLocalGroup when a received topic has no
// consumer group here but the relay's.
func (b *Bridge) checkLocalGroups(ctx context.Context) error {
	for _, topic := range b.cfg.Receive {
		groups, err := b.t.SubscribedGroups(ctx, topic)
		if err != nil {
			return fmt.Errorf("broker: %w", err)
		}
		if !slices.ContainsFunc(groups, func(g string) bool { return g != transport.RelayGroup }) {
			return fmt.Errorf("%w: %s (start the workers that read it before the bridge)", broker.ErrNoLocalGroup, topic)
		}
	}
	return nil
}

// Stop stops receiving (the messages being queued are queued and
// acknowledged; those the broker had handed out but not yet to a consumer
// are handed back, for another process or the next start), then the relay
// (its batch in progress commits what it relayed), and returns. Messages
// not relayed yet stay queued for the next relay. It is a no-op on a bridge
// that is not running.
func (b *Bridge) Stop() error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if !b.started {
		return nil
	}
	// The subscribers first, while the consumers still take what is under
	// way: closing them ends the consumers' channels.
	err := b.closeSubscribers()
	b.stopCtx()
	b.inbox.Wait()
	b.cancel()
	b.relays.Wait()
	b.started = false
	b.log.Info("bridge stopped")
	return err
}

func (b *Bridge) closeSubscribers() error {
	var errs []error
	for _, s := range b.subs {
		if err := s.Close(); err != nil {
			errs = append(errs, fmt.Errorf("broker: closing a subscriber: %w", err))
		}
	}
	b.subs = nil
	return errors.Join(errs...)
}

func (b *Bridge) relaySubscriptions() []transport.Subscription {
	subs := make([]transport.Subscription, len(b.cfg.Relay))
	for i, topic := range b.cfg.Relay {
		subs[i] = transport.Subscription{Topic: topic, ConsumerGroup: transport.RelayGroup}
	}
	return subs
}

// heartbeat shows the relay's groups alive, as a router shows its own.
func (b *Bridge) heartbeat(ctx context.Context) {
	tc := b.t.Config()
	tick := time.NewTicker(tc.HeartbeatInterval)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
		hctx, cancel := context.WithTimeout(ctx, tc.StatementTimeout)
		if err := b.t.Alive(hctx, b.relaySubscriptions()...); err != nil && ctx.Err() == nil {
			b.log.Warn("heartbeat of the relay failed; it may be listed as not running", "err", err)
		}
		cancel()
	}
}

// publishBound is how long one publish of br may take.
func publishBound(br broker.Broker, tc transport.Config) time.Duration {
	if b, ok := br.(broker.PublishBound); ok {
		return b.MaxPublishDuration()
	}
	return tc.AttemptTimeout
}

// relayWindow is how long after its claim a relay batch may still start a
// publish that lasts the broker's bound: its transaction lasts at most
// MaxTransactionDuration, the claim and the commit a StatementTimeout
// each, and a second is kept to spare.
func relayWindow(tc transport.Config) time.Duration {
	return tc.MaxTransactionDuration() - 2*tc.StatementTimeout - time.Second
}

// receiveBound bounds the queuing of one received message.
func receiveBound(tc transport.Config) time.Duration { return 2 * tc.StatementTimeout }

// warnLocalGroups says which relayed topics are also queued for groups of
// this database: events read here and elsewhere are fine, but a step moved
// to another service whose old group is still recorded here would run
// twice (and its queue grow for ever if no worker runs it any more).
func (b *Bridge) warnLocalGroups(ctx context.Context) {
	for _, topic := range b.cfg.Relay {
		groups, err := b.t.SubscribedGroups(ctx, topic)
		if err != nil {
			b.log.Warn("could not list the consumer groups of a relayed topic", "topic", topic, "err", err)
			continue
		}
		others := slices.DeleteFunc(groups, func(g string) bool { return g == transport.RelayGroup })
		if len(others) > 0 {
			b.log.Warn("a relayed topic is also queued for consumer groups of this database: if one is a step that now runs in another service, drop it (pgsaga consumers drop GROUP --topic TOPIC --yes), or it runs in both",
				"topic", topic, "groups", others)
		}
	}
}
