package main

import (
	"context"
	"errors"
	"fmt"
)

// stoppable is what watchWorkers needs of a worker started with Start.
type stoppable interface {
	Stopped() <-chan struct{}
	Err() error
}

// workerStoppedError is why a run ended when a worker stopped under it.
type workerStoppedError struct {
	worker, of int
	err        error // nil: it stopped without one
}

func (e *workerStoppedError) Error() string {
	if e.err == nil {
		return fmt.Sprintf("worker %d of %d stopped", e.worker, e.of)
	}
	return fmt.Sprintf("worker %d of %d stopped: %v", e.worker, e.of, e.err)
}

func (e *workerStoppedError) Unwrap() error { return e.err }

// watchWorkers returns a context, derived from ctx, that ends as soon as a
// worker stops, with a *workerStoppedError as its cause: nothing drives the
// sagas any more, so waiting for them would last until -timeout. Call stop
// before stopping the workers, whose stop is then no failure.
func watchWorkers(ctx context.Context, workers []stoppable) (_ context.Context, stop func()) {
	ctx, cancel := context.WithCancelCause(ctx)
	for i, w := range workers {
		go func() {
			select {
			case <-w.Stopped():
				cancel(&workerStoppedError{worker: i + 1, of: len(workers), err: w.Err()})
			case <-ctx.Done():
			}
		}()
	}
	return ctx, func() { cancel(nil) }
}

// workerStopped is the worker's stop that ended ctx, if that is what ended
// it.
func workerStopped(ctx context.Context) error {
	var stopped *workerStoppedError
	if errors.As(context.Cause(ctx), &stopped) {
		return stopped
	}
	return nil
}

// plural is n followed by the noun's singular or plural form.
func plural(n int, one, many string) string {
	if n == 1 {
		return "1 " + one
	}
	return fmt.Sprintf("%d %s", n, many)
}
