package sagatest

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"sync"
	"time"

	"github.com/pgsaga/pgsaga/saga/delivery"
)

// Worker is what Churn starts and stops (saga.Worker is one): Start
// returns once it runs, Stop drains it and returns what its run ended with.
type Worker interface {
	Start(ctx context.Context) error
	Stop() error
}

// ChurnConfig configures Churn.
type ChurnConfig struct {
	// Workers is how many run at once. Default: 3.
	Workers int
	// New builds a worker. Required.
	New func() (Worker, error)
	// MinUp and MaxUp bound how long a worker runs before it is stopped
	// and replaced. Defaults: 200ms and 1.5s.
	MinUp, MaxUp time.Duration
	// Seed decides the schedule.
	Seed uint64
	// Logger. Default: slog.Default().
	Logger *slog.Logger
}

// Churn keeps Workers workers running over the same database, stopping each
// after a random while and starting a fresh one in its place, until Calm or
// Stop. A worker that fails to start (the database out of reach) is started
// again after a backoff, for up to two minutes or until Calm; a stop that
// timed out on a consumer whose connection hangs (delivery.ErrCloseTimeout)
// is logged and counted (CloseTimeouts), not reported as a failure.
type Churn struct {
	cfg  ChurnConfig
	inj  *Injector // only its chance function
	calm chan struct{}
	wg   sync.WaitGroup

	mu            sync.Mutex
	running       []Worker
	restarts      int
	closeTimeouts int
	errs          []error
}

// startPatience bounds how long a slot keeps trying to start a worker
// that fails to start (the database unreachable, say) before the churn
// reports it.
const startPatience = 2 * time.Minute

// StartChurn starts the workers.
func StartChurn(cfg ChurnConfig) (*Churn, error) {
	if cfg.New == nil {
		return nil, errors.New("sagatest: ChurnConfig.New is required")
	}
	if cfg.Workers == 0 {
		cfg.Workers = 3
	}
	if cfg.MinUp == 0 {
		cfg.MinUp = 200 * time.Millisecond
	}
	if cfg.MaxUp == 0 {
		cfg.MaxUp = 1500 * time.Millisecond
	}
	if cfg.Workers < 1 || cfg.MaxUp < cfg.MinUp || cfg.MinUp < 0 {
		return nil, errors.New("sagatest: Workers must be positive and 0 <= MinUp <= MaxUp")
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	c := &Churn{cfg: cfg, inj: &Injector{cfg: Faults{Seed: cfg.Seed}}, calm: make(chan struct{}), running: make([]Worker, cfg.Workers)}
	for slot := range cfg.Workers {
		w, err := c.start(slot)
		if err != nil {
			_ = c.Stop()
			return nil, err
		}
		c.wg.Go(func() { c.churn(slot, w) })
	}
	return c, nil
}

// start starts a worker in slot and waits until it runs.
func (c *Churn) start(slot int) (Worker, error) {
	w, err := c.cfg.New()
	if err != nil {
		return nil, fmt.Errorf("sagatest: starting a worker: %w", err)
	}
	if err := w.Start(context.Background()); err != nil {
		return nil, fmt.Errorf("sagatest: starting a worker: %w", err)
	}
	c.mu.Lock()
	c.running[slot] = w
	c.mu.Unlock()
	return w, nil
}

func (c *Churn) churn(slot int, w Worker) {
	for round := 0; ; round++ {
		up := c.cfg.MinUp + time.Duration(c.inj.chance("churn", strconv.Itoa(slot), strconv.Itoa(round))*float64(c.cfg.MaxUp-c.cfg.MinUp))
		select {
		case <-time.After(up):
		case <-c.calm:
			return
		}
		c.mu.Lock()
		c.running[slot] = nil
		c.mu.Unlock()
		if err := c.stopWorker(w); err != nil {
			c.fail(err)
		}
		next, err := c.restart(slot)
		if err != nil {
			c.fail(err)
			return
		}
		c.mu.Lock()
		c.restarts++
		c.mu.Unlock()
		w = next
	}
}

// restart starts a worker in slot, trying again while it fails to start,
// as a deployment restarts its workers: a database out of reach (a
// network partition) delays the start. It gives up after startPatience,
// or at Calm (after one more try), returning the last error.
func (c *Churn) restart(slot int) (Worker, error) {
	wait, deadline := 50*time.Millisecond, time.Now().Add(startPatience)
	calm := false
	for {
		w, err := c.start(slot)
		if err == nil || calm || time.Now().After(deadline) {
			return w, err
		}
		c.cfg.Logger.Warn("sagatest: a worker did not start; trying again", "err", err, "retry_in_ms", wait.Milliseconds())
		select {
		case <-time.After(wait): // a restart's backoff, as a deployment's
		case <-c.calm:
			calm = true
		}
		wait = min(2*wait, 2*time.Second)
	}
}

// stopWorker stops w. A stop that timed out on a consumer whose
// connection hangs (delivery.ErrCloseTimeout: a network fault's doing)
// is no failure of the worker: the database rolls its batch back and its
// messages are delivered again, which the invariants check.
func (c *Churn) stopWorker(w Worker) error {
	err := w.Stop()
	if errors.Is(err, delivery.ErrCloseTimeout) {
		c.cfg.Logger.Warn("sagatest: a worker's consumer hung on its connection as it stopped", "err", err)
		c.mu.Lock()
		c.closeTimeouts++
		c.mu.Unlock()
		return nil
	}
	return err
}

func (c *Churn) fail(err error) {
	c.cfg.Logger.Error("sagatest: churn", "err", err)
	c.mu.Lock()
	c.errs = append(c.errs, err)
	c.mu.Unlock()
}

// Calm stops the churn and leaves one worker running in every slot, so the
// system can settle.
func (c *Churn) Calm() {
	select {
	case <-c.calm:
	default:
		close(c.calm)
	}
	c.wg.Wait()
}

// Stop calms the churn, stops every worker, and returns the errors seen.
func (c *Churn) Stop() error {
	c.Calm()
	c.mu.Lock()
	running := append([]Worker(nil), c.running...)
	clear(c.running)
	c.mu.Unlock()
	for _, w := range running {
		if w != nil {
			if err := c.stopWorker(w); err != nil {
				c.fail(err)
			}
		}
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	return errors.Join(c.errs...)
}

// CloseTimeouts counts the stops that timed out on a hung consumer
// (delivery.ErrCloseTimeout), which are not counted as failures: a test
// without network faults can require none.
func (c *Churn) CloseTimeouts() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.closeTimeouts
}

// Restarts counts workers stopped and replaced so far.
func (c *Churn) Restarts() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.restarts
}
