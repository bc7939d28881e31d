// Package workerwatch ends a program's run as soon as one of its workers
// stops under it, with the worker's cause, so that the program does not wait
// for sagas nothing drives any more.
package workerwatch

import (
	"context"
	"errors"
	"fmt"
	"log/slog"

	"github.com/pgsaga/pgsaga/saga"
	"github.com/pgsaga/pgsaga/saga/orderpayment"
	"github.com/pgsaga/pgsaga/steps/broker"
)

// Stoppable is what Watch needs of a worker started with Start
// (saga.Worker, saga.Client).
type Stoppable interface {
	Stopped() <-chan struct{}
	Err() error
}

// StoppedError is why a run ended when a worker stopped under it.
type StoppedError struct {
	worker, of int
	err        error // nil: it stopped without one
}

// Error says which worker stopped, and why.
func (e *StoppedError) Error() string {
	if e.err == nil {
		return fmt.Sprintf("worker %d of %d stopped", e.worker, e.of)
	}
	return fmt.Sprintf("worker %d of %d stopped: %v", e.worker, e.of, e.err)
}

// Unwrap returns the worker's error, if it had one.
func (e *StoppedError) Unwrap() error { return e.err }

// Watch returns a context, derived from ctx, that ends as soon as a
// worker stops, with a *StoppedError as its cause: nothing drives the
// sagas any more, so waiting for them would last until the program's timeout. Call stop
// before stopping the workers, whose stop is then no failure.
func Watch[W Stoppable](ctx context.Context, workers []W) (_ context.Context, stop func()) {
	ctx, cancel := context.WithCancelCause(ctx)
	for i, w := range workers {
		go func() {
			select {
			case <-w.Stopped():
				cancel(&StoppedError{worker: i + 1, of: len(workers), err: w.Err()})
			case <-ctx.Done():
			}
		}()
	}
	return ctx, func() { cancel(nil) }
}

// Stopped is the worker's stop that ended ctx, if that is what ended it.
func Stopped(ctx context.Context) error {
	var stopped *StoppedError
	if errors.As(context.Cause(ctx), &stopped) {
		return stopped
	}
	return nil
}

// StartAll builds n workers with newWorker and starts them, one after the
// other, returning once all run, or with the reason one cannot ("worker i
// of n: …"). It returns the workers it started either way: stop them with
// StopAll. ctx bounds the starts only: workers stop through StopAll
// (draining), never through ctx.
func StartAll(ctx context.Context, n int, newWorker func() (*saga.Worker, error)) ([]*saga.Worker, error) {
	var started []*saga.Worker
	for i := range n {
		w, err := newWorker()
		if err != nil {
			return started, fmt.Errorf("building worker %d of %d: %w", i+1, n, err)
		}
		if err := w.Start(ctx); err != nil {
			return started, fmt.Errorf("worker %d of %d: %w", i+1, n, err)
		}
		started = append(started, w)
	}
	return started, nil
}

// StopAll drains and stops workers, logging what went wrong, except for a
// worker that had stopped by itself (Watch reported why).
func StopAll(workers []*saga.Worker, log *slog.Logger) {
	for _, w := range workers {
		select {
		case <-w.Stopped():
			_ = w.Stop()
		default:
			if err := w.Stop(); err != nil {
				log.Error("stopping worker", "err", err)
			}
		}
	}
}

// Service is one database's share of a run: how to build its workers, and
// its bridge to a message broker (nil: none).
type Service struct {
	Name      string // says which service failed to start
	NewWorker func() (*saga.Worker, error)
	Bridge    broker.Bridge
}

// Sample is the order-payment sample's services: the orders service, and
// with pay (not nil) the payment service, each with its bridge.
func Sample(app *orderpayment.App, pay *orderpayment.PaymentService) []Service {
	if pay == nil {
		return []Service{{Name: "orders", NewWorker: app.NewWorker}}
	}
	return []Service{
		{Name: "orders", NewWorker: app.NewWorker, Bridge: app.Client.Bridge()},
		{Name: "payment service", NewWorker: pay.NewWorker, Bridge: pay.Client.Bridge()},
	}
}

// Fleet is what StartFleet started: the workers of every service, then
// their bridges. Stop it with Stop.
type Fleet struct {
	Workers []*saga.Worker
	bridges []broker.Bridge
}

// StartFleet starts n workers of each service, in order, then each
// service's bridge, in order, once every worker runs; it returns once all
// run, or with the reason one cannot. It returns what it started either
// way: stop it with Stop. ctx bounds the starts only.
func StartFleet(ctx context.Context, n int, services ...Service) (*Fleet, error) {
	f := &Fleet{}
	for _, s := range services {
		workers, err := StartAll(ctx, n, s.NewWorker)
		f.Workers = append(f.Workers, workers...)
		if err != nil {
			return f, fmt.Errorf("%s: %w", s.Name, err)
		}
	}
	for _, s := range services {
		if s.Bridge == nil {
			continue
		}
		if err := s.Bridge.Start(ctx); err != nil {
			return f, fmt.Errorf("%s: starting the bridge to the broker: %w", s.Name, err)
		}
		f.bridges = append(f.bridges, s.Bridge)
	}
	return f, nil
}

// Stop drains and stops the workers (as StopAll), then the bridges, so
// that what the workers published last is relayed. A nil Fleet is none.
func (f *Fleet) Stop(log *slog.Logger) {
	if f == nil {
		return
	}
	StopAll(f.Workers, log)
	f.Workers = nil
	for _, b := range f.bridges {
		if err := b.Stop(); err != nil {
			log.Error("stopping a bridge", "err", err)
		}
	}
	f.bridges = nil
}
