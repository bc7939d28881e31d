package transport

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/pgsaga/pgsaga/internal/telemetry"
)

// callSet tracks the awaited calls of a router's deliveries (see Await):
// Close waits for them, and cancels those still running at its timeout.
type callSet struct {
	ctx    context.Context
	cancel context.CancelFunc

	mu   sync.Mutex
	n    int
	idle chan struct{} // closed when n falls to 0
}

func newCallSet() *callSet {
	ctx, cancel := context.WithCancel(context.Background())
	return &callSet{ctx: ctx, cancel: cancel}
}

func (s *callSet) add() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.n == 0 {
		s.idle = make(chan struct{})
	}
	s.n++
}

func (s *callSet) done() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.n--
	if s.n == 0 {
		close(s.idle)
	}
}

// running counts the calls under way.
func (s *callSet) running() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.n
}

// waitCtx waits until ctx ends for the calls under way; it reports
// whether none is left.
func (s *callSet) waitCtx(ctx context.Context) bool {
	s.mu.Lock()
	if s.n == 0 {
		s.mu.Unlock()
		return true
	}
	idle := s.idle
	s.mu.Unlock()
	select {
	case <-idle:
		return true
	case <-ctx.Done():
		return false
	}
}

// wait waits up to timeout for the calls under way; it reports whether
// none is left.
func (s *callSet) wait(timeout time.Duration) bool {
	ctx, cancel := context.WithTimeout(context.Background(), max(timeout, 0))
	defer cancel()
	return s.waitCtx(ctx)
}

// awaitedCalls counts the awaited calls running in a process (its
// Transport): consumers wait for room (room) before they claim.
type awaitedCalls struct {
	mu      sync.Mutex
	n       int
	freed   chan struct{} // closed, and replaced, when a call ends
	waiting int           // consumers waiting for room (tests read it)
}

func (a *awaitedCalls) add() {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.n++
}

func (a *awaitedCalls) done() {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.n--
	if a.freed != nil {
		close(a.freed)
		a.freed = nil
	}
}

// room waits until fewer than limit calls run, or ctx is done.
func (a *awaitedCalls) room(ctx context.Context, limit int, log *slog.Logger) error {
	a.mu.Lock()
	for a.n >= limit {
		if a.freed == nil {
			a.freed = make(chan struct{})
		}
		freed := a.freed
		a.waiting++
		n := a.n
		a.mu.Unlock()
		log.Debug("transport: claiming waits: as many awaited calls run as MaxAwaitedCalls allows", "running", n, "max", limit)
		select {
		case <-freed:
		case <-ctx.Done():
			a.mu.Lock()
			a.waiting--
			a.mu.Unlock()
			return fmt.Errorf("transport: waiting for room among the awaited calls: %w", context.Cause(ctx))
		}
		a.mu.Lock()
		a.waiting--
	}
	a.mu.Unlock()
	return nil
}

type afterAwaitKey struct{}

// AwaitedFromContext reports whether the handler runs right after its
// awaited call returned (see Await), in the same batch or delivered again
// after its park: what the call recorded is there to read, and a handler
// can answer from it without redoing the work that led to the call.
func AwaitedFromContext(ctx context.Context) bool {
	v, _ := ctx.Value(afterAwaitKey{}).(bool)
	return v
}

// afterAwait is msg for the handler's run after its awaited call (see
// AwaitedFromContext).
func afterAwait(msg *message.Message) *message.Message {
	m := msg.Copy()
	m.SetContext(context.WithValue(msg.Context(), afterAwaitKey{}, true))
	return m
}

// runAwaited runs an awaited call within its bound, turning a panic into
// ErrHandlerPanicked.
func runAwaited(ctx context.Context, aw *AwaitError) (err error) {
	ctx, cancel := context.WithTimeout(ctx, aw.Within)
	defer cancel()
	defer func() {
		if p := recover(); p != nil {
			err = Recovered("awaited call", p)
		}
	}()
	if err := aw.Call(ctx); err != nil {
		return fmt.Errorf("transport: the awaited call failed: %w", err)
	}
	return nil
}

// awaitInline carries out an Await for a delivery that has no queue row to
// hand back (HandleInTx, an in-process delivery): if the attempt that ended
// with out and err awaited, its call runs now, within deadline, and then
// the handler again (again). A second Await is ErrAwaitedAgain.
func awaitInline(out attemptEnd, err error, deadline time.Time, again func() (attemptEnd, error)) (attemptEnd, error) {
	var aw *AwaitError
	if out != failed || !errors.As(err, &aw) {
		return out, err
	}
	ctx, cancel := context.WithDeadline(context.Background(), deadline)
	defer cancel()
	if cerr := runAwaited(ctx, aw); cerr != nil {
		return failed, cerr
	}
	out, err = again()
	if out == failed && errors.As(err, &aw) {
		return failed, ErrAwaitedAgain
	}
	return out, err
}

// awaitedCall is a call under way for a queued delivery: the delivery
// holds its batch for it a little (Config.AwaitHold), and whichever of the
// two gets there first decides who finishes it: the batch, if the call
// returned while held; else the call's own goroutine, once the message is
// parked.
type awaitedCall struct {
	result chan error // the call's result, if taken while held
	state  atomic.Int32
}

const (
	callRunning = iota
	callParked  // the delivery stopped waiting: the goroutine finishes
	callTaken   // the call returned while held: the delivery finishes
)

// heldCall is a delivery of a batch whose handler awaits a call the batch
// holds for: its handler runs again before the batch commits if the call
// returned by the end of the hold (see runHeld). Until the batch is done
// with it, it counts as in flight for the router's gate (Close waits for
// it), and a call whose result the batch took counts among the calls
// under way until the batch is done with that result.
type heldCall struct {
	call *awaitedCall
	log  *slog.Logger
	d    delivery
	msg  *message.Message
	n    int
	aw   *AwaitError
}

// await carries out a handler's Await for a queued delivery. The call
// starts at once, outside the batch, and the batch goes on with its other
// messages. If hold is allowed, the batch holds for the call, and runs
// the handler again before its commit if the call returned by then (see
// runHeld): the calls of a batch's messages so overlap, and a batch waits
// at most one hold, whatever its size. Otherwise the message is parked in
// the batch (no attempt counted) and the call's goroutine wakes it, or
// records the call's failure, once the call and the batch are over. A
// message that awaited too often fails its attempt instead.
func (c *consumer) await(b *batch, log *slog.Logger, d delivery, msg *message.Message, n int, aw *AwaitError, hold bool) {
	if d.awaited >= c.rt.retry.MaxAttempts {
		c.fail(b, log, d, n, fmt.Errorf("%w (%d times)", ErrAwaitedTooOften, d.awaited))
		return
	}
	hold = hold && c.t.cfg.AwaitHold > 0
	call := &awaitedCall{result: make(chan error, 1)}
	if !hold {
		call.state.Store(callParked) // no hold: parked however quick the call
	}
	c.gate.calls.add()
	c.t.calls.add()
	if hold {
		c.gate.hold() // left by runHeld or letGo
		b.mu.Lock()
		b.held = append(b.held, &heldCall{call: call, log: log, d: d, msg: msg, n: n, aw: aw})
		b.mu.Unlock()
	}
	attemptWorkers.Go(func() { c.runCall(b, log, d, n, aw, call) }, nil)
	if !hold {
		c.park(b, log, d, aw)
	}
}

// park parks d in its batch, with the batch's other writes, right before
// its commit, while its handler's call runs: if the batch does not
// commit, the call goes on (the handler committed what it needs, a lease,
// say), and the message is delivered again.
func (c *consumer) park(b *batch, log *slog.Logger, d delivery, aw *AwaitError) {
	b.d.batched = append(b.d.batched, batchedRow{w: parkWrite,
		values: []any{d.id, aw.Within.Seconds(), strconv.Itoa(d.awaited + 1), reason(aw), metaAwaited}})
	log.Debug("message handed back while its handler's call runs", "within_ms", telemetry.Millis(aw.Within))
}

// runHeld ends the holds of b once its deliveries have settled, right
// before its commit, in the order the calls started. The hold ends
// Config.AwaitHold from now (every call started before): a handler whose
// call returned by then runs again (its hold is over; a second Await parks
// it), in the batch, as the same attempt with an attempt's full time; a
// call that failed costs the attempt; the others are parked. A message
// whose call returned when the batch has no room left for an attempt, or
// the router is closing, is parked and woken once the batch is over, so
// that its next delivery knows of the call. Deliveries of a batch that
// broke are left to be delivered again, their calls to go on alone
// (letGo).
func (c *consumer) runHeld(b *batch) {
	b.run.Lock() // a middleware may have returned before its delivery's attempt
	defer b.run.Unlock()
	b.mu.Lock()
	none := len(b.held) == 0
	b.mu.Unlock()
	if none {
		return
	}
	end := time.Now().Add(c.t.cfg.AwaitHold)
	for {
		b.mu.Lock()
		if len(b.held) == 0 || b.broken != nil {
			b.mu.Unlock()
			return
		}
		h := b.held[0]
		b.held = b.held[1:]
		late := b.deadline.Sub(time.Now()) < c.t.cfg.AttemptTimeout+2*c.t.cfg.StatementTimeout
		b.mu.Unlock()
		c.endHold(b, h, end, late)
		c.gate.leave()
	}
}

// endHold ends one hold of runHeld's.
func (c *consumer) endHold(b *batch, h *heldCall, end time.Time, late bool) {
	wait := time.Until(end)
	if late {
		wait = 0
	}
	err, taken := h.call.take(wait)
	if !taken {
		c.park(b, h.log, h.d, h.aw) // the call goes on: its goroutine wakes the message
		return
	}
	stopped := c.gate.calls.ctx.Err() != nil
	if err != nil {
		if stopped {
			c.release(b) // cancelled by Close: the message goes back untouched
		} else {
			c.fail(b, h.log, h.d, h.n, err)
		}
		c.gate.calls.done()
		return
	}
	if !late && !c.gate.closing() {
		deadline := time.Now().Add(c.t.cfg.AttemptTimeout)
		out := c.run(b, h.log, h.d, afterAwait(h.msg), h.n, deadline, false)
		if out != kept {
			b.d.claims.free(h.d.id)
		}
		if out != refused { // refused: the router began closing meanwhile
			c.gate.calls.done()
			return
		}
	}
	// The call succeeded, and no run follows it in this batch: parked,
	// and woken when the batch is over, as if it had returned after its
	// hold.
	c.park(b, h.log, h.d, h.aw)
	attemptWorkers.Go(func() {
		defer c.gate.calls.done()
		c.afterCall(b, h.log, h.d, h.n, h.aw, nil, stopped)
	}, nil)
}

// letGo leaves the calls b still holds to their goroutines: the batch ended
// without running them again (it broke, or was never allowed to commit).
func (c *consumer) letGo(b *batch) {
	b.mu.Lock()
	held := b.held
	b.held = nil
	b.mu.Unlock()
	for _, h := range held {
		if !h.call.state.CompareAndSwap(callRunning, callParked) {
			// Its result is in: nothing more to do, its message is
			// delivered again as the batch did not commit.
			c.gate.calls.done()
		}
		c.gate.leave()
	}
}

// take waits up to wait for the call's result: taken reports whether the
// batch got it (and must finish the call), or the call goes on alone. A
// result already in is taken however late.
func (a *awaitedCall) take(wait time.Duration) (err error, taken bool) {
	if wait > 0 {
		t := time.NewTimer(wait)
		defer t.Stop()
		select {
		case err := <-a.result:
			return err, true
		case <-t.C:
		}
	}
	if a.state.CompareAndSwap(callRunning, callParked) {
		return nil, false
	}
	return <-a.result, true // it returned just now
}

// runCall runs an awaited call. If the batch takes its result, that is
// all; otherwise, once the batch that parked its message is over, it wakes
// the message or records the call's failure (afterCall).
func (c *consumer) runCall(b *batch, log *slog.Logger, d delivery, n int, aw *AwaitError, call *awaitedCall) {
	defer c.t.calls.done()
	err := runAwaited(c.gate.calls.ctx, aw)
	if call.state.CompareAndSwap(callRunning, callTaken) {
		call.result <- err // the batch ends its count in gate.calls once done with it
		return
	}
	defer c.gate.calls.done()
	c.afterCall(b, log, d, n, aw, err, c.gate.calls.ctx.Err() != nil)
}

// afterCall finishes an awaited call whose message was parked, once the
// batch that parked it is over: it wakes the message (the call succeeded,
// or was cancelled by Close (stopped): the next worker delivers it at
// once) or records the call's failure as the attempt's.
func (c *consumer) afterCall(b *batch, log *slog.Logger, d delivery, n int, aw *AwaitError, err error, stopped bool) {
	<-b.ended
	if err != nil && !stopped {
		c.recordAfter(failure{d: d, n: n, cause: err, what: "awaited call"})
		// Its consumers sleep until its park runs out: tell them of its
		// backoff.
		if _, werr := c.t.execWaiting(wakeTopicSQL, c.t.schema.notifyChannel, c.rt.topic); werr != nil {
			log.Warn("waking the topic of a message whose awaited call failed failed; it is retried when its park runs out", "err", werr)
		}
		return
	}
	woken, werr := c.t.execWaiting(wakeSQL, d.id, d.failed, c.t.schema.notifyChannel)
	if werr != nil {
		// It comes back when its park runs out.
		log.Warn("awaited call finished; waking its message failed", "err", werr, "park_ms", telemetry.Millis(aw.Within))
		return
	}
	log.Debug("awaited call finished", "woken", woken, "cancelled", stopped)
}
