package natsjs

import (
	"context"
	"errors"
	"sync"
	"time"

	wmjs "github.com/ThreeDotsLabs/watermill-nats/v2/pkg/jetstream"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/nats-io/nats.go/jetstream"
)

// What watermill-nats' JetStream subscriber does not do, this file adds
// around it (each pinned by a test in steps/broker):
//
//   - Stopping with messages buffered. Closing the subscriber closes its
//     output channel, then drains the JetStream consumer, whose buffered
//     messages reach a handler that may send to the closed channel (a
//     panic, once in two) or wait for an ack that is never sent. A gate
//     between the consumer and watermill's handler is closed first: it
//     waits for the deliveries under way (acked as usual) and hands every
//     later one back (nak), so that the broker delivers it again at once
//     to a consumer that runs.
//   - A durable consumer deleted under a running subscriber (an operator's
//     mistake, a stream deleted and created again). nats.go stops
//     consuming and watermill-nats never says so: the group would receive
//     nothing, silently. The consumer is created again (its stream too) and
//     consumed again, after a backoff while that fails.
//   - Any other end of consuming that nobody asked for: a message another
//     client published with no data and a Status header of 400 passes
//     for the server's and stops nats.go's consumer. It is consumed
//     again at once (the message that stopped it is met again after each
//     AckWait, and stops it again; the messages after it flow). (Another
//     status uses up the request instead: see pullExpiry.)

// subscriber is watermill-nats' JetStream subscriber with a gate.
type subscriber struct {
	*wmjs.Subscriber
	gate *gate
	done func()
}

var _ message.Subscriber = (*subscriber)(nil)

// Close closes the gate, then the subscriber.
func (s *subscriber) Close() error {
	s.gate.close()
	err := s.Subscriber.Close()
	s.done()
	return err
}

// gate lets deliveries through to watermill's handler until closed.
type gate struct {
	mu     sync.RWMutex
	closed bool
}

func (g *gate) wrap(h jetstream.MessageHandler) jetstream.MessageHandler {
	return func(m jetstream.Msg) {
		g.mu.RLock()
		defer g.mu.RUnlock()
		if g.closed {
			_ = m.Nak()
			return
		}
		h(m)
	}
}

// close waits for the deliveries under way, then refuses the rest.
func (g *gate) close() {
	g.mu.Lock()
	g.closed = true
	g.mu.Unlock()
}

func (g *gate) isClosed() bool {
	g.mu.RLock()
	defer g.mu.RUnlock()
	return g.closed
}

// consumer is a group's durable consumer of a topic, consumed through the
// gate and created again should it be deleted.
type consumer struct {
	jetstream.Consumer
	b     *Broker
	js    jetstream.JetStream
	group string
	topic string
	gate  *gate
}

// Consume consumes through the gate, resuming on a new consumer when this
// one is deleted.
func (c *consumer) Consume(h jetstream.MessageHandler, opts ...jetstream.PullConsumeOpt) (jetstream.ConsumeContext, error) {
	r := &resuming{c: c, handler: c.gate.wrap(h), opts: opts, closed: make(chan struct{})}
	if err := r.consume(c.Consumer); err != nil {
		return nil, err
	}
	return r, nil
}

// resuming is a ConsumeContext that outlives the consumer's deletion.
type resuming struct {
	c       *consumer
	handler jetstream.MessageHandler
	opts    []jetstream.PullConsumeOpt

	mu       sync.Mutex
	current  jetstream.ConsumeContext
	stopping bool
	resuming bool // a look at the consumer, or its creation, is under way
	closed   chan struct{}
	once     sync.Once
}

func (r *resuming) consume(cons jetstream.Consumer) error {
	opts := append(append([]jetstream.PullConsumeOpt(nil), r.opts...), jetstream.ConsumeErrHandler(r.onError))
	cc, err := cons.Consume(r.handler, opts...)
	if err != nil {
		return err
	}
	// The new one is current and no resuming is under way, at once: should
	// it end before its watch below runs, the watch resumes it.
	r.mu.Lock()
	r.current, r.resuming = cc, false
	stopping := r.stopping
	r.mu.Unlock()
	if stopping { // stopped while resuming
		cc.Drain()
	}
	go func() {
		<-cc.Closed()
		r.ended(cc)
	}()
	return nil
}

// ended consumes again when cc, ended, is the current one and nobody asked
// it to end: not stopping, not resuming (which ends the old one itself,
// or, from onError, looks again once done).
func (r *resuming) ended(cc jetstream.ConsumeContext) {
	if r.c.gate.isClosed() { // the subscriber is closing: its consumes end
		return
	}
	r.mu.Lock()
	if r.stopping || cc != r.current || r.resuming {
		r.mu.Unlock()
		return
	}
	r.resuming = true
	r.mu.Unlock()
	r.c.b.log.Warn("consuming from the broker ended unasked; consuming again", "group", r.c.group, "topic", r.c.topic)
	r.resume()
}

// onError resumes on a new consumer when the current one is gone: nats.go
// says so (consumer deleted), or an error of the consume loop (missed
// heartbeats, no responders: what a deleted stream leaves) is followed by
// a look at the consumer, which finds it missing.
func (r *resuming) onError(cc jetstream.ConsumeContext, err error) {
	r.mu.Lock()
	if r.stopping || cc != r.current || r.resuming {
		r.mu.Unlock()
		return
	}
	gone := errors.Is(err, jetstream.ErrConsumerDeleted) || errors.Is(err, jetstream.ErrConsumerNotFound)
	r.resuming = true
	r.mu.Unlock()
	go func() {
		if !gone && !r.missing() {
			r.mu.Lock()
			r.resuming = false
			r.mu.Unlock()
			select {
			case <-cc.Closed(): // it ended meanwhile (a bad request, say)
				r.ended(cc)
			default:
			}
			return
		}
		r.c.b.log.Warn("the group's consumer at the broker is gone; creating it again", "group", r.c.group, "topic", r.c.topic, "err", err)
		r.resume()
	}()
}

// missing reports whether the consumer (or its stream) no longer exists.
func (r *resuming) missing() bool {
	ctx, cancel := context.WithTimeout(context.Background(), r.c.b.cfg.PublishTimeout)
	defer cancel()
	stream, err := r.c.js.StreamNameBySubject(ctx, r.c.topic)
	if errors.Is(err, jetstream.ErrStreamNotFound) {
		return true
	}
	if err != nil {
		return false // the broker does not answer: nats.go retries
	}
	_, err = r.c.js.Consumer(ctx, stream, ConsumerName(r.c.group, r.c.topic))
	return errors.Is(err, jetstream.ErrConsumerNotFound)
}

func (r *resuming) resume() {
	wait := NakDelayDefault
	for {
		r.mu.Lock()
		stopping := r.stopping
		r.mu.Unlock()
		if stopping || r.c.gate.isClosed() {
			return
		}
		ctx, cancel := context.WithTimeout(context.Background(), r.c.b.cfg.PublishTimeout)
		cons, err := r.c.b.ensureConsumer(ctx, r.c.js, r.c.group, r.c.topic)
		cancel()
		if err == nil {
			r.mu.Lock()
			old := r.current
			r.mu.Unlock()
			if old != nil {
				old.Stop() // what it still had buffered is delivered again
			}
			if err = r.consume(cons); err == nil { // which ends the resuming
				r.c.b.log.Info("consuming again", "group", r.c.group, "topic", r.c.topic)
				return
			}
		}
		r.c.b.log.Warn("could not create the group's consumer again; trying again", "group", r.c.group, "topic", r.c.topic, "wait", wait, "err", err)
		time.Sleep(wait)
		wait = min(2*wait, MaxNakDelay)
	}
}

func (r *resuming) end(stop func(jetstream.ConsumeContext)) {
	r.mu.Lock()
	r.stopping = true
	cc := r.current
	r.mu.Unlock()
	if cc != nil {
		stop(cc)
		go func() {
			<-cc.Closed()
			r.once.Do(func() { close(r.closed) })
		}()
		return
	}
	r.once.Do(func() { close(r.closed) })
}

func (r *resuming) Stop()                   { r.end(jetstream.ConsumeContext.Stop) }
func (r *resuming) Drain()                  { r.end(jetstream.ConsumeContext.Drain) }
func (r *resuming) Closed() <-chan struct{} { return r.closed }
