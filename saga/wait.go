package saga

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"

	"github.com/google/uuid"

	"github.com/pgsaga/pgsaga/internal/pglisten"
)

// WaitFinished waits until instance id ends (completed, compensated or
// failed) and returns it with its timeline. It needs
// ClientConfig.FinishedChannel. It never polls: the client holds one LISTEN
// connection for all its waiters while any waits, and each waiter looks its
// instance up once the connection listens, after every reconnect and when
// its end is announced, so no end is missed. An instance not started yet is
// waited for too.
func (c *Client) WaitFinished(ctx context.Context, id uuid.UUID) (Instance, error) {
	if c.cfg.FinishedChannel == "" {
		return Instance{}, errors.New("saga: WaitFinished needs ClientConfig.FinishedChannel")
	}
	w := c.finished.add(id)
	defer c.finished.remove(w)
	for {
		select {
		case <-w.check:
			inst, err := c.engine.Get(ctx, id)
			switch {
			case err == nil && inst.Status.Terminal():
				return inst, nil
			case err != nil && !errors.Is(err, ErrNoSuchSaga):
				return Instance{}, fmt.Errorf("saga: waiting for %s: %w", id, err)
			}
		case <-ctx.Done():
			return Instance{}, fmt.Errorf("saga: waiting for %s: %w", id, context.Cause(ctx))
		}
	}
}

// finishedHub is a client's one listener for its waiters: it runs while
// any waits, and pokes a waiter when its instance's end is announced and
// every waiter whenever it (re)listens.
type finishedHub struct {
	c *Client

	mu        sync.Mutex
	waiters   map[uuid.UUID]map[*waiter]struct{}
	n         int
	listening bool   // the running listener listens now
	gen       uint64 // the running listener's generation: a stopped one, on its way out, changes nothing
	stop      func() // stops the running listener; nil when none runs
}

type waiter struct {
	id    uuid.UUID
	check chan struct{} // one pending look-up at most
}

func (w *waiter) poke() {
	select {
	case w.check <- struct{}{}:
	default: // a look-up is pending already
	}
}

func (h *finishedHub) add(id uuid.UUID) *waiter {
	w := &waiter{id: id, check: make(chan struct{}, 1)}
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.waiters == nil {
		h.waiters = map[uuid.UUID]map[*waiter]struct{}{}
	}
	if h.waiters[id] == nil {
		h.waiters[id] = map[*waiter]struct{}{}
	}
	h.waiters[id][w] = struct{}{}
	h.n++
	if h.stop == nil {
		h.stop = h.start()
	} else if h.listening {
		// Already listening: an end committed before this waiter came is
		// found by looking at once.
		w.poke()
	}
	return w
}

func (h *finishedHub) remove(w *waiter) {
	h.mu.Lock()
	delete(h.waiters[w.id], w)
	if len(h.waiters[w.id]) == 0 {
		delete(h.waiters, w.id)
	}
	h.n--
	var stop func()
	if h.n == 0 {
		stop, h.stop = h.stop, nil
		h.listening = false
	}
	h.mu.Unlock()
	if stop != nil {
		stop()
	}
}

// pokeAll pokes every waiter when listener gen listens (again: ends
// announced meanwhile were missed).
func (h *finishedHub) pokeAll(gen uint64) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if gen != h.gen {
		return
	}
	h.listening = true
	for _, ws := range h.waiters {
		for w := range ws {
			w.poke()
		}
	}
}

func (h *finishedHub) announce(id uuid.UUID) {
	h.mu.Lock()
	defer h.mu.Unlock()
	for w := range h.waiters[id] {
		w.poke()
	}
}

// start starts a listener; the caller holds mu.
func (h *finishedHub) start() func() {
	h.gen++
	gen := h.gen
	h.listening = false
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	l, err := pglisten.New(pglisten.Config{DB: h.c.db, Channels: []string{h.c.cfg.FinishedChannel}, Logger: h.c.log,
		OnNotify: func(_, payload string) {
			if id, err := uuid.Parse(payload); err == nil {
				h.announce(id)
			}
		},
		OnListen: func() { h.pokeAll(gen) },
		OnLost: func(error) {
			h.mu.Lock()
			if gen == h.gen {
				h.listening = false
			}
			h.mu.Unlock()
		},
	})
	if err != nil {
		// The channel name was checked when the client was built.
		h.c.log.Error("saga: cannot listen for finished sagas", slog.Any("err", err))
		cancel()
		close(done)
		return func() {}
	}
	go func() {
		defer close(done)
		_ = l.Run(ctx)
	}()
	return func() { cancel(); <-done }
}
