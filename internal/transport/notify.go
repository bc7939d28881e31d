package transport

import (
	"context"
	"database/sql"
	"errors"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"

	"github.com/pgsaga/pgsaga/internal/pgerr"
	"github.com/pgsaga/pgsaga/internal/pglisten"
)

// wakeHub is a transport's single LISTEN connection and the consumers
// waiting on it. It runs while at least one consumer exists.
type wakeHub struct {
	t  *Transport
	up atomic.Bool // listening: notifications can be relied on

	// upMu and gen keep a stopped listener, still on its way out, from
	// marking its successor's state: only the latest listener sets up.
	upMu sync.Mutex
	gen  uint64

	mu      sync.Mutex
	topics  map[string]*waiters
	waiters int
	stop    func() // stops the running listener; nil when none runs
}

// waiters are the consumers of one topic in this process, by the channel
// each is woken on (buffered: one wake-up pending at most).
type waiters struct {
	mu  sync.Mutex
	set map[chan struct{}]struct{}
}

func newWakeHub(t *Transport) *wakeHub {
	return &wakeHub{t: t, topics: map[string]*waiters{}}
}

// register adds a consumer of topic, woken on ch, starting the listener
// for the first.
func (h *wakeHub) register(topic string, ch chan struct{}) *waiters {
	h.mu.Lock()
	defer h.mu.Unlock()
	w := h.topics[topic]
	if w == nil {
		w = &waiters{set: map[chan struct{}]struct{}{}}
		h.topics[topic] = w
	}
	w.mu.Lock()
	w.set[ch] = struct{}{}
	w.mu.Unlock()
	h.waiters++
	if h.stop == nil {
		h.stop = h.start()
	}
	return w
}

// unregister removes a consumer, stopping the listener after the last.
func (h *wakeHub) unregister(w *waiters, ch chan struct{}) {
	w.mu.Lock()
	delete(w.set, ch)
	w.mu.Unlock()
	h.mu.Lock()
	h.waiters--
	var stop func()
	if h.waiters == 0 {
		stop, h.stop = h.stop, nil
	}
	h.mu.Unlock()
	if stop != nil {
		stop()
	}
}

// newListener starts a listener generation: up is false until it listens.
func (h *wakeHub) newListener() (gen uint64) {
	h.upMu.Lock()
	defer h.upMu.Unlock()
	h.gen++
	h.up.Store(false)
	return h.gen
}

// setUp records whether listener gen listens, if it is the latest.
func (h *wakeHub) setUp(gen uint64, up bool) {
	h.upMu.Lock()
	defer h.upMu.Unlock()
	if gen == h.gen {
		h.up.Store(up)
	}
}

func (h *wakeHub) start() func() {
	gen := h.newListener()
	l, err := pglisten.New(pglisten.Config{
		DB:               h.t.db,
		Channels:         []string{h.t.cfg.NotifyChannel},
		OnNotify:         func(_, topic string) { h.wake(topic) },
		OnListen:         func() { h.setUp(gen, true); h.wakeAll() },
		OnLost:           func(error) { h.setUp(gen, false); h.wakeAll() },
		RetryInterval:    h.t.cfg.RetryInterval,
		MaxRetryInterval: h.t.cfg.MaxRetryInterval,
		Logger:           h.t.log,
	})
	if err != nil {
		// The channel name was validated with the Config.
		h.t.log.Error("transport: cannot listen for wake-ups; polling instead", "err", err)
		return func() {}
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = l.Run(ctx)
		h.setUp(gen, false)
	}()
	return func() { cancel(); <-done }
}

// wake wakes the consumers of topic.
func (h *wakeHub) wake(topic string) {
	h.mu.Lock()
	w := h.topics[topic]
	h.mu.Unlock()
	if w != nil { // else nobody here reads it
		w.wake()
	}
}

func (h *wakeHub) wakeAll() {
	h.mu.Lock()
	all := make([]*waiters, 0, len(h.topics))
	for _, w := range h.topics {
		all = append(all, w)
	}
	h.mu.Unlock()
	for _, w := range all {
		w.wake()
	}
}

func (w *waiters) wake() {
	w.mu.Lock()
	defer w.mu.Unlock()
	for ch := range w.set {
		select {
		case ch <- struct{}{}:
		default: // a wake-up is already pending
		}
	}
}

// pollState is one consumer's backoff manager (wsql.BackoffManager), called
// by the subscriber after every poll, on the subscriber's goroutine. It first
// closes the poll's batch, then decides when to poll again:
//
//   - after a batch that handled messages, handed some back or failed:
//     at once (a busy consumer never sleeps);
//   - after a failed poll (a lost connection): after RetryInterval,
//     doubling up to MaxRetryInterval;
//   - after finding nothing: when a publish to the topic wakes it, when the
//     group's next message becomes available (a retry after its backoff),
//     after heldRecheck if other consumers hold available messages (should
//     their process die, its transaction ends and nobody announces that
//     the messages are free again), or after IdlePollInterval, whichever
//     comes first; without wake-ups (off, or the listening connection is
//     down), after PollInterval at most.
//
// A wake-up that arrives while the consumer polls is kept for the next
// wait, which then returns at once: none is lost.
type pollState struct {
	cfg      Config
	hub      *wakeHub // nil without wake-ups
	waiters  *waiters
	endBatch func(error) (again bool)
	stopping func() bool // the router drains: poll no more
	wakeCh   chan struct{}
	closed   chan struct{}
	once     sync.Once

	// Set by the poll's sentinel row, read after it.
	next time.Duration // until the group's next message is available; <0: none known
	held bool          // other consumers hold available messages

	errWait  time.Duration
	failures *pollFailures // the process's, shared by its consumers; nil: each failure logged
}

func newPollState(t *Transport, topic string, endBatch func(error) bool, stopping func() bool) *pollState {
	p := &pollState{cfg: t.cfg, hub: t.hub, endBatch: endBatch, stopping: stopping, wakeCh: make(chan struct{}, 1), closed: make(chan struct{}), next: -1,
		failures: &t.pollFailures}
	if p.hub != nil {
		p.waiters = p.hub.register(topic, p.wakeCh)
	}
	return p
}

// close ends any wait and leaves the hub.
func (p *pollState) close() {
	p.once.Do(func() {
		close(p.closed)
		if p.hub != nil {
			p.hub.unregister(p.waiters, p.wakeCh)
		}
	})
}

// heldRecheck is how soon a consumer that found nothing looks again while
// other consumers hold available messages of its group.
const heldRecheck = time.Second

// empty records what the sentinel row of an empty poll said: how long until
// the group's next message is available (negative if none is waiting), and
// whether other consumers hold available ones.
func (p *pollState) empty(next time.Duration, held bool) { p.next, p.held = next, held }

func (p *pollState) HandleError(logger watermill.LoggerAdapter, noMsg bool, err error) time.Duration {
	again := p.endBatch(err)
	next, held := p.next, p.held
	p.next, p.held = -1, false
	if p.stopping() {
		// The router drains: what this consumer claims it would release.
		<-p.closed
		return 0
	}
	if err != nil {
		if again && (errors.Is(err, sql.ErrTxDone) || pgerr.Dooms(err)) {
			// The batch was abandoned (and logged) by its consumer.
			return 0
		}
		// Wait here rather than return the wait: watermill-sql adds the
		// error to its logger for every backoff it is given, so a consumer
		// failing for a long time would log ever longer lines.
		p.pause(p.errorWait(logger, err))
		return 0
	}
	if p.errWait != 0 {
		p.failures.recovered(logger)
	}
	p.errWait = 0
	if !noMsg || again {
		return 0
	}
	wait := p.cfg.IdlePollInterval
	if p.hub == nil || !p.hub.up.Load() {
		wait = p.cfg.PollInterval
	}
	if next >= 0 {
		wait = min(wait, next)
	}
	if held {
		wait = min(wait, heldRecheck)
	}
	p.sleep(wait)
	return 0
}

// sleep waits d, or less if the topic is woken or the consumer closes.
func (p *pollState) sleep(d time.Duration) {
	if d <= 0 {
		return
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
	case <-p.wakeCh:
	case <-p.closed:
	}
}

// pause waits d, or less if the consumer closes.
func (p *pollState) pause(d time.Duration) {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
	case <-p.closed:
	}
}

func (p *pollState) errorWait(logger watermill.LoggerAdapter, err error) time.Duration {
	if p.errWait == 0 {
		p.errWait = p.cfg.RetryInterval
	} else {
		p.errWait = min(2*p.errWait, p.cfg.MaxRetryInterval)
	}
	if p.failures == nil {
		logger.Error("Polling for messages failed; backing off", err, watermill.LogFields{"wait": p.errWait.String()})
		return p.errWait
	}
	p.failures.failed(logger, err, p.errWait)
	return p.errWait
}

// pollFailures tells of the failed polls of a process's consumers (in a
// database outage, every consumer of every route fails every backoff): the
// first of a run of failures at Error, then one line a minute at most,
// saying how many failed since, and the first poll that works again.
type pollFailures struct {
	mu       sync.Mutex
	now      func() time.Time // time.Now unless a test sets it
	since    time.Time        // the run's first failure; zero: none
	lastLine time.Time
	folded   int // failures since the last line
	total    int // failures in the run
}

// pollFailureEvery is how often, at most, a run of failed polls is told.
const pollFailureEvery = time.Minute

func (f *pollFailures) clock() time.Time {
	if f.now != nil {
		return f.now()
	}
	return time.Now()
}

func (f *pollFailures) failed(logger watermill.LoggerAdapter, err error, wait time.Duration) {
	f.mu.Lock()
	now := f.clock()
	f.total++
	first := f.since.IsZero()
	if first {
		f.since, f.lastLine, f.folded, f.total = now, now, 0, 1
		f.mu.Unlock()
		logger.Error("Polling for messages failed; backing off (further failures are told once a minute)", err,
			watermill.LogFields{"wait": wait.String()})
		return
	}
	f.folded++
	if now.Sub(f.lastLine) < pollFailureEvery {
		f.mu.Unlock()
		return
	}
	folded, since := f.folded, f.lastLine
	f.lastLine, f.folded = now, 0
	down := now.Sub(f.since)
	f.mu.Unlock()
	logger.Error("Polling for messages still fails", err, watermill.LogFields{
		"failed_polls": folded, "in": now.Sub(since).Round(time.Second).String(), "failing_for": down.Round(time.Second).String()})
}

func (f *pollFailures) recovered(logger watermill.LoggerAdapter) {
	if f == nil {
		return
	}
	f.mu.Lock()
	if f.since.IsZero() {
		f.mu.Unlock()
		return
	}
	down, total := f.clock().Sub(f.since), f.total
	f.since, f.folded, f.total = time.Time{}, 0, 0
	f.mu.Unlock()
	logger.Info("Polling for messages works again", watermill.LogFields{"failed_for": down.Round(time.Millisecond).String(), "failed_polls": total})
}

// Wakeups is how code that reads queues its own way (a relay, see
// ClaimRelay) waits for them as consumers do: c receives when a publish to
// one of topics commits, in any process on the database (one wake-up is
// kept while none is read, so none is lost between two reads); listening
// reports whether wake-ups can be relied on now: while it is false (they
// are off, Config.DisableNotify, or the listening connection is down and
// reconnecting) poll every Config.PollInterval. c also receives when
// listening changes. stop unregisters; call it once.
func (t *Transport) Wakeups(topics ...string) (c <-chan struct{}, listening func() bool, stop func()) {
	ch := make(chan struct{}, 1)
	if t.hub == nil {
		return ch, func() bool { return false }, func() {}
	}
	ws := make([]*waiters, len(topics))
	for i, topic := range topics {
		ws[i] = t.hub.register(topic, ch)
	}
	var once sync.Once
	return ch, t.hub.up.Load, func() {
		once.Do(func() {
			for _, w := range ws {
				t.hub.unregister(w, ch)
			}
		})
	}
}
