package main

import (
	"slices"
	"sync"
	"time"

	"github.com/google/uuid"
)

// tracker follows the sagas a phase placed until their end is visible.
type tracker struct {
	mu      sync.Mutex
	pending map[uuid.UUID]tracked
	early   map[uuid.UUID]time.Time // ended before they were registered
	phases  map[string]*phaseStats
	windows map[string]chan struct{} // closed-loop slots, freed as sagas end
}

type tracked struct {
	phase string
	start time.Time
}

type phaseStats struct {
	placed    int
	latencies []time.Duration
	ends      []time.Time
	first     time.Time // first placement
	last      time.Time // last end
}

func newTracker() *tracker {
	return &tracker{pending: map[uuid.UUID]tracked{}, early: map[uuid.UUID]time.Time{}, phases: map[string]*phaseStats{},
		windows: map[string]chan struct{}{}}
}

func (t *tracker) stats(phase string) *phaseStats {
	s := t.phases[phase]
	if s == nil {
		s = &phaseStats{}
		t.phases[phase] = s
	}
	return s
}

// add registers a saga placed at start.
func (t *tracker) add(id uuid.UUID, phase string, start time.Time) {
	t.mu.Lock()
	s := t.stats(phase)
	s.placed++
	if s.first.IsZero() || start.Before(s.first) {
		s.first = start
	}
	at, ended := t.early[id]
	if !ended {
		t.pending[id] = tracked{phase: phase, start: start}
		t.mu.Unlock()
		return
	}
	delete(t.early, id)
	t.record(s, start, at)
	t.release(phase)
	t.mu.Unlock()
}

// setWindow makes every saga of phase that ends free a slot of window.
func (t *tracker) setWindow(phase string, window chan struct{}) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.windows[phase] = window
}

// release frees a slot of phase's window; the caller holds mu.
func (t *tracker) release(phase string) {
	if w := t.windows[phase]; w != nil {
		select {
		case <-w:
		default:
		}
	}
}

// finish records that saga id's end became visible at at.
func (t *tracker) finish(id uuid.UUID, at time.Time) {
	t.mu.Lock()
	p, ok := t.pending[id]
	if !ok {
		t.early[id] = at
		t.mu.Unlock()
		return
	}
	delete(t.pending, id)
	t.record(t.stats(p.phase), p.start, at)
	t.release(p.phase)
	t.mu.Unlock()
}

func (t *tracker) record(s *phaseStats, start, at time.Time) {
	s.latencies = append(s.latencies, at.Sub(start))
	s.ends = append(s.ends, at)
	if at.After(s.last) {
		s.last = at
	}
}

// progress returns how many sagas of phase were placed and have ended.
func (t *tracker) progress(phase string) (placed, ended int) {
	t.mu.Lock()
	defer t.mu.Unlock()
	s := t.stats(phase)
	return s.placed, len(s.latencies)
}

// result returns a copy of phase's figures.
func (t *tracker) result(phase string) phaseStats {
	t.mu.Lock()
	defer t.mu.Unlock()
	s := *t.stats(phase)
	s.latencies = slices.Clone(s.latencies)
	s.ends = slices.Clone(s.ends)
	return s
}

func (t *tracker) pendingIDs() []uuid.UUID {
	t.mu.Lock()
	defer t.mu.Unlock()
	out := make([]uuid.UUID, 0, len(t.pending))
	for id := range t.pending {
		out = append(out, id)
	}
	return out
}

// percentile returns the p-th percentile (0 < p <= 1) of sorted.
func percentile(sorted []time.Duration, p float64) time.Duration {
	if len(sorted) == 0 {
		return 0
	}
	i := int(float64(len(sorted))*p+0.5) - 1
	return sorted[min(max(i, 0), len(sorted)-1)]
}

// byQuarter splits the phase into four equal spans of time and returns the
// sagas per second that ended in each: a flat series means the rate held.
func (s phaseStats) byQuarter() [4]float64 {
	var out [4]float64
	span := s.last.Sub(s.first)
	if span <= 0 {
		return out
	}
	var counts [4]int
	for _, at := range s.ends {
		q := min(int(4*at.Sub(s.first)/span), 3)
		counts[max(q, 0)]++
	}
	for i, c := range counts {
		out[i] = float64(c) / (span.Seconds() / 4)
	}
	return out
}
