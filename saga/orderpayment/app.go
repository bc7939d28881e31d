package orderpayment

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/pgsaga/pgsaga/idempotency"
	"github.com/pgsaga/pgsaga/orders"
	"github.com/pgsaga/pgsaga/payments"
	"github.com/pgsaga/pgsaga/saga"
	"github.com/pgsaga/pgsaga/steps"
	"github.com/pgsaga/pgsaga/steps/events"
	"github.com/pgsaga/pgsaga/steps/transport"
)

// Config configures an App.
type Config struct {
	// DB is the database/sql handle over the process's pool. Required.
	DB *sql.DB
	// GatewayURL is the payment gateway's base URL. Required.
	GatewayURL string
	// GatewayTimeout bounds each gateway call. Default: 2s.
	GatewayTimeout time.Duration
	// GatewayLease is how long a gateway call is held before another worker
	// may take it over. Default: 10s.
	GatewayLease time.Duration
	// Transport configures the transport; DB and Logger are filled in.
	Transport transport.Config
	// Timeouts of the saga's steps.
	Timeouts StepTimeouts
	// Steps of the saga. Default: Steps(Timeouts). Extend the saga by
	// appending to Steps(...) and registering the new participants.
	Steps []saga.Step[Data]
	// Version of the saga definition. Default: 1. Bump it when the steps
	// change while instances may be running.
	Version int
	// Participants are further steps (the new step's participants) that
	// every worker runs.
	Participants []steps.Step
	// RegisterEvents adds further event types to the event store.
	RegisterEvents func(*events.Registry) error
	// SweepInterval of the saga engine's deadline sweeper. Default: 1s.
	SweepInterval time.Duration
	// FinishedChannel is the saga engine's notification channel for
	// finished sagas (saga.Config.FinishedChannel). Default: none.
	FinishedChannel string
	// Logger. Default: slog.Default().
	Logger *slog.Logger
}

// App is the whole sample over one database.
type App struct {
	DB          *sql.DB
	Transport   *transport.Transport
	Idempotency *idempotency.Store
	Events      *events.Store
	Runtime     *steps.Runtime
	Orders      *orders.Service
	Payments    *payments.Service
	Engine      *saga.Engine
	Definition  *saga.Definition

	participants []steps.Step
	log          *slog.Logger
}

// New builds the App; it starts nothing.
func New(cfg Config) (*App, error) {
	if cfg.DB == nil || cfg.GatewayURL == "" {
		return nil, errors.New("orderpayment: Config.DB and Config.GatewayURL are required")
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.GatewayTimeout == 0 {
		cfg.GatewayTimeout = 2 * time.Second
	}
	tcfg := cfg.Transport
	tcfg.DB, tcfg.Logger = cfg.DB, cfg.Logger
	tr, err := transport.New(tcfg)
	if err != nil {
		return nil, err
	}
	store, err := idempotency.NewStore(idempotency.Config{DB: cfg.DB, Logger: cfg.Logger})
	if err != nil {
		return nil, err
	}
	reg := events.NewRegistry()
	regs := []func(*events.Registry) error{orders.RegisterEvents, payments.RegisterEvents}
	if cfg.RegisterEvents != nil {
		regs = append(regs, cfg.RegisterEvents)
	}
	for _, r := range regs {
		if err := r(reg); err != nil {
			return nil, err
		}
	}
	es, err := events.NewStore(events.Config{Registry: reg, Topic: orders.StreamTopic,
		Publisher: func(tx events.DBTX) message.Publisher { return tr.Publisher(tx) }})
	if err != nil {
		return nil, err
	}
	rt, err := steps.New(steps.Config{Transport: tr, Store: store, Events: es, Logger: cfg.Logger})
	if err != nil {
		return nil, err
	}
	ord, err := orders.New(orders.Config{DB: cfg.DB, Transport: tr, Idempotency: store, Events: es, Logger: cfg.Logger})
	if err != nil {
		return nil, err
	}
	pay, err := payments.New(payments.Config{DB: cfg.DB, Events: es, Idempotency: store, Logger: cfg.Logger,
		Gateway:      &payments.GatewayClient{BaseURL: cfg.GatewayURL, HTTP: &http.Client{Timeout: cfg.GatewayTimeout}},
		GatewayLease: cfg.GatewayLease})
	if err != nil {
		return nil, err
	}
	engine, err := saga.NewEngine(saga.Config{DB: cfg.DB, Transport: tr, SweepInterval: cfg.SweepInterval,
		FinishedChannel: cfg.FinishedChannel, Logger: cfg.Logger})
	if err != nil {
		return nil, err
	}
	stepList := cfg.Steps
	if stepList == nil {
		stepList = Steps(cfg.Timeouts)
	}
	spec := Spec(stepList)
	if cfg.Version != 0 {
		spec.Version = cfg.Version
	}
	def, err := saga.Define(spec)
	if err != nil {
		return nil, err
	}
	if err := engine.Register(def); err != nil {
		return nil, err
	}
	participants := append([]steps.Step{ord.ConfirmStep(), ord.CancelStep(), pay.ChargeStep(), pay.RefundStep()}, cfg.Participants...)
	return &App{DB: cfg.DB, Transport: tr, Idempotency: store, Events: es, Runtime: rt, Orders: ord, Payments: pay,
		Engine: engine, Definition: def, participants: participants, log: cfg.Logger}, nil
}

// Subscriptions lists what the App's workers consume: the participants'
// steps, the order projection and the saga engine.
func (a *App) Subscriptions() []transport.Subscription {
	subs := a.Runtime.Subscriptions(a.participants...)
	subs = append(subs, a.Orders.Subscriptions()...)
	return append(subs, a.Engine.Subscriptions()...)
}

// StepNames lists the participants' step names (their idempotency scopes).
func (a *App) StepNames() []string {
	out := make([]string, len(a.participants))
	for i, s := range a.participants {
		out[i] = s.Name
	}
	return out
}

// Setup records the App's subscriptions, so that nothing published before
// the first worker starts goes unrouted; safe to run from several processes.
func (a *App) Setup(ctx context.Context) error {
	return a.Transport.Subscribe(ctx, a.Subscriptions()...)
}

// Worker is one router with every handler of the App (the participants'
// steps, the order projection, the saga engine) and a deadline sweeper.
// Several workers, in one process or many, share the work: the consumers of
// a handler's group claim different messages.
type Worker struct {
	app    *App
	router *transport.Router

	mu      sync.Mutex
	started bool          // Start succeeded
	stopped chan struct{} // closed once it stopped, sweeper included
}

// NewWorker builds a worker.
func (a *App) NewWorker() (*Worker, error) {
	r, err := a.Transport.NewRouter()
	if err != nil {
		return nil, err
	}
	for _, s := range a.participants {
		if err := a.Runtime.Register(r, s); err != nil {
			return nil, fmt.Errorf("orderpayment: registering %s: %w", s.Name, err)
		}
	}
	if err := a.Orders.RegisterProjection(r); err != nil {
		return nil, err
	}
	if err := a.Engine.AddHandlers(r); err != nil {
		return nil, err
	}
	return &Worker{app: a, router: r, stopped: make(chan struct{})}, nil
}

// Run runs the worker until ctx is cancelled, then drains it; it returns
// once everything stopped.
func (w *Worker) Run(ctx context.Context) error {
	sweepCtx, stopSweeper := context.WithCancel(ctx)
	var wg sync.WaitGroup
	wg.Go(func() { _ = w.app.Engine.RunSweeper(sweepCtx) })
	err := w.router.Run(ctx)
	stopSweeper()
	wg.Wait()
	return err
}

// Running is closed once the worker's router runs; never if Run fails
// first (Start waits for both).
func (w *Worker) Running() chan struct{} { return w.router.Running() }

// Close drains and stops the worker.
func (w *Worker) Close() error { return w.router.Close() }

// Start runs the worker in the background and returns once it runs, or with
// the reason it could not start. ctx bounds the start only: the worker runs
// until Stop or until it fails (see Stopped).
func (w *Worker) Start(ctx context.Context) error {
	if err := w.router.Start(ctx); err != nil {
		return fmt.Errorf("orderpayment: starting worker: %w", err)
	}
	w.mu.Lock()
	w.started = true
	w.mu.Unlock()
	sweepCtx, stopSweeper := context.WithCancel(context.WithoutCancel(ctx))
	var wg sync.WaitGroup
	wg.Go(func() { _ = w.app.Engine.RunSweeper(sweepCtx) })
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
// ended with.
func (w *Worker) Stop() error {
	err := w.router.Stop()
	w.mu.Lock()
	started := w.started
	w.mu.Unlock()
	if started {
		<-w.stopped
	}
	return err
}
