package orderpayment

import (
	"context"
	"database/sql"
	"errors"
	"log/slog"
	"time"

	"github.com/pgsaga/pgsaga/payments"
	"github.com/pgsaga/pgsaga/saga"
	"github.com/pgsaga/pgsaga/saga/delivery"
	"github.com/pgsaga/pgsaga/steps"
	"github.com/pgsaga/pgsaga/steps/broker"
	"github.com/pgsaga/pgsaga/steps/events"
)

// PaymentServiceConfig configures the payment service of the split sample.
type PaymentServiceConfig struct {
	// DB is the database/sql handle over the payment service's own pool,
	// on its own database (migrated like any pgsaga database). Required.
	DB *sql.DB
	// GatewayURL is the payment gateway's base URL. Required.
	GatewayURL string
	// GatewayTimeout and GatewayLease: as Config's. Defaults: 2s, 10s.
	GatewayTimeout time.Duration
	GatewayLease   time.Duration
	// Broker connects the service with the orders service: the charge and
	// refund commands are received (group PaymentsGroup), the replies
	// relayed. Required.
	Broker broker.Broker
	// BrokerFaults injects failures at the broker boundary (tests).
	BrokerFaults broker.Faults
	// BrokerConsumers is how many consumers of each command topic the
	// bridge runs. Default: broker.ConsumersDefault.
	BrokerConsumers int
	// Transport configures the service's transport; DB and Logger are
	// filled in.
	Transport delivery.Config
	// ReplyTopic is the saga's reply topic, where the replies go (a command
	// names it too). Default: that of the sample's definition.
	ReplyTopic string
	// Retention of finished keys (Client.RunRetention).
	Retention Retention
	// Logger. Default: slog.Default().
	Logger *slog.Logger
}

// PaymentService is the payments participant of the sample as a service
// of its own: a saga.Client on its own database serving the charge and
// refund steps, with the same idempotency middleware (its idempotency_keys
// table is its inbox), reached through a message broker. It runs no saga:
// the orders service (App with Config.PaymentsBroker) does.
type PaymentService struct {
	Client   *saga.Client
	DB       *sql.DB
	Payments *payments.Service

	participants []steps.AnyStep
}

// NewPaymentService builds the payment service; it starts nothing.
func NewPaymentService(cfg PaymentServiceConfig) (*PaymentService, error) {
	if cfg.DB == nil || cfg.GatewayURL == "" || cfg.Broker == nil {
		return nil, errors.New("orderpayment: PaymentServiceConfig.DB, GatewayURL and Broker are required")
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.GatewayTimeout == 0 {
		cfg.GatewayTimeout = 2 * time.Second
	}
	if cfg.ReplyTopic == "" {
		def, err := saga.Define(Spec(Steps(StepTimeouts{})))
		if err != nil {
			return nil, err
		}
		cfg.ReplyTopic = def.ReplyTopic
	}
	c, err := saga.NewClientFromDB(cfg.DB, saga.ClientConfig{
		Transport:      cfg.Transport,
		RegisterEvents: []func(*events.Registry) error{payments.RegisterEvents},
		KeyTTL:         cfg.Retention.KeyTTL,
		Prune:          cfg.Retention.Sagas,
		Broker: broker.Config{Broker: cfg.Broker, Group: PaymentsGroup, Consumers: cfg.BrokerConsumers, Faults: cfg.BrokerFaults,
			Receive: []string{payments.ChargeTopic, payments.RefundTopic}, Relay: []string{cfg.ReplyTopic}},
		Logger: cfg.Logger,
	})
	if err != nil {
		return nil, err
	}
	pay, err := newPayments(c, cfg.DB, cfg.GatewayURL, cfg.GatewayTimeout, cfg.GatewayLease, cfg.Logger)
	if err != nil {
		return nil, err
	}
	participants := []steps.AnyStep{pay.ChargeStep(), pay.RefundStep()}
	if err := c.AddSteps(participants...); err != nil {
		return nil, err
	}
	return &PaymentService{Client: c, DB: cfg.DB, Payments: pay, participants: participants}, nil
}

// Setup records the service's subscriptions and the relay's, and
// provisions its topics at the broker; safe from several processes, and
// retried over a lost connection.
func (s *PaymentService) Setup(ctx context.Context) error { return setup(ctx, s.Client) }

// NewWorker builds a worker with the service's steps (see
// saga.Client.NewWorker); the bridge runs apart (Client.Bridge).
func (s *PaymentService) NewWorker() (*saga.Worker, error) { return s.Client.NewWorker() }

// StepNames lists the service's step names (their idempotency scopes).
func (s *PaymentService) StepNames() []string {
	out := make([]string, len(s.participants))
	for i, p := range s.participants {
		out[i] = p.Name()
	}
	return out
}
