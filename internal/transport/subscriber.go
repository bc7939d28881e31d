package transport

import (
	"context"
	"errors"
	"fmt"
	"sync"

	"github.com/ThreeDotsLabs/watermill/message"
)

// Subscriber is a plain Watermill message.Subscriber of one consumer group,
// for code that needs one: Watermill's tooling, its conformance suite.
// Handle messages with a Router: its handlers run in the delivery's
// transaction, while the reader of a Subscriber's channel gets the message
// alone, and nothing it writes commits with the ack.
//
// Each Subscribe runs a Router whose one handler hands every message it
// delivers to the returned channel and waits for its answer, one message
// at a time per consumer (see WithConsumers):
//
//   - Ack keeps the delivery: the message leaves its queue when the
//     consumer's batch commits (delivery is at least once: a batch that
//     fails to commit delivers its messages again);
//   - Nack rolls the delivery back as a failed attempt: the message is
//     retried after its backoff and dead-lettered after the last attempt of
//     the RetryPolicy (where most Watermill subscribers redeliver a nacked
//     message without limit);
//   - no answer within Config.AttemptTimeout of the delivery is a failed
//     attempt too (ErrAttemptTimeout).
//
// Its dead letters name the consumer group as their handler.
//
// While a message waits for its answer, its consumer's batch transaction
// stays open: it holds a connection and the batch's other messages (up to
// Config.BatchSize), which the group's other consumers skip.
//
// A message is queued for the consumer groups subscribed to its topic when
// it is published: one published before the group's subscription of the
// topic was recorded (by SubscribeInitialize, Subscribe or
// Transport.Subscribe) is never delivered to it.
type Subscriber struct {
	t     *Transport
	group string
	opts  []HandlerOption

	mu     sync.Mutex
	closed bool
	subs   map[*subscription]struct{}
}

var (
	_ message.Subscriber           = (*Subscriber)(nil)
	_ message.SubscribeInitializer = (*Subscriber)(nil)
)

// NewSubscriber returns a Subscriber of consumerGroup (required). opts
// configure the handler of each Subscribe, as for Router.AddHandler:
// WithRetry sets how often a message is retried (each Nack counts),
// WithConsumers how many messages of a topic are out at once.
func (t *Transport) NewSubscriber(consumerGroup string, opts ...HandlerOption) (*Subscriber, error) {
	if err := ValidateConsumerGroup(consumerGroup); err != nil {
		return nil, fmt.Errorf("transport: new subscriber: %w", err)
	}
	o, err := t.handlerOptions(opts)
	if err != nil {
		return nil, fmt.Errorf("transport: subscriber %s: %w", consumerGroup, err)
	}
	if o.inProcess {
		return nil, fmt.Errorf("transport: subscriber %s: %w", consumerGroup, errInProcessRouterOnly)
	}
	return &Subscriber{t: t, group: consumerGroup, opts: append([]HandlerOption(nil), opts...), subs: map[*subscription]struct{}{}}, nil
}

// SubscribeInitialize records the consumer group's subscription of topic
// (see Transport.Subscribe): every message published to topic from then on
// is kept for the group until one of its consumers handles it. It gives up
// after Config.LockTimeout + Config.StatementTimeout.
func (s *Subscriber) SubscribeInitialize(topic string) error {
	if err := s.usable(topic); err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(context.Background(), s.t.cfg.LockTimeout+s.t.cfg.StatementTimeout)
	defer cancel()
	return s.t.Subscribe(ctx, Subscription{Topic: topic, ConsumerGroup: s.group})
}

// Subscribe records the group's subscription of topic and consumes it
// until ctx is done or the Subscriber is closed, handing its messages out
// on the returned channel; it fails if the consumer cannot start (see
// Router.Start). Each call consumes on its own, with its own channel. When
// the subscription stops, a message being handed out or awaiting its
// answer counts as a failed attempt (as for Nack), the consumer's batch
// commits what was acked, and the channel is closed.
//
// A message's context carries ctx's values and no transaction
// (TxFromContext finds none); it is done once the message is answered, its
// attempt has timed out or the subscription stops.
func (s *Subscriber) Subscribe(ctx context.Context, topic string) (<-chan *message.Message, error) {
	if err := s.usable(topic); err != nil {
		return nil, err
	}
	r, err := s.t.NewRouter()
	if err != nil {
		return nil, err
	}
	sub := &subscription{group: s.group, ctx: ctx, router: r, out: make(chan *message.Message), stopping: make(chan struct{})}
	if err := r.AddHandler(s.group, topic, s.group, sub.handle, s.opts...); err != nil {
		return nil, err
	}
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil, ErrSubscriberClosed
	}
	s.subs[sub] = struct{}{}
	s.mu.Unlock()

	startErr := r.Start(ctx)
	s.mu.Lock()
	closed := s.closed
	s.mu.Unlock()
	if closed {
		_ = s.end(sub, ErrSubscriberClosed) // Close stopped it while it started
		return nil, ErrSubscriberClosed
	}
	if startErr != nil {
		_ = s.end(sub, startErr)
		return nil, fmt.Errorf("transport: subscribing %s to %s: %w", s.group, topic, startErr)
	}
	unwatch := context.AfterFunc(ctx, func() {
		if err := s.end(sub, context.Cause(ctx)); err != nil {
			s.t.log.Error("transport: stopping a subscription", "consumer_group", s.group, "topic", topic, "err", err)
		}
	})
	sub.setUnwatch(unwatch)
	return sub.out, nil
}

// Close stops every subscription of the Subscriber (see Subscribe) and
// returns once their channels are closed. Subscribe and SubscribeInitialize
// then return ErrSubscriberClosed. Closing again does nothing.
func (s *Subscriber) Close() error {
	s.mu.Lock()
	s.closed = true
	subs := make([]*subscription, 0, len(s.subs))
	for sub := range s.subs {
		subs = append(subs, sub)
	}
	s.mu.Unlock()
	errs := make([]error, len(subs))
	var wg sync.WaitGroup
	for i, sub := range subs {
		wg.Go(func() { errs[i] = s.end(sub, ErrSubscriberClosed) })
	}
	wg.Wait()
	return errors.Join(errs...)
}

// usable checks topic and that the Subscriber is open.
func (s *Subscriber) usable(topic string) error {
	if err := ValidateTopic(topic); err != nil {
		return fmt.Errorf("transport: subscriber %s: %w", s.group, err)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return ErrSubscriberClosed
	}
	return nil
}

// end stops sub for reason and forgets it once its channel is closed.
func (s *Subscriber) end(sub *subscription, reason error) error {
	err := sub.stop(reason)
	s.mu.Lock()
	delete(s.subs, sub)
	s.mu.Unlock()
	return err
}

// subscription is one Subscribe: a router whose handler hands messages out
// on out.
type subscription struct {
	group  string
	ctx    context.Context // Subscribe's: the values of the messages' contexts
	router *Router
	out    chan *message.Message
	// stopping is closed when the subscription stops; reason says why.
	stopping chan struct{}
	reason   error

	mu      sync.Mutex
	done    bool           // handlers hand out nothing any more: out is closing
	handing sync.WaitGroup // handlers running
	unwatch func() bool    // stops watching Subscribe's context

	stopOnce sync.Once
	stopErr  error
}

// errNacked is the failure of an attempt whose message was nacked.
var errNacked = errors.New("transport: the message was nacked")

// handle is the router's handler: it hands a copy of msg out and waits for
// its answer (see Subscriber).
func (s *subscription) handle(msg *message.Message) error {
	if !s.enter() {
		return s.stopped()
	}
	defer s.handing.Done()
	attempt := msg.Context() // done when the attempt runs out of time
	ctx, cancel := context.WithCancel(s.ctx)
	defer cancel()
	out := msg.Copy()
	out.SetContext(ctx)
	select {
	case <-s.stopping:
		return s.stopped()
	default:
	}
	select {
	case s.out <- out:
	case <-s.stopping:
		return s.stopped()
	case <-attempt.Done():
		return context.Cause(attempt)
	}
	select {
	case <-out.Acked():
		return nil
	case <-out.Nacked():
		return errNacked
	case <-s.stopping:
		select {
		case <-out.Acked(): // acked as the subscription stopped
			return nil
		default:
			return s.stopped()
		}
	case <-attempt.Done():
		return context.Cause(attempt)
	}
}

// enter counts a handler in, unless the subscription has stopped.
func (s *subscription) enter() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.done {
		return false
	}
	s.handing.Add(1)
	return true
}

// stopped is a handler's failure once the subscription stops.
func (s *subscription) stopped() error {
	return fmt.Errorf("transport: subscriber %s stopped before the message was acked: %w", s.group, s.reason)
}

func (s *subscription) setUnwatch(f func() bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.done {
		f()
		return
	}
	s.unwatch = f
}

// stop stops the subscription: its handlers give up their messages, its
// router drains and stops, and out is closed once no handler can send on
// it. Every caller returns once that is done, with the router's error.
func (s *subscription) stop(reason error) error {
	s.stopOnce.Do(func() {
		s.reason = reason
		close(s.stopping)
		s.stopErr = s.router.Stop()
		if errors.Is(s.stopErr, ErrRouterClosed) {
			s.stopErr = nil // it never ran: Subscribe reports why
		}
		s.mu.Lock()
		s.done = true
		unwatch := s.unwatch
		s.mu.Unlock()
		if unwatch != nil {
			unwatch()
		}
		// A handler cut off at its deadline may outlive the router.
		s.handing.Wait()
		close(s.out)
	})
	return s.stopErr
}
