package transport

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"runtime/debug"
	"strconv"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
)

// HandlerFunc handles one delivery attempt of msg. Its statements go through
// TxFromContext(msg.Context()); its outgoing messages through
// Transport.Publisher of that Tx. Returning an error (or panicking) rolls the
// attempt back and nacks the message, which is redelivered.
type HandlerFunc func(msg *message.Message) error

// Errors callers can branch on.
var (
	// ErrHandlerPanicked wraps the value of a handler's panic; the attempt
	// was rolled back and the message nacked.
	ErrHandlerPanicked = errors.New("transport: handler panicked")
	// ErrNoTransaction is returned when a handler runs on a message that did
	// not come from a watermill-sql subscriber.
	ErrNoTransaction = errors.New("transport: message carries no subscriber transaction")
	// ErrClosing is returned for messages that arrive while the router
	// drains. It wraps context.Canceled, which Watermill does not log as a
	// handler failure.
	ErrClosing = fmt.Errorf("transport: router is closing: %w", context.Canceled)
	// ErrRouterClosed is returned when adding handlers to a closed router.
	ErrRouterClosed = errors.New("transport: router is closed")
)

// Router is a Watermill router whose handlers run inside a savepoint per
// delivery attempt and that drains in-flight handlers before it closes.
type Router struct {
	t      *Transport
	router *message.Router
	log    *slog.Logger
	gate   *gate

	mu       sync.Mutex
	handlers map[string]bool

	closeOnce sync.Once
	closeErr  error
}

// NewRouter returns a router for this transport.
func (t *Transport) NewRouter() (*Router, error) {
	wr, err := message.NewRouter(message.RouterConfig{CloseTimeout: t.cfg.CloseTimeout}, t.wlog)
	if err != nil {
		return nil, fmt.Errorf("transport: creating router: %w", err)
	}
	r := &Router{t: t, router: wr, log: t.log, gate: newGate(), handlers: map[string]bool{}}
	// Outermost: once draining starts, no new message reaches the handlers.
	wr.AddMiddleware(r.gate.middleware)
	return r, nil
}

// AddHandler subscribes h to topic as consumerGroup; an empty consumerGroup
// means the handler's name, which must be unique in the router. Every process
// running a handler of the same group shares its lane and its offset.
//
// Each delivery runs up to RetryPolicy.MaxAttempts attempts, each in a
// savepoint of its own, with backoff between them; a message whose attempts
// run out, or that fails permanently (see Permanent), goes to the policy's
// dead-letter topic in the same transaction, and the lane moves on.
// Middleware added with AddMiddleware runs outside all of this, once per
// delivery.
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
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.router.IsClosed() {
		return ErrRouterClosed
	}
	if r.handlers[name] {
		return fmt.Errorf("transport: handler %s is already registered", name)
	}
	if r.t.cfg.Intercept != nil {
		h = r.t.cfg.Intercept(name, h)
	}
	if err := ValidateConsumerGroup(consumerGroup); err != nil {
		return fmt.Errorf("transport: handler %s: %w", name, err)
	}
	if err := r.t.validateLanes(topic); err != nil {
		return fmt.Errorf("transport: handler %s: %w", name, err)
	}
	proto := route{r: r, name: name, topic: topic, group: consumerGroup, h: h, retry: r.t.cfg.Retry}
	for _, opt := range opts {
		opt(&proto)
	}
	if err := proto.retry.validate(r.t.cfg.AckDeadline); err != nil {
		return fmt.Errorf("transport: handler %s: %w", name, err)
	}
	r.handlers[name] = true
	// One subscription per lane, each a serial lane of its own.
	lanes := r.t.LaneTopics(topic)
	for i, lane := range lanes {
		rt := proto
		rt.lane, rt.offsets, rt.sp = lane, r.t.OffsetsTable(lane), &savepointState{}
		handlerName := name
		if len(lanes) > 1 {
			handlerName = name + "[" + strconv.Itoa(i) + "]"
		}
		r.router.AddConsumerHandler(handlerName, lane, &subscriber{t: r.t, group: consumerGroup}, rt.deliver)
	}
	return nil
}

// AddMiddleware adds router-level middleware (retries, poison queues,
// metrics). It runs outside the attempt savepoint.
func (r *Router) AddMiddleware(m ...message.HandlerMiddleware) { r.router.AddMiddleware(m...) }

// Run runs the router until ctx is cancelled or Close is called; either way
// it drains before stopping. Handlers added before Run start with it.
func (r *Router) Run(ctx context.Context) error {
	stop := context.AfterFunc(ctx, func() {
		if err := r.Close(); err != nil {
			r.log.Error("closing router", "err", err)
		}
	})
	defer stop()
	// The router's own context is never cancelled from outside: cancelling
	// it would stop the subscribers under running handlers.
	return r.router.Run(context.WithoutCancel(ctx))
}

// Running is closed once the router runs.
func (r *Router) Running() chan struct{} { return r.router.Running() }

// Close stops taking new messages and starting new attempts, waits for
// in-flight handlers (up to Config.CloseTimeout), then stops the
// subscribers. A handler still running at the timeout has its attempt cut off
// and its batch transaction made to fail, so it commits nothing partial; the
// batch is redelivered. Cutting off waits for a running statement, so Close
// can take up to about 2×CloseTimeout + StatementTimeout in all.
func (r *Router) Close() error {
	r.closeOnce.Do(func() {
		if stuck := r.gate.drain(r.t.cfg.CloseTimeout); len(stuck) > 0 {
			r.log.Error("handlers still running at close timeout; abandoning their batches", "handlers", len(stuck), "timeout", r.t.cfg.CloseTimeout)
			// Each revoke waits for the attempt's running statement (at most
			// StatementTimeout); cut all of them off at once.
			var wg sync.WaitGroup
			for _, a := range stuck {
				wg.Go(func() {
					a.revoke()
					_, _ = a.raw.ExecContext(context.Background(), doomBatchSQL)
				})
			}
			wg.Wait()
		}
		r.closeErr = r.router.Close()
	})
	return r.closeErr
}

// call runs h, turning a panic into ErrHandlerPanicked.
func call(h HandlerFunc, msg *message.Message) (err error) {
	defer func() {
		if p := recover(); p != nil {
			err = fmt.Errorf("%w: %v\n%s", ErrHandlerPanicked, p, debug.Stack())
		}
	}()
	return h(msg)
}

// gate admits messages to handlers until drain is called, and keeps track of
// the attempts in flight.
type gate struct {
	mu       sync.Mutex
	draining bool
	inFlight int
	closing  chan struct{} // closed when draining starts
	idle     chan struct{} // closed when draining and nothing is in flight
	attempts map[*attemptTx]struct{}
}

func newGate() *gate {
	return &gate{closing: make(chan struct{}), idle: make(chan struct{}), attempts: map[*attemptTx]struct{}{}}
}

func (g *gate) middleware(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		if !g.enter() {
			// Hold the message without touching the transaction until the
			// subscriber stops and gives it up; it stays unacked and is
			// delivered again later.
			<-msg.Context().Done()
			return nil, ErrClosing
		}
		defer g.leave()
		return h(msg)
	}
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

// drain stops admitting messages and waits up to timeout for those in
// flight; it returns the attempts still running then.
func (g *gate) drain(timeout time.Duration) []*attemptTx {
	g.mu.Lock()
	if !g.draining {
		g.draining = true
		close(g.closing)
		if g.inFlight == 0 {
			close(g.idle)
		}
	}
	g.mu.Unlock()

	timer := time.NewTimer(timeout)
	defer timer.Stop()
	select {
	case <-g.idle:
		return nil
	case <-timer.C:
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	stuck := make([]*attemptTx, 0, len(g.attempts))
	for a := range g.attempts {
		stuck = append(stuck, a)
	}
	return stuck
}
