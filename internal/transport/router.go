package transport

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"sync"
	"time"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v3/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/pgsaga/pgsaga/internal/telemetry"
)

// HandlerFunc handles one delivery attempt of msg. Its statements go through
// TxFromContext(msg.Context()); its outgoing messages through
// Transport.Publisher of that Tx. Returning an error (or panicking) rolls
// the attempt back; the message is retried after its backoff, or
// dead-lettered (see RetryPolicy). msg.Context() is done when the attempt
// runs out of time (Config.AttemptTimeout).
type HandlerFunc = message.NoPublishHandlerFunc

// Router is a Watermill router whose handlers consume queues: each runs
// Config.Consumers consumers, every delivery attempt in a savepoint of its
// consumer's batch transaction, and the router drains attempts in flight
// before it closes.
type Router struct {
	t      *Transport
	router *message.Router
	log    *slog.Logger
	gate   *gate
	local  *localRoutes // handlers added with InProcess

	mu       sync.Mutex
	handlers map[string]bool
	subs     []Subscription
	started  bool // Run started the Watermill router
	closed   bool

	closeOnce sync.Once
	closeErr  error
	// drainCtx bounds the close's waits: CloseTimeout, and each closer's
	// context (a later Close with a shorter one shortens them).
	drainCtx    context.Context
	drainCancel context.CancelFunc
	drainOnce   sync.Once

	background bool          // Start began a Run (under mu)
	stopped    chan struct{} // closed when the Run that Start began returned
	runErr     error         // what it returned; read after stopped

	ran chan struct{} // closed when the Watermill router's Run returned
}

// NewRouter returns a router for this transport.
func (t *Transport) NewRouter() (*Router, error) {
	// Watermill's Close runs after the drain (see Close), when every attempt
	// has ended or been cut off: what it waits for is the consumers ending
	// their batches, a statement each (rollback or commit). CloseTimeout
	// bounds the drain, not that.
	wr, err := message.NewRouter(message.RouterConfig{CloseTimeout: t.cfg.StatementTimeout + 5*time.Second}, t.wlog)
	if err != nil {
		return nil, fmt.Errorf("transport: creating router: %w", err)
	}
	r := &Router{t: t, router: wr, log: t.log, gate: newGate(), local: &localRoutes{}, handlers: map[string]bool{}, stopped: make(chan struct{}), ran: make(chan struct{})}
	// Outermost: once draining starts, no new message reaches the handlers.
	wr.AddMiddleware(r.gate.middleware(t.log))
	return r, nil
}

// HandlerOption configures one handler.
type HandlerOption func(*handlerOptions)

type handlerOptions struct {
	retry     RetryPolicy
	consumers int
	inProcess bool
	keys      *batchKeys
	load      *BatchLoad
}

// WithRetry sets the handler's retry policy instead of Config.Retry.
func WithRetry(p RetryPolicy) HandlerOption { return func(o *handlerOptions) { o.retry = p } }

// WithConsumers sets how many consumers the handler runs instead of
// Config.Consumers.
func WithConsumers(n int) HandlerOption { return func(o *handlerOptions) { o.consumers = n } }

// handlerOptions applies opts to the transport's defaults and validates
// the result.
func (t *Transport) handlerOptions(opts []HandlerOption) (handlerOptions, error) {
	o := handlerOptions{retry: t.cfg.Retry, consumers: t.cfg.Consumers}
	for _, opt := range opts {
		opt(&o)
	}
	setRetryDefaults(&o.retry)
	if err := validateRetry(o.retry); err != nil {
		return handlerOptions{}, err
	}
	if o.consumers < 1 || o.consumers > 64 {
		return handlerOptions{}, fmt.Errorf("consumers must be between 1 and 64, got %d", o.consumers)
	}
	return o, nil
}

// AddHandler makes h consume topic as consumerGroup; an empty consumerGroup
// means the handler's name, which must be unique in the router. Handlers are
// added before Run. Every
// message published to topic is delivered to each of its consumer groups;
// within a group, to one consumer, wherever it runs.
//
// Each message gets an attempt at a time, in a savepoint of its consumer's
// batch transaction. A failed attempt is rolled back and the message is
// retried after a backoff, outside any transaction, up to
// RetryPolicy.MaxAttempts; then, or at once for a permanent failure (see
// IsPermanent), it goes to pgsaga_dead_letters with the reason. Middleware
// added with AddMiddleware runs outside all of this, once per delivery.
func (r *Router) AddHandler(name, topic, consumerGroup string, h HandlerFunc, opts ...HandlerOption) error {
	if name == "" {
		return errors.New("transport: handler name is required")
	}
	if consumerGroup == "" {
		consumerGroup = name
	}
	if h == nil {
		return fmt.Errorf("transport: handler %s is nil", name)
	}
	if err := ValidateTopic(topic); err != nil {
		return fmt.Errorf("transport: handler %s: %w", name, err)
	}
	if err := ValidateConsumerGroup(consumerGroup); err != nil {
		return fmt.Errorf("transport: handler %s: %w", name, err)
	}
	o, err := r.t.handlerOptions(opts)
	if err != nil {
		return fmt.Errorf("transport: handler %s: %w", name, err)
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed || r.started {
		return ErrRouterClosed
	}
	if r.handlers[name] {
		return fmt.Errorf("transport: handler %s is already registered", name)
	}
	h = r.t.wrap(name, consumerGroup, topic, h)
	r.handlers[name] = true
	r.subs = append(r.subs, Subscription{Topic: topic, ConsumerGroup: consumerGroup})
	rt := route{name: name, topic: topic, group: consumerGroup, h: h, retry: o.retry, keys: o.keys, load: o.load}
	if o.inProcess {
		r.local.add(rt)
	}
	for i := range o.consumers {
		c := newConsumer(r.t, rt, r.gate, r.local)
		handlerName := name
		if o.consumers > 1 {
			handlerName = name + "[" + strconv.Itoa(i) + "]"
		}
		r.router.AddConsumerHandler(handlerName, topic, &subscriber{c: c, group: consumerGroup}, c.deliver)
	}
	return nil
}

// Subscriptions lists the consumer groups the router's handlers consume.
func (r *Router) Subscriptions() []Subscription {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]Subscription(nil), r.subs...)
}

// AddMiddleware adds router-level middleware (metrics, logging). It runs
// outside the attempts and cannot touch their transaction. Its errors and
// panics are logged and change nothing (retries are the queue's); a second
// call of the handler for one message does nothing; a middleware that
// returns without calling the handler costs the message a failed attempt
// (ErrHandlerNotCalled). Work before the handler must take less than
// Config.BatchTimeout, or the batch hands its messages back. A handler's
// run after a call it awaited (Await) and its batch held for is made by
// the batch right before its commit, after the middleware returned.
func (r *Router) AddMiddleware(m ...message.HandlerMiddleware) { r.router.AddMiddleware(m...) }

// Run checks the database, records the router's subscriptions and runs the
// router until ctx is cancelled or Close is called; either way it drains
// before stopping. It returns at once, with the reason, if the database
// cannot be used (see ErrNotUTF8).
func (r *Router) Run(ctx context.Context) error { return r.run(ctx, ctx) }

// run is Run with the subscriptions recorded under startCtx.
func (r *Router) run(startCtx, ctx context.Context) error {
	if err := r.t.Subscribe(startCtx, r.Subscriptions()...); err != nil {
		return err
	}
	if err := r.t.seen(startCtx, r.Subscriptions()); err != nil {
		return err
	}
	r.mu.Lock()
	if r.closed || r.started {
		r.mu.Unlock()
		return ErrRouterClosed
	}
	r.started = true
	r.mu.Unlock()
	stop := context.AfterFunc(ctx, func() {
		if err := r.Close(); err != nil {
			r.log.Error("closing router", "err", err)
		}
	})
	defer stop()
	// The router's own context is never cancelled from outside: cancelling
	// it would stop the subscribers under running attempts.
	defer close(r.ran)
	go r.heartbeat(r.ran)
	return r.router.Run(context.WithoutCancel(ctx))
}

// Running is closed once the router runs. It is never closed if Run fails
// before that: Start waits for both.
func (r *Router) Running() chan struct{} { return r.router.Running() }

// Start runs the router in the background and returns once it runs, or
// with the reason it could not start (the database was refused, a
// subscription failed, ctx ended first). ctx bounds the start only: the
// router runs until Stop, or until it fails (see Stopped). A router starts
// once.
func (r *Router) Start(ctx context.Context) error {
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("transport: starting router: %w", context.Cause(ctx))
	}
	r.mu.Lock()
	if r.background || r.started || r.closed {
		r.mu.Unlock()
		return ErrRouterClosed
	}
	r.background = true
	r.mu.Unlock()
	go func() {
		defer close(r.stopped)
		// Recording the subscriptions may wait (a lock, a full pool): ctx
		// bounds that wait; the run itself goes on until Stop.
		r.runErr = r.run(ctx, context.WithoutCancel(ctx))
	}()
	select {
	case <-r.router.Running():
		return nil
	case <-r.stopped:
		if r.runErr == nil {
			return ErrRouterClosed // closed before it ran
		}
		return fmt.Errorf("transport: starting router: %w", r.runErr)
	case <-ctx.Done():
		_ = r.Close()
		<-r.stopped
		return fmt.Errorf("transport: starting router: %w", context.Cause(ctx))
	}
}

// Stopped is closed once a router begun with Start has stopped, by Stop or
// because it failed; Err then says why. It is never closed for a router
// that was not started with Start.
func (r *Router) Stopped() <-chan struct{} { return r.stopped }

// Err is what the router's run ended with, once Stopped is closed: nil
// after a clean Stop.
func (r *Router) Err() error {
	select {
	case <-r.stopped:
		return r.runErr
	default:
		return nil
	}
}

// Stop drains and stops a router begun with Start (see Close) and returns
// what its run ended with.
func (r *Router) Stop() error { return r.StopContext(context.Background()) }

// StopContext is Stop, draining only until ctx ends (see CloseContext).
func (r *Router) StopContext(ctx context.Context) error {
	err := r.CloseContext(ctx)
	r.mu.Lock()
	background := r.background
	r.mu.Unlock()
	if !background {
		return err
	}
	<-r.stopped
	return errors.Join(err, r.runErr)
}

// Close stops taking new messages and starting new attempts, waits for the
// attempts in flight (up to Config.CloseTimeout) and cuts off the rest as
// if they had timed out (rolled back, retried later), then stops the
// consumers, whose batches commit what they did.
func (r *Router) Close() error { return r.CloseContext(context.Background()) }

// CloseContext is Close, waiting for the attempts and awaited calls in
// flight only until ctx ends or Config.CloseTimeout passes, whichever
// comes first; then it cuts them off as Close does. A second call waits
// for the first, and its ctx, ending, ends the first's waits too.
func (r *Router) CloseContext(ctx context.Context) error {
	r.mu.Lock()
	r.closed = true
	started := r.started
	r.mu.Unlock()
	if !started {
		return nil // nothing runs; Watermill's Close would wait for handlers that never started
	}
	r.drainOnce.Do(func() {
		r.drainCtx, r.drainCancel = context.WithTimeout(context.Background(), r.t.cfg.CloseTimeout)
	})
	// Whichever closer's context ends first ends the waits, the first's or
	// a later one's.
	stop := context.AfterFunc(ctx, r.drainCancel)
	defer stop()
	r.closeOnce.Do(func() {
		ctx := r.drainCtx
		defer r.drainCancel()
		if stuck := r.gate.drain(ctx); len(stuck) > 0 {
			r.log.Error("attempts still running when the close's time ran out (CloseTimeout, or the closer's context); cutting them off",
				"attempts", len(stuck), "close_timeout_ms", telemetry.Millis(r.t.cfg.CloseTimeout))
			for _, a := range stuck {
				a.requestCut()
			}
			r.gate.wait(r.t.cfg.StatementTimeout + 5*time.Second)
		}
		r.closeCalls(ctx)
		// Watermill's Close waits for every added handler: close it only once
		// its Run got them all running; one that gave up has nothing to close.
		select {
		case <-r.router.Running():
		case <-r.ran:
			select {
			case <-r.router.Running():
			default:
				return
			}
		}
		// Watermill's Close fails only when its handlers did not end
		// within its CloseTimeout: a consumer whose statement hangs.
		if err := r.router.Close(); err != nil {
			r.closeErr = fmt.Errorf("%w (%v)", ErrCloseTimeout, err)
		}
	})
	return r.closeErr
}

// closeCalls waits until ctx ends for the awaited calls under way, then
// cancels the rest and waits for their messages to be woken (each waits for
// the end of the batch that handed it back).
func (r *Router) closeCalls(ctx context.Context) {
	if r.gate.calls.waitCtx(ctx) {
		return
	}
	r.log.Info("awaited calls still running at close timeout; cancelling them, their messages are delivered again", "calls", r.gate.calls.running())
	r.gate.calls.cancel()
	if !r.gate.calls.wait(r.t.cfg.MaxTransactionDuration() + r.t.cfg.LockTimeout + r.t.cfg.StatementTimeout) {
		r.log.Error("awaited calls did not end after being cancelled; their messages come back when their park runs out", "calls", r.gate.calls.running())
	}
}

// call runs h, turning a panic into ErrHandlerPanicked.
func call(h HandlerFunc, msg *message.Message) (err error) {
	defer func() {
		if p := recover(); p != nil {
			err = Recovered("handler", p)
		}
	}()
	return h(msg)
}

// subscriber adapts one watermill-sql subscriber to a consumer and to the
// Router's shutdown. The subscription runs on a context that is never
// cancelled (database/sql would roll the batch back under running attempts)
// and stops through Close.
type subscriber struct {
	c     *consumer
	group string

	mu        sync.Mutex
	inner     *wsql.Subscriber
	closed    bool
	closeOnce sync.Once
	closeErr  error
}

func (s *subscriber) Subscribe(ctx context.Context, topic string) (<-chan *message.Message, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed || s.inner != nil {
		return nil, errors.New("transport: a consumer subscribes once")
	}
	t := s.c.t
	if err := t.Subscribe(ctx, Subscription{Topic: topic, ConsumerGroup: s.group}); err != nil {
		return nil, err
	}
	s.c.poll = newPollState(t, topic, s.c.endBatch, s.c.gate.closing)
	// The subscriber never gives up on a message by itself: attempts have
	// their own deadline, and the commit guard refuses to commit under one.
	ack := 2 * t.cfg.MaxTransactionDuration()
	inner, err := wsql.NewSubscriber(s.c, wsql.SubscriberConfig{
		ConsumerGroup:  s.group,
		AckDeadline:    &ack,
		PollInterval:   t.cfg.PollInterval,
		ResendInterval: t.cfg.PollInterval,
		RetryInterval:  t.cfg.RetryInterval,
		BackoffManager: s.c.poll,
		SchemaAdapter:  schemaAdapter{notifyChannel: t.schema.notifyChannel, c: s.c},
		OffsetsAdapter: offsetsAdapter{c: s.c},
	}, commitWatch{LoggerAdapter: t.wlog, c: s.c})
	if err != nil {
		s.c.poll.close()
		return nil, fmt.Errorf("transport: subscribing %s to %s: %w", s.group, topic, err)
	}
	// The consumer rides in the context of every message it claims, for
	// the gate (see admit).
	ch, err := inner.Subscribe(context.WithValue(context.WithoutCancel(ctx), consumerKey{}, s.c), topic)
	if err != nil {
		s.c.poll.close()
		return nil, fmt.Errorf("transport: subscribing %s to %s: %w", s.group, topic, err)
	}
	s.inner = inner
	context.AfterFunc(ctx, func() { _ = s.Close() })
	return ch, nil
}

// Close stops the subscription; every caller returns once it has stopped.
// (The router and the subscription's context both close it, and
// watermill-sql's Close is not safe to run twice at once.)
func (s *subscriber) Close() error {
	s.mu.Lock()
	inner := s.inner
	s.closed = true
	s.mu.Unlock()
	if inner == nil {
		return nil
	}
	s.closeOnce.Do(func() {
		// First end the backoff's wait: the subscriber waits for its polling
		// goroutine, which may be in it.
		s.c.poll.close()
		s.closeErr = inner.Close()
	})
	return s.closeErr
}

// gate admits messages to handlers until drain is called, and keeps track of
// the attempts in flight.
type gate struct {
	mu       sync.Mutex
	draining bool
	inFlight int
	idle     chan struct{} // closed when draining and nothing is in flight
	attempts map[*attemptTx]struct{}
	calls    *callSet // awaited calls under way (see Await)
}

func newGate() *gate {
	return &gate{idle: make(chan struct{}), attempts: map[*attemptTx]struct{}{}, calls: newCallSet()}
}

// middleware is the outermost: it admits each message into its batch (see
// ticket), runs the middleware inside, settles the delivery, and always
// acks. What becomes of a message is recorded in its queue row; a nack
// would make watermill-sql hand the message out again in the same batch,
// so an error (or a panic) of the middleware inside is logged instead.
func (g *gate) middleware(log *slog.Logger) message.HandlerMiddleware {
	return func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			if !g.enter() {
				// Release the message, untouched: its batch commits without
				// it, and it is claimed again later. (Its consumer does not
				// poll again while the router drains.)
				return nil, nil
			}
			defer g.leave()
			tk, run := admit(msg, g.closing())
			if !run {
				return nil, nil
			}
			err := callChain(h, msg)
			if err != nil {
				log.Error("router middleware failed", "message_uuid", msg.UUID, "err", err)
			}
			if tk != nil {
				tk.settle(err)
			}
			return nil, nil
		}
	}
}

// callChain runs the middleware chain h on msg, turning a panic into an
// error.
func callChain(h message.HandlerFunc, msg *message.Message) (err error) {
	defer func() {
		if p := recover(); p != nil {
			err = Recovered("router middleware", p)
		}
	}()
	_, err = h(msg)
	return err
}

// closing reports whether the router is closing.
func (g *gate) closing() bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.draining
}

func (g *gate) enter() bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.draining {
		return false
	}
	g.inFlight++
	return true
}

// hold counts a delivery's held call as in flight (see heldCall), until
// leave: its delivery was admitted, so it counts even while draining.
func (g *gate) hold() {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.inFlight++
}

func (g *gate) leave() {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.inFlight--
	if g.draining && g.inFlight == 0 {
		close(g.idle)
	}
}

// track registers an attempt about to start; it refuses once draining has
// begun.
func (g *gate) track(a *attemptTx) bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.draining {
		return false
	}
	g.attempts[a] = struct{}{}
	return true
}

func (g *gate) untrack(a *attemptTx) {
	g.mu.Lock()
	delete(g.attempts, a)
	g.mu.Unlock()
}

// drain stops admitting messages and waits until ctx ends for those in
// flight; it returns the attempts still running then.
func (g *gate) drain(ctx context.Context) []*attemptTx {
	g.mu.Lock()
	if !g.draining {
		g.draining = true
		if g.inFlight == 0 {
			close(g.idle)
		}
	}
	g.mu.Unlock()
	select {
	case <-g.idle:
		return nil
	case <-ctx.Done():
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	stuck := make([]*attemptTx, 0, len(g.attempts))
	for a := range g.attempts {
		stuck = append(stuck, a)
	}
	return stuck
}

// wait waits up to timeout for the messages in flight, once draining; it
// reports whether they all finished.
func (g *gate) wait(timeout time.Duration) bool {
	timer := time.NewTimer(timeout)
	defer timer.Stop()
	select {
	case <-g.idle:
		return true
	case <-timer.C:
		return false
	}
}
