package transport

import (
	"slices"
	"sync"
	"sync/atomic"
	"time"
)

// workers runs functions on goroutines it keeps between them, for the
// attempts of deliveries and awaited calls. A goroutine started for each
// attempt grew its stack anew each time: a handler's depth through pgx and
// database/sql copied the stack several times an attempt (runtime.newstack
// was 6 % of sagabench's process CPU); a kept goroutine has grown already.
// A function that never returns keeps its goroutine (the next gets
// another); a goroutine idle for idleFor ends.
type workers struct {
	idleFor time.Duration
	mu      sync.Mutex
	idle    []*worker // the last to finish (the warmest) last
	started atomic.Int64
}

type worker struct{ jobs chan job }

type job struct{ run, then func() }

// attemptWorkers runs every attempt and awaited call of the process.
var attemptWorkers = &workers{idleFor: 5 * time.Second}

// Go runs run on an idle goroutine of w, or on a new one when none is
// idle, and then, if not nil, then, on the same goroutine once it is idle
// again: a caller that waits for then and goes on to its next function
// finds the goroutine free.
func (w *workers) Go(run, then func()) {
	j := job{run: run, then: then}
	w.mu.Lock()
	if n := len(w.idle); n > 0 {
		wk := w.idle[n-1]
		w.idle = w.idle[:n-1]
		w.mu.Unlock()
		wk.jobs <- j // buffered: it never waits
		return
	}
	w.mu.Unlock()
	w.started.Add(1)
	go w.work(&worker{jobs: make(chan job, 1)}, j)
}

func (w *workers) work(wk *worker, j job) {
	var timer *time.Timer
	for {
		j.run()
		w.mu.Lock()
		w.idle = append(w.idle, wk)
		w.mu.Unlock()
		if j.then != nil {
			j.then()
		}
		if timer == nil {
			timer = time.NewTimer(w.idleFor)
		} else {
			timer.Reset(w.idleFor)
		}
		select {
		case j = <-wk.jobs:
			continue
		case <-timer.C:
		}
		w.mu.Lock()
		if i := slices.Index(w.idle, wk); i >= 0 {
			w.idle = slices.Delete(w.idle, i, i+1)
			w.mu.Unlock()
			return
		}
		w.mu.Unlock()
		j = <-wk.jobs // taken as the timer fired: its job is on the way
	}
}
