package workerwatch_test

import (
	"context"
	"errors"
	"log/slog"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/cmd/internal/workerwatch"
	"github.com/pgsaga/pgsaga/internal/testdb"
	"github.com/pgsaga/pgsaga/internal/testpg"
	"github.com/pgsaga/pgsaga/internal/testsample"
	"github.com/pgsaga/pgsaga/saga"
	"github.com/pgsaga/pgsaga/saga/orderpayment"
)

func TestMain(m *testing.M) { testpg.Main(m, testsample.Schemas()...) }

type fakeWorker struct {
	stopped chan struct{}
	err     error
}

func (f *fakeWorker) Stopped() <-chan struct{} { return f.stopped }
func (f *fakeWorker) Err() error               { return f.err }

// A worker that dies during the run ends the run's context at once, with
// the worker's error as the cause.
func TestWatchEndsTheRunWhenAWorkerStops(t *testing.T) {
	t.Parallel()
	cause := errors.New("subscriber gave up")
	a, b := &fakeWorker{stopped: make(chan struct{})}, &fakeWorker{stopped: make(chan struct{}), err: cause}
	ctx, stop := workerwatch.Watch(context.Background(), []workerwatch.Stoppable{a, b})
	defer stop()
	require.NoError(t, workerwatch.Stopped(ctx))
	close(b.stopped)

	bound, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	select {
	case <-ctx.Done():
	case <-bound.Done():
		t.Fatal("the run's context did not end when a worker stopped")
	}
	err := workerwatch.Stopped(ctx)
	require.Error(t, err)
	assert.ErrorIs(t, err, cause)
	assert.Equal(t, "worker 2 of 2 stopped: subscriber gave up", err.Error())
}

// Stopping the watch first makes the workers' own stop no failure, and an
// interruption is not mistaken for one.
func TestWatchStopAndInterrupt(t *testing.T) {
	t.Parallel()
	w := &fakeWorker{stopped: make(chan struct{})}
	ctx, stop := workerwatch.Watch(context.Background(), []workerwatch.Stoppable{w})
	stop()
	close(w.stopped)
	<-ctx.Done()
	assert.NoError(t, workerwatch.Stopped(ctx))

	parent, interrupt := context.WithCancel(context.Background())
	ctx, stop = workerwatch.Watch(parent, []workerwatch.Stoppable{&fakeWorker{stopped: make(chan struct{})}})
	defer stop()
	interrupt()
	<-ctx.Done()
	assert.NoError(t, workerwatch.Stopped(ctx))
}

// A worker that cannot run stops StartAll at once with the cause, and the
// workers started before it are returned, to be stopped. (The role may hold
// one connection, and the test holds it.)
func TestStartAllSaysWhyAWorkerCannotRun(t *testing.T) {
	t.Parallel()
	url := testdb.LimitedRole(t, 1)
	ctx := context.Background()
	held, err := pgx.Connect(ctx, url)
	require.NoError(t, err)
	defer held.Close(ctx)
	pool, err := pgxpool.New(ctx, url) // connects on first use
	require.NoError(t, err)
	defer pool.Close()
	sqlDB := stdlib.OpenDBFromPool(pool)
	defer sqlDB.Close()
	discard := slog.New(slog.DiscardHandler)
	app, err := orderpayment.New(orderpayment.Config{DB: sqlDB, GatewayURL: "http://127.0.0.1:1", Logger: discard})
	require.NoError(t, err)

	bound, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	workers, err := workerwatch.StartAll(bound, 2, app.NewWorker)
	defer workerwatch.StopAll(workers, discard)
	require.Error(t, err)
	require.NoError(t, bound.Err(), "StartAll waited out its context instead of failing")
	assert.Contains(t, err.Error(), "worker 1 of 2")
	assert.Contains(t, err.Error(), "too many connections for role")
	assert.Empty(t, workers)
}

// A service whose worker cannot be built stops StartFleet with its name and
// the cause; the workers of the services before it are in the fleet, and
// its Stop stops them.
func TestStartFleetStopsAtTheServiceThatCannotRun(t *testing.T) {
	t.Parallel()
	db := testdb.Fresh(t)
	discard := slog.New(slog.DiscardHandler)
	app, err := orderpayment.New(orderpayment.Config{DB: db.SQL, GatewayURL: "http://127.0.0.1:1", Logger: discard})
	require.NoError(t, err)
	require.NoError(t, app.Setup(context.Background()))
	fleet, err := workerwatch.StartFleet(context.Background(), 2,
		workerwatch.Service{Name: "orders", NewWorker: app.NewWorker},
		workerwatch.Service{Name: "payments", NewWorker: func() (*saga.Worker, error) { return nil, errors.New("no gateway") }})
	require.Error(t, err)
	assert.Equal(t, "payments: building worker 1 of 2: no gateway", err.Error())
	require.Len(t, fleet.Workers, 2, "the orders service's workers run")
	workers := fleet.Workers
	for _, w := range workers {
		select {
		case <-w.Stopped():
			t.Fatal("a worker stopped before the fleet was stopped")
		default:
		}
	}
	fleet.Stop(discard)
	for _, w := range workers {
		select {
		case <-w.Stopped():
		default:
			t.Fatal("a worker still runs after the fleet was stopped")
		}
	}
	assert.Empty(t, fleet.Workers)
	(*workerwatch.Fleet)(nil).Stop(discard) // a fleet never started
}
