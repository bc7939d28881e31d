package main

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

type fakeWorker struct {
	stopped chan struct{}
	err     error
}

func (f *fakeWorker) Stopped() <-chan struct{} { return f.stopped }
func (f *fakeWorker) Err() error               { return f.err }

// A worker that dies during the run ends the run's context at once, with
// the worker's error as the cause.
func TestWatchWorkersEndsTheRunWhenAWorkerStops(t *testing.T) {
	t.Parallel()
	cause := errors.New("subscriber gave up")
	a, b := &fakeWorker{stopped: make(chan struct{})}, &fakeWorker{stopped: make(chan struct{}), err: cause}
	ctx, stop := watchWorkers(context.Background(), []stoppable{a, b})
	defer stop()
	require.NoError(t, workerStopped(ctx))
	close(b.stopped)

	bound, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	select {
	case <-ctx.Done():
	case <-bound.Done():
		t.Fatal("the run's context did not end when a worker stopped")
	}
	err := workerStopped(ctx)
	require.Error(t, err)
	assert.ErrorIs(t, err, cause)
	assert.Equal(t, "worker 2 of 2 stopped: subscriber gave up", err.Error())
}

// Stopping the watch first makes the workers' own stop no failure, and an
// interruption is not mistaken for one.
func TestWatchWorkersStopAndInterrupt(t *testing.T) {
	t.Parallel()
	w := &fakeWorker{stopped: make(chan struct{})}
	ctx, stop := watchWorkers(context.Background(), []stoppable{w})
	stop()
	close(w.stopped)
	<-ctx.Done()
	assert.NoError(t, workerStopped(ctx))

	parent, interrupt := context.WithCancel(context.Background())
	ctx, stop = watchWorkers(parent, []stoppable{&fakeWorker{stopped: make(chan struct{})}})
	defer stop()
	interrupt()
	<-ctx.Done()
	assert.NoError(t, workerStopped(ctx))
}
