package orderpayment

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"time"

	"github.com/pgsaga/pgsaga/idempotency"
	"github.com/pgsaga/pgsaga/internal/pgerr"
	"github.com/pgsaga/pgsaga/migrations"
	"github.com/pgsaga/pgsaga/orders"
	"github.com/pgsaga/pgsaga/payments"
	"github.com/pgsaga/pgsaga/saga"
	"github.com/pgsaga/pgsaga/saga/delivery"
	"github.com/pgsaga/pgsaga/steps"
	"github.com/pgsaga/pgsaga/steps/broker"
	"github.com/pgsaga/pgsaga/steps/events"
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
	// Transport configures delivery; DB and Logger are filled in.
	Transport delivery.Config
	// Timeouts of the saga's steps.
	Timeouts StepTimeouts
	// Steps of the saga. Default: Steps(Timeouts). Extend the saga by
	// appending to Steps(...) and adding the new participants to the
	// App's Client (Client.AddSteps) before it starts.
	Steps []saga.Step[Data]
	// Version of the saga definition. Default: 1. Bump it when the steps
	// change while instances may be running.
	Version int
	// RegisterEvents adds further event types to the event store.
	RegisterEvents func(*events.Registry) error
	// AsyncProjection keeps order_views by delivering each order event to
	// the projection's consumer group (orders.events is published) instead
	// of in the transaction that appends it (the default: inline, nothing
	// published).
	AsyncProjection bool
	// QueueEveryHop sends every trigger, command and reply through the
	// queue, as when each participant runs in a process of its own. By
	// default the orders steps (confirm, cancel: database only) and the
	// engine take in-process deliveries (saga.ClientConfig.InProcessSteps,
	// InProcessEngine): Place starts the saga in its own transaction; a
	// reply published by a step's delivery attempt is applied there, and
	// the confirm or cancel it leads to runs there too, with the same keys,
	// replies and timeline; whatever fails in process is queued as usual.
	// The payments steps call the gateway, so their commands are always
	// queued.
	QueueEveryHop bool
	// SweepInterval of the saga engine's deadline sweeper. Default: 1s.
	SweepInterval time.Duration
	// FinishedChannel is the saga engine's notification channel for
	// finished sagas (saga.ClientConfig.FinishedChannel). Default: none.
	FinishedChannel string
	// Retention of finished keys and sagas (App.RunRetention).
	Retention Retention
	// PaymentsBroker, when set, leaves the payments steps to the payment
	// service on a database of its own (NewPaymentService), reached
	// through this message broker: the charge and refund commands are
	// relayed to it and its replies received (group OrdersGroup). The
	// saga's definition is the same; App.Payments is nil, as the accounts
	// live in the payment service's database. GatewayURL is then unused.
	PaymentsBroker broker.Broker
	// BrokerFaults injects failures at the broker boundary (tests).
	BrokerFaults broker.Faults
	// BrokerConsumers is how many consumers of the reply topic the bridge
	// runs. Default: broker.ConsumersDefault.
	BrokerConsumers int
	// Logger. Default: slog.Default().
	Logger *slog.Logger
}

// Consumer groups of the split sample at the broker.
const (
	// OrdersGroup receives the saga's replies for the orders service.
	OrdersGroup = "orders"
	// PaymentsGroup receives the charge and refund commands for the
	// payment service.
	PaymentsGroup = "payments"
)

// App is the whole sample over one database: a saga.Client serving the
// order-payment saga, the orders and payments participants and the order
// projection. With Config.PaymentsBroker, it is the orders service only,
// and the payment service (NewPaymentService) runs on a database of its
// own.
type App struct {
	Client      *saga.Client
	DB          *sql.DB
	Idempotency *idempotency.Store
	Events      *events.Store
	Orders      *orders.Service
	Payments    *payments.Service
	Definition  *saga.Definition

	participants []steps.AnyStep
	log          *slog.Logger
}

// New builds the App; it starts nothing.
func New(cfg Config) (*App, error) {
	if cfg.DB == nil || (cfg.GatewayURL == "" && cfg.PaymentsBroker == nil) {
		return nil, errors.New("orderpayment: Config.DB and Config.GatewayURL (or PaymentsBroker) are required")
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.GatewayTimeout == 0 {
		cfg.GatewayTimeout = 2 * time.Second
	}
	regs := []func(*events.Registry) error{orders.RegisterEvents, payments.RegisterEvents}
	if cfg.RegisterEvents != nil {
		regs = append(regs, cfg.RegisterEvents)
	}
	ccfg := saga.ClientConfig{Transport: cfg.Transport, RegisterEvents: regs,
		EventsTopic: orders.StreamTopic, EventsNotPublished: !cfg.AsyncProjection, SweepInterval: cfg.SweepInterval, FinishedChannel: cfg.FinishedChannel,
		KeyTTL: cfg.Retention.KeyTTL, Prune: cfg.Retention.Sagas, Logger: cfg.Logger}
	if !cfg.QueueEveryHop {
		ccfg.InProcessSteps, ccfg.InProcessEngine = []string{orders.ConfirmStepName, orders.CancelStepName}, true
	}
	stepList := cfg.Steps
	if stepList == nil {
		stepList = Steps(cfg.Timeouts)
	}
	spec := Spec(stepList)
	if cfg.Version != 0 {
		spec.Version = cfg.Version
	}
	spec.Timeout = cfg.Timeouts.Saga
	def, err := saga.Define(spec)
	if err != nil {
		return nil, err
	}
	if cfg.PaymentsBroker != nil {
		ccfg.Broker = broker.Config{Broker: cfg.PaymentsBroker, Group: OrdersGroup, Consumers: cfg.BrokerConsumers, Faults: cfg.BrokerFaults,
			Relay: []string{payments.ChargeTopic, payments.RefundTopic}, Receive: []string{def.ReplyTopic}}
	}
	c, err := saga.NewClientFromDB(cfg.DB, ccfg)
	if err != nil {
		return nil, err
	}
	ord, err := orders.New(orders.Config{DB: cfg.DB, Idempotency: c.Idempotency(), Events: c.Events(), Logger: cfg.Logger,
		Trigger: func(ctx context.Context, tx delivery.DBTX, created orders.OrderCreated) error {
			_, err := c.StartTx(ctx, tx, Name, created)
			return err
		}})
	if err != nil {
		return nil, err
	}
	participants := []steps.AnyStep{ord.ConfirmStep(), ord.CancelStep()}
	var pay *payments.Service
	if cfg.PaymentsBroker == nil {
		if pay, err = newPayments(c, cfg.DB, cfg.GatewayURL, cfg.GatewayTimeout, cfg.GatewayLease, cfg.Logger); err != nil {
			return nil, err
		}
		participants = append(participants, pay.ChargeStep(), pay.RefundStep())
	}
	if err := c.Register(def); err != nil {
		return nil, err
	}
	if err := c.AddSteps(participants...); err != nil {
		return nil, err
	}
	projection := ord.Projection()
	projection.Inline = !cfg.AsyncProjection
	if err := c.AddProjections(projection); err != nil {
		return nil, err
	}
	return &App{Client: c, DB: cfg.DB, Idempotency: c.Idempotency(), Events: c.Events(),
		Orders: ord, Payments: pay, Definition: def, participants: participants, log: cfg.Logger}, nil
}

// StepNames lists the sample participants' step names (their idempotency
// scopes); steps added to the Client later are not among them.
func (a *App) StepNames() []string {
	out := make([]string, len(a.participants))
	for i, s := range a.participants {
		out[i] = s.Name()
	}
	return out
}

// Setup records the App's subscriptions, so that nothing published before
// the first worker starts goes unrouted; safe to run from several processes.
// Being a no-op the second time, it is retried over a lost connection.
func (a *App) Setup(ctx context.Context) error { return setup(ctx, a.Client) }

// setup runs c's Setup, again over a lost connection (pgerr.RetryLost):
// what it records is recorded once (ON CONFLICT DO NOTHING), what it
// provisions at a broker is there already the second time.
func setup(ctx context.Context, c *saga.Client) error { return pgerr.RetryLost(ctx, c.Setup) }

// NewWorker builds a worker (see saga.Client.NewWorker).
func (a *App) NewWorker() (*saga.Worker, error) { return a.Client.NewWorker() }

// newPayments is the payments domain over a client's stores.
func newPayments(c *saga.Client, db *sql.DB, gatewayURL string, timeout, lease time.Duration, logger *slog.Logger) (*payments.Service, error) {
	return payments.New(payments.Config{DB: db, Events: c.Events(), Idempotency: c.Idempotency(), Logger: logger,
		Gateway:      &payments.GatewayClient{BaseURL: gatewayURL, HTTP: &http.Client{Timeout: timeout}},
		GatewayLease: lease})
}

// Migrate brings db up to date for the sample: pgsaga's tables
// (migrations.Apply) and the domains' own (orders.Migrate,
// payments.Migrate), which pgsaga's migrations do not create. It returns
// the versions of pgsaga's migrations it applied.
func Migrate(ctx context.Context, db *sql.DB) ([]int64, error) {
	applied, err := migrations.Apply(ctx, db)
	if err != nil {
		return nil, err
	}
	if _, err := orders.Migrate(ctx, db); err != nil {
		return nil, fmt.Errorf("the orders tables: %w", err)
	}
	if _, err := payments.Migrate(ctx, db); err != nil {
		return nil, fmt.Errorf("the payments tables: %w", err)
	}
	return applied, nil
}
