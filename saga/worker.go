package saga

import (
	"context"
	"fmt"
	"sync"

	"github.com/pgsaga/pgsaga/internal/transport"
)

// Worker is one router with every handler of a Client (its steps,
// projections and sagas) and a deadline sweeper. Several workers, in one
// process or many, share the work: the consumers of a handler's group
// claim different messages. Build one with Client.NewWorker.
type Worker struct {
	engine *engine
	router *transport.Router

	mu      sync.Mutex
	started bool          // Start succeeded
	stopped chan struct{} // closed once it stopped, sweeper included
}

// Start runs the worker in the background and returns once it runs, or with
// the reason it could not start. ctx bounds the start only: the worker runs
// until Stop or until it fails (see Stopped).
func (w *Worker) Start(ctx context.Context) error {
	// Held throughout: a Stop meanwhile waits for the start, then stops
	// what started.
	w.mu.Lock()
	defer w.mu.Unlock()
	if err := w.router.Start(ctx); err != nil {
		return fmt.Errorf("saga: starting worker: %w", err)
	}
	w.started = true
	sweepCtx, stopSweeper := context.WithCancel(context.WithoutCancel(ctx))
	var wg sync.WaitGroup
	wg.Go(func() { _ = w.engine.RunSweeper(sweepCtx) })
	go func() {
		<-w.router.Stopped()
		stopSweeper()
		wg.Wait()
		close(w.stopped)
	}()
	return nil
}

// Stopped is closed once a worker begun with Start has stopped, by Stop or
// because it failed; Err then says why.
func (w *Worker) Stopped() <-chan struct{} { return w.stopped }

// Err is what the worker's run ended with, once Stopped is closed: nil
// after a clean Stop.
func (w *Worker) Err() error { return w.router.Err() }

// Stop drains and stops a worker begun with Start and returns what its run
// ended with: delivery.ErrCloseTimeout if a consumer's connection hung (a
// network partition), whose batch the database rolls back.
func (w *Worker) Stop() error { return w.stop(context.Background()) }

// stop is Stop, draining only until ctx ends (see Client.Stop).
func (w *Worker) stop(ctx context.Context) error {
	w.mu.Lock()
	started := w.started
	w.mu.Unlock()
	err := w.router.StopContext(ctx)
	if started {
		<-w.stopped
	}
	return err
}
