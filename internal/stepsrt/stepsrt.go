// Package stepsrt is the door to the step runtime for the saga client and
// the module's own tests: users reach steps through saga.Client (AddSteps)
// and the test kit, so package steps exports no runtime of its own.
// Package steps sets New when it is loaded.
package stepsrt

import (
	"context"
	"log/slog"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/pgsaga/pgsaga/idempotency"
	"github.com/pgsaga/pgsaga/internal/dbtx"
	"github.com/pgsaga/pgsaga/internal/transport"
	"github.com/pgsaga/pgsaga/steps/events"
)

// Config configures a Runtime.
type Config struct {
	// Transport publishes and subscribes. Required.
	Transport *transport.Transport
	// Store holds the steps' idempotency keys. Required.
	Store *idempotency.Store
	// KeyLockTimeout is Store's LockTimeout: the batch claims of keys
	// (keysql) wait as long as its claims. Default: 5s, as Store's.
	KeyLockTimeout time.Duration
	// Events is the event store behind steps.Tx.Append and Fold. Optional.
	Events *events.Store
	// Retry is the steps' retry policy. Default: the transport's. A command
	// whose attempts run out, or that fails permanently, goes to
	// pgsaga_dead_letters.
	Retry *transport.RetryPolicy
	// Logger. Default: slog.Default().
	Logger *slog.Logger
}

// Runtime runs steps. A step is a steps.AnyStep (any other value is an
// error).
type Runtime interface {
	// Register subscribes step to its topic on r, under the consumer
	// group named after it. opts add to the handler's options
	// (transport.InProcess, say); its retry policy is the runtime's.
	Register(r *transport.Router, step any, opts ...transport.HandlerOption) error
	// Subscriptions lists what steps consume, for Transport.Subscribe.
	Subscriptions(steps ...any) []transport.Subscription
	// Execute runs step for msg outside a subscriber, each attempt in a
	// transaction of its own, with the retries and dead-lettering of a
	// registered step.
	Execute(ctx context.Context, step any, msg *message.Message) error
	// Try runs step once for msg in a transaction it rolls back once
	// inspect has seen what the step did (the test kit's unit tier): the
	// attempt's failure is stepErr, anything else err.
	Try(ctx context.Context, step any, msg *message.Message, inspect func(tx dbtx.DBTX) error) (stepErr, err error)
}

// New validates cfg and returns a Runtime. Package steps sets it.
var New func(cfg Config) (Runtime, error)
