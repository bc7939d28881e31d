package transport

import (
	"context"
	"errors"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/pgsaga/pgsaga/internal/pglisten"
)

// DefaultNotifyChannel is the notification channel of publishes.
const DefaultNotifyChannel = "pgsaga_wakeup"

// wakeHub is a transport's single LISTEN connection and the subscriptions
// waiting on it. It runs while at least one subscription exists.
type wakeHub struct {
	t  *Transport
	up atomic.Bool // listening: notifications can be relied on

	mu      sync.Mutex
	lanes   map[string]*laneState // by physical topic
	waiters int
	stop    func() // stops the running listener; nil when none runs
}

// laneState is the subscriptions of one physical topic.
type laneState struct {
	mu      sync.Mutex
	waiters map[*pollState]struct{}
}

func newWakeHub(t *Transport) *wakeHub {
	return &wakeHub{t: t, lanes: map[string]*laneState{}}
}

// register adds a subscription of topic, starting the listener if it is
// the first.
func (h *wakeHub) register(topic string, p *pollState) *laneState {
	h.mu.Lock()
	defer h.mu.Unlock()
	lane := h.lanes[topic]
	if lane == nil {
		lane = &laneState{waiters: map[*pollState]struct{}{}}
		h.lanes[topic] = lane
	}
	lane.mu.Lock()
	lane.waiters[p] = struct{}{}
	lane.mu.Unlock()
	h.waiters++
	if h.stop == nil {
		h.stop = h.start()
	}
	return lane
}

// unregister removes a subscription, stopping the listener after the last.
func (h *wakeHub) unregister(lane *laneState, p *pollState) {
	lane.mu.Lock()
	delete(lane.waiters, p)
	lane.mu.Unlock()
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

func (h *wakeHub) start() func() {
	l, err := pglisten.New(pglisten.Config{
		DB:               h.t.db,
		Channels:         []string{h.t.cfg.NotifyChannel},
		OnNotify:         h.notified,
		OnListen:         func() { h.up.Store(true); h.wakeAll() },
		OnLost:           func(error) { h.up.Store(false); h.wakeAll() },
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
		h.up.Store(false)
	}()
	return func() { cancel(); <-done }
}

// notified handles "<topic> <xid>": it wakes the topic's subscriptions.
func (h *wakeHub) notified(_, payload string) {
	topic, _, ok := strings.Cut(payload, " ")
	if !ok {
		return
	}
	h.mu.Lock()
	lane := h.lanes[topic]
	h.mu.Unlock()
	if lane != nil { // else nobody here reads it
		lane.wake()
	}
}

func (h *wakeHub) wakeAll() {
	h.mu.Lock()
	lanes := make([]*laneState, 0, len(h.lanes))
	for _, l := range h.lanes {
		lanes = append(lanes, l)
	}
	h.mu.Unlock()
	for _, l := range lanes {
		l.wake()
	}
}

func (l *laneState) wake() {
	l.mu.Lock()
	defer l.mu.Unlock()
	for p := range l.waiters {
		select {
		case p.wakeCh <- struct{}{}:
		default: // a wake-up is already pending
		}
	}
}

// pollState is one subscription's backoff manager (wsql.BackoffManager),
// called by the subscriber after every poll:
//
//   - after messages: poll again at once (a busy lane never sleeps);
//   - after an error: wait, doubling from RetryInterval up to
//     MaxRetryInterval (none after a lost race for the lane);
//   - after an empty poll that saw messages waiting behind the visibility
//     fence (committed, but an older transaction is still running): poll
//     again soon, backing off from 1ms to 50ms, until the fence moves;
//   - after any other empty poll, with wake-ups: wait for a publish on the
//     lane to wake it, or IdlePollInterval as a safety net;
//   - without wake-ups (off, or the listening connection is down): wait
//     PollInterval, or less if woken.
//
// The subscriber calls it synchronously between polls; a wait ends early
// when the subscription closes.
type pollState struct {
	cfg    Config
	hub    *wakeHub // nil without notifications
	lane   *laneState
	wakeCh chan struct{}
	closed chan struct{}
	once   sync.Once

	// Set by the poll (its sentinel row), read after it, on the
	// subscriber's goroutine.
	polled bool
	fenced bool

	errWait   time.Duration
	fenceWait time.Duration
}

const (
	minFenceWait = time.Millisecond
	maxFenceWait = 50 * time.Millisecond
)

func newPollState(cfg Config, hub *wakeHub, topic string) *pollState {
	p := &pollState{cfg: cfg, hub: hub, wakeCh: make(chan struct{}, 1), closed: make(chan struct{})}
	if hub != nil {
		p.lane = hub.register(topic, p)
	}
	return p
}

// close ends any wait and leaves the hub.
func (p *pollState) close() {
	p.once.Do(func() {
		close(p.closed)
		if p.hub != nil {
			p.hub.unregister(p.lane, p)
		}
	})
}

// empty records what the sentinel row of an empty poll said.
func (p *pollState) empty(fenced bool) { p.polled, p.fenced = true, fenced }

func (p *pollState) HandleError(logger watermill.LoggerAdapter, noMsg bool, err error) time.Duration {
	fenced := p.polled && p.fenced
	p.polled, p.fenced = false, false
	if err != nil {
		p.fenceWait = 0
		return p.errorWait(logger, err)
	}
	p.errWait = 0
	if !noMsg {
		p.fenceWait = 0
		return 0
	}
	if fenced {
		p.fenceWait = min(max(2*p.fenceWait, minFenceWait), maxFenceWait)
		p.sleep(p.fenceWait)
		return 0
	}
	p.fenceWait = 0
	if p.hub == nil || !p.hub.up.Load() {
		p.sleep(p.cfg.PollInterval)
		return 0
	}
	p.sleep(p.cfg.IdlePollInterval)
	return 0
}

// sleep waits d, or less if the lane is woken or the subscription closes.
func (p *pollState) sleep(d time.Duration) {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
	case <-p.wakeCh:
	case <-p.closed:
	}
}

func (p *pollState) errorWait(logger watermill.LoggerAdapter, err error) time.Duration {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && (pgErr.Code == "40001" || pgErr.Code == "40P01") {
		// Another subscriber of the same consumer group held the lane and
		// moved its offset: expected when several processes share a lane.
		logger.Debug("Lane taken by another subscriber; polling again", watermill.LogFields{"err": err.Error()})
		return 0
	}
	if errors.As(err, &pgErr) && pgErr.Code == "25P02" {
		// The Router abandoned the batch (its offset update fails on the
		// aborted transaction): redeliver it at once.
		logger.Debug("Batch abandoned; redelivering", watermill.LogFields{"err": err.Error()})
		return 0
	}
	if p.errWait == 0 {
		p.errWait = p.cfg.RetryInterval
	} else {
		p.errWait = min(2*p.errWait, p.cfg.MaxRetryInterval)
	}
	logger.Error("Polling for messages failed; backing off", err, watermill.LogFields{"wait": p.errWait.String()})
	return p.errWait
}
