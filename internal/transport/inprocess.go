package transport

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"

	pub "github.com/pgsaga/pgsaga/saga/delivery"

	"github.com/ThreeDotsLabs/watermill/message"
)

// InProcess lets the handler take in-process deliveries: a message
// published to its topic from a delivery attempt of the same Router is
// handled at once, in a savepoint of the publishing attempt, instead of
// through the queue, and its consumer group gets no queue row for it. The
// handler sees what it would see through the queue (the message, a Tx,
// attempt 1; Config.Intercept applies, router middleware does not), and
// its work commits with the publisher's or not at all. If the in-process
// delivery fails in any way (an error, Instead included, a panic, more
// time than it may take: half of what the publishing attempt has left, at
// most Config.BatchTimeout), its savepoint is rolled back and the message
// is queued for the group as usual, so it is retried, or dead-lettered, as
// if it had never been tried. Other groups of the topic get their rows.
// In-process deliveries nest (a handler delivered in process may publish
// to another in-process handler) up to four deep; deeper, they are queued.
// They are made from a message's first attempt only: a retried publisher
// queues what it publishes, so a handler that breaks its publisher's
// transaction (its connection lost, a COMMIT of its own) costs the
// publisher one attempt, never its message.
//
// It saves a queue row, a claim and a transaction per message, and the
// time between two deliveries. The price: the handler's work and locks join
// the publisher's transaction and hold its batch for as long as it runs,
// so only handlers that touch nothing but the database, quickly, should
// take in-process deliveries. Router handlers only: NewSubscriber and
// HandleInTx refuse it.
func InProcess() HandlerOption { return func(o *handlerOptions) { o.inProcess = true } }

// ErrInProcessBroke: an in-process delivery broke the transaction of the
// attempt that published its message (its connection was lost, it ended
// the transaction, it released a savepoint not its own). The publishing
// attempt fails, as a transient failure; its retry queues the message.
var ErrInProcessBroke = pub.ErrInProcessBroke

// errUnwound: an in-process delivery inside the attempt failed after
// writing, with no savepoint of its own to take its writes back (see
// tryLocal). Whatever its handler returns, the attempt is rolled back and
// run again at once, as the same attempt (handleBy), with that delivery
// queued, or, if it asked for Instead, its replacement run in process in
// its place; it costs no attempt. It comes as an *unwoundError.
var errUnwound = errors.New("transport: an in-process delivery failed after writing; its publisher runs again")

// unwoundError is errUnwound with the plan of the run again.
type unwoundError struct {
	plan  *localPlan
	cause error
}

func (e *unwoundError) Error() string        { return errUnwound.Error() + ": " + e.cause.Error() }
func (e *unwoundError) Unwrap() []error      { return []error{errUnwound, e.cause} }
func (e *unwoundError) Is(target error) bool { return target == errUnwound }

// localPlan is what the in-process deliveries of an attempt run again
// after an unwound one do: by route and message, queue it, or run its
// Instead replacement. After maxUnwinds runs again, everything is queued.
type localPlan struct {
	mu      sync.Mutex
	runs    int
	instead map[string]HandlerFunc // nil: queued
	done    map[string]bool
}

// maxUnwinds bounds how many times an attempt runs again for unwound
// in-process deliveries before it queues them all.
const maxUnwinds = 3

func planKey(r route, msg *message.Message) string { return r.name + "\x00" + msg.UUID }

// again counts a run again of the attempt p is for, and returns p.
func (p *localPlan) again() *localPlan {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.runs++
	return p
}

// of says what the delivery of msg to r does on this run: queued (no
// in-process delivery at all), or run in process: by r's handler, or by
// replacement (not nil), the Instead its last try asked for.
func (p *localPlan) of(r route, msg *message.Message) (replacement HandlerFunc, queued bool) {
	if p == nil {
		return nil, false
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.runs > maxUnwinds {
		return nil, true
	}
	k := planKey(r, msg)
	if !p.done[k] {
		return nil, false
	}
	return p.instead[k], p.instead[k] == nil
}

// unwind notes how the delivery of msg to r failed after writing: queue it
// next time, or run replacement in its place.
func (p *localPlan) unwind(r route, msg *message.Message, replacement HandlerFunc) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.done == nil {
		p.done, p.instead = map[string]bool{}, map[string]HandlerFunc{}
	}
	k := planKey(r, msg)
	if p.done[k] {
		replacement = nil // its replacement failed too: queued
	}
	p.done[k], p.instead[k] = true, replacement
}

type planKeyCtx struct{}

// planFrom is the plan of a message run again after an unwound in-process
// delivery, or a new one.
func planFrom(ctx context.Context) *localPlan {
	if p, ok := ctx.Value(planKeyCtx{}).(*localPlan); ok {
		return p
	}
	return &localPlan{}
}

// withPlan is msg for its attempt's run again with p.
func withPlan(msg *message.Message, p *localPlan) *message.Message {
	m := msg.Copy()
	m.SetContext(context.WithValue(msg.Context(), planKeyCtx{}, p))
	return m
}

// errInProcessRouterOnly: InProcess given where there is no router.
var errInProcessRouterOnly = errors.New("InProcess applies to Router handlers only")

type inProcessTopicKey struct{}

// TopicFromContext returns the topic of the message whose handler runs
// under ctx: delivered through the queue (as Watermill's
// message.SubscribeTopicFromCtx says) or in process (see InProcess), or ""
// outside a handler.
func TopicFromContext(ctx context.Context) string {
	if topic, ok := ctx.Value(inProcessTopicKey{}).(string); ok {
		return topic
	}
	return message.SubscribeTopicFromCtx(ctx)
}

// InProcessFromContext reports whether the handler running under ctx
// handles an in-process delivery (see InProcess): a message that exists
// only in the publisher's transaction, not yet committed.
func InProcessFromContext(ctx context.Context) bool {
	_, ok := ctx.Value(inProcessTopicKey{}).(string)
	return ok
}

// maxLocalDepth bounds how deep in-process deliveries nest.
const maxLocalDepth = 4

// localRoutes are a router's handlers that take in-process deliveries, by
// topic. Added before the router runs; read by its attempts.
type localRoutes struct {
	mu      sync.RWMutex
	byTopic map[string][]route
}

func (l *localRoutes) add(r route) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.byTopic == nil {
		l.byTopic = map[string][]route{}
	}
	for _, have := range l.byTopic[r.topic] {
		if have.group == r.group {
			return // one delivery per group
		}
	}
	l.byTopic[r.topic] = append(l.byTopic[r.topic], r)
}

func (l *localRoutes) of(topic string) []route {
	if l == nil {
		return nil
	}
	l.mu.RLock()
	defer l.mu.RUnlock()
	return l.byTopic[topic]
}

// minLocalBudget: an attempt with less time left than this delivers
// nothing in process.
const minLocalBudget = 20 * time.Millisecond

// deliverLocally offers each of msgs to the in-process handlers of topic
// (routes) and returns, for each message, the groups that handled it. An
// error means a's transaction cannot go on (the attempt fails).
func (a *attemptTx) deliverLocally(t *Transport, routes []route, msgs []*message.Message) ([][]string, error) {
	handled := make([][]string, len(msgs))
	for i, m := range msgs {
		for _, r := range routes {
			ok, err := a.runLocal(t, r, m)
			if err != nil {
				return nil, err
			}
			if ok {
				handled[i] = append(handled[i], r.group)
			}
		}
	}
	return handled, nil
}

// runLocal delivers msg to r inside a (see InProcess) and reports whether
// r handled it. false with a nil error: nothing of the try is left, and
// the message is to be queued for r's group. An error: a's transaction
// cannot go on.
func (a *attemptTx) runLocal(t *Transport, r route, msg *message.Message) (bool, error) {
	if !a.first || a.depth >= maxLocalDepth || a.c.busy() {
		// A retry, too deep, or a result set of the publisher still open
		// on the connection (a Publish while iterating rows): queued.
		return false, nil
	}
	h := r.h
	switch replacement, queued := a.plan.of(r, msg); {
	case queued:
		return false, nil // it unwound this attempt before: queued
	case replacement != nil:
		h = t.wrap(r.name, r.group, r.topic, replacement)
	}
	left := time.Until(a.deadline)
	if left < minLocalBudget {
		return false, nil
	}
	deadline := time.Now().Add(min(left/2, t.cfg.BatchTimeout))
	out, err := a.tryLocal(r, h, msg, deadline)
	out, err = awaitInline(out, err, deadline, func() (attemptEnd, error) { return a.tryLocal(r, h, afterAwait(msg), deadline) })
	var instead *InsteadError
	if out == failed && errors.As(err, &instead) {
		out, err = a.tryLocal(r, t.wrap(r.name, r.group, r.topic, instead.Handler), msg, deadline)
	}
	switch out {
	case kept:
		return true, nil
	case refused: // the publisher's own queued writes failed: its error
		return false, err
	case unwound:
		t.log.Debug("transport: in-process delivery failed after writing; its publisher's attempt runs again, its messages queued",
			"handler", r.name, "topic", r.topic, "message_uuid", msg.UUID, "reason", err)
		return false, err
	case failed:
		t.log.Debug("transport: in-process delivery failed; queued instead",
			"handler", r.name, "topic", r.topic, "message_uuid", msg.UUID, "reason", err)
		return false, nil
	}
	// The cause is told, not wrapped: it is the in-process handler's, and
	// must not make the publisher's failure permanent.
	a.mu.Lock()
	defer a.mu.Unlock()
	a.brokenBy = fmt.Errorf("%w (delivery of %s to %s: %v)", ErrInProcessBroke, msg.UUID, r.name, err)
	return false, a.brokenBy
}

// tryLocal runs h on a copy of msg in a's transaction, as an attempt
// nested in a, without a savepoint of its own: kept (its work is in a),
// failed (nothing of it reached the server; a goes on), unwound (it failed
// after writing: there is nothing to take its writes back but a's own
// savepoint, so a is marked unwound, see errUnwound), broken (a cannot go
// on) or refused (not started: a cannot go on, by its own doing: what a
// queued failed, or a is over). Failures are rare, and a savepoint and its
// release for every in-process delivery were two statements each.
func (a *attemptTx) tryLocal(r route, h HandlerFunc, msg *message.Message, deadline time.Time) (attemptEnd, error) {
	ctx := context.Background()
	ch := &attemptTx{c: a.c, tx: a.tx, d: a.d, expired: a.expired, cut: make(chan struct{}), local: a.local, first: true, depth: a.depth + 1, plan: a.plan, parent: a}
	ch.rowsCtx, ch.cancelRows = context.WithCancel(context.Background())
	// a's queued writes go first, so the handler sees them.
	a.mu.Lock()
	err := a.usable()
	if err == nil && len(a.queue) > 0 {
		a.touched.Store(true)
		stmts := a.queue
		a.queue = nil
		if err = a.c.send(ctx, stmts...); err != nil {
			a.sendErr = fmt.Errorf("transport: sending queued statements: %w", err)
			err = a.sendErr
		}
	}
	if err == nil {
		a.child.Store(ch)
	}
	a.mu.Unlock()
	if err != nil {
		return refused, err
	}
	defer a.child.Store(nil)
	herr := ch.run(copyForLocal(msg, r.topic), 1, deadline, h)
	// What ends the nested attempt runs only while a is not over: once a
	// is cut off, its own rollback takes everything with it.
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.over {
		return broken, fmt.Errorf("%w (%w)", ErrAttemptOver, herr)
	}
	if ch.touched.Load() {
		// What it sent is a's now: a has something to roll back.
		a.touched.Store(true)
	}
	if herr == nil {
		if herr = ch.keepLocal(a); herr == nil {
			ch.mu.Lock()
			a.hooks = append(a.hooks, ch.takeHooks()...)
			a.batched = append(a.batched, ch.batched...)
			ch.batched = nil
			ch.mu.Unlock()
			return kept, nil
		}
	}
	ch.dropQueued(queueMark{})
	if ch.ended {
		return broken, fmt.Errorf("%w (%w)", ErrTransactionEnded, herr)
	}
	if !ch.touched.Load() {
		// Nothing of it reached the server: nothing to take back.
		return failed, herr
	}
	ch.mu.Lock()
	passedOn := ch.unwound != nil
	ch.mu.Unlock()
	if !passedOn {
		// Its own failure (not one of a delivery nested in it, which is
		// in the plan already, and whose Instead is not its own).
		var replacement HandlerFunc
		if instead := (*InsteadError)(nil); errors.As(herr, &instead) && !errors.Is(herr, errUnwound) {
			replacement = instead.Handler
		}
		a.plan.unwind(r, msg, replacement)
	}
	if a.unwound == nil {
		a.unwound = &unwoundError{plan: a.plan, cause: fmt.Errorf("delivery of %s to %s: %w", msg.UUID, r.name, herr)}
	}
	return unwound, a.unwound
}

// keepLocal hands what the nested attempt queued to its publisher a, to go
// with a's next statement: with no savepoint between them, a's work and
// its own are one. It runs after revoke; the caller holds a.mu.
func (ch *attemptTx) keepLocal(a *attemptTx) error {
	ch.mu.Lock()
	defer ch.mu.Unlock()
	stmts, err := ch.release()
	if err != nil {
		return err
	}
	a.queue = append(a.queue, stmts...)
	return nil
}

// copyForLocal is the message an in-process handler gets: a copy, payload
// included, so that what it does to it does not change what is queued for
// other groups, whose context says its topic (TopicFromContext).
func copyForLocal(msg *message.Message, topic string) *message.Message {
	m := msg.Copy()
	ctx := context.WithValue(context.Background(), inProcessTopicKey{}, topic)
	if AwaitedFromContext(msg.Context()) {
		ctx = context.WithValue(ctx, afterAwaitKey{}, true)
	}
	m.SetContext(ctx)
	m.Payload = append(message.Payload(nil), msg.Payload...)
	if m.Metadata == nil {
		m.Metadata = message.Metadata{}
	}
	return m
}

// publishLocal publishes msgs from attempt a: each is offered to the
// in-process handlers of topic first, then queued for the groups that did
// not handle it, messages with the same such groups in one insert, in
// order.
func (p *txPublisher) publishLocal(a *attemptTx, topic string, routes []route, msgs []*message.Message) error {
	handled, err := a.deliverLocally(p.t, routes, msgs)
	if err != nil {
		return err
	}
	for start := 0; start < len(msgs); {
		end := start + 1
		for end < len(msgs) && sameGroups(handled[end], handled[start]) {
			end++
		}
		if err := p.insert(a, topic, msgs[start:end], handled[start]); err != nil {
			return err
		}
		start = end
	}
	return nil
}

// insert queues msgs on a for every group of topic but skip.
func (p *txPublisher) insert(a *attemptTx, topic string, msgs []*message.Message, skip []string) error {
	q, err := p.t.schema.InsertQuery(topic, msgs)
	if err != nil {
		return fmt.Errorf("transport: publishing to %s: %w", topic, err)
	}
	return a.queuePublishQuery(q.Args, skip)
}

func sameGroups(a, b []string) bool { return strings.Join(a, "\x00") == strings.Join(b, "\x00") }
