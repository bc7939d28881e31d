package transport

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgerrcode"

	"github.com/pgsaga/pgsaga/internal/pgerr"
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
var ErrInProcessBroke = errors.New("transport: an in-process delivery broke its publisher's transaction")

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
	left := time.Until(a.deadline)
	if left < minLocalBudget {
		return false, nil
	}
	deadline := time.Now().Add(min(left/2, t.cfg.BatchTimeout))
	out, err := a.tryLocal(r.h, msg, r.topic, deadline)
	out, err = awaitInline(out, err, deadline, func() (attemptEnd, error) { return a.tryLocal(r.h, afterAwait(msg), r.topic, deadline) })
	var instead *InsteadError
	if out == failed && errors.As(err, &instead) {
		out, err = a.tryLocal(t.wrap(r.name, r.group, r.topic, instead.Handler), msg, r.topic, deadline)
	}
	switch out {
	case kept:
		return true, nil
	case refused: // the publisher's own queued writes failed: its error
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

// tryLocal runs h on a copy of msg in a savepoint of a, as an attempt
// nested in a: kept (its work is in a), failed (rolled back; a goes on),
// broken (a cannot go on) or refused (not started: a cannot go on, by its
// own doing: what a queued failed, or a is over).
func (a *attemptTx) tryLocal(h HandlerFunc, msg *message.Message, topic string, deadline time.Time) (attemptEnd, error) {
	ctx := context.Background()
	sp := "pgsaga_local_" + strconv.Itoa(a.depth+1)
	ch := &attemptTx{c: a.c, tx: a.tx, d: a.d, expired: a.expired, cut: make(chan struct{}), local: a.local, first: true, depth: a.depth + 1}
	ch.rowsCtx, ch.cancelRows = context.WithCancel(context.Background())
	// a's queued writes go first, so the handler sees them, in the round
	// trip that opens the savepoint.
	a.mu.Lock()
	err := a.usable()
	if err == nil {
		a.touched.Store(true)
		stmts := append(a.queue, stmt{"opening an in-process delivery", "SAVEPOINT " + sp, nil})
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
	herr := ch.run(copyForLocal(msg, topic), 1, deadline, h)
	// What ends the nested attempt runs only while a is not over: once a
	// is cut off, its own rollback takes the savepoint with everything else.
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.over {
		return broken, fmt.Errorf("%w (%w)", ErrAttemptOver, herr)
	}
	if herr == nil {
		if herr = ch.keepLocal(ctx, sp); herr == nil {
			ch.mu.Lock()
			a.hooks = append(a.hooks, ch.takeHooks()...)
			a.batched = append(a.batched, ch.batched...)
			ch.batched = nil
			ch.mu.Unlock()
			return kept, nil
		}
	}
	ch.dropQueued(queueMark{})
	rerr := a.c.rollbackTo(ctx, "rolling back an in-process delivery", "ROLLBACK TO SAVEPOINT "+sp+"; RELEASE SAVEPOINT "+sp)
	switch {
	case rerr != nil:
		return broken, errors.Join(herr, rerr)
	case ch.ended:
		return broken, fmt.Errorf("%w (%w)", ErrTransactionEnded, herr)
	}
	return failed, herr
}

// keepLocal sends what the nested attempt queued and releases its
// savepoint, in one round trip. It runs after revoke.
func (a *attemptTx) keepLocal(ctx context.Context, sp string) error {
	a.mu.Lock()
	defer a.mu.Unlock()
	stmts, err := a.release(stmt{"keeping an in-process delivery", "RELEASE SAVEPOINT " + sp, nil})
	if err != nil {
		return err
	}
	err = a.c.send(ctx, stmts...)
	if pgerr.Is(err, pgerrcode.InvalidSavepointSpecification) { // the handler released or rolled back past it
		a.ended = true
		return fmt.Errorf("%w: %w", ErrTransactionEnded, err)
	}
	return err
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
