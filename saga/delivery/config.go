package delivery

import (
	"database/sql"
	"log/slog"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/prometheus/client_golang/prometheus"
	"go.opentelemetry.io/otel/trace"
)

// Defaults of Config and RetryPolicy.
const (
	BatchSizeDefault         = 50
	ConsumersDefault         = 1
	NotifyChannelDefault     = "pgsaga_wakeup"
	PollIntervalDefault      = time.Second
	IdlePollIntervalDefault  = 10 * time.Second
	RetryIntervalDefault     = 100 * time.Millisecond
	MaxRetryIntervalDefault  = 5 * time.Second
	StatementTimeoutDefault  = 10 * time.Second
	LockTimeoutDefault       = 5 * time.Second
	AttemptTimeoutDefault    = 30 * time.Second
	BatchTimeoutDefault      = time.Second
	CloseTimeoutDefault      = 30 * time.Second
	AwaitHoldDefault         = 10 * time.Millisecond
	HeartbeatIntervalDefault = 30 * time.Second
	MaxMessageBytesDefault   = 4 << 20
	MaxAwaitedCallsDefault   = 1000

	MaxAttemptsDefault    = 5
	InitialBackoffDefault = 100 * time.Millisecond
	MaxBackoffDefault     = 2 * time.Second
)

// Config is how pgsaga delivers messages through PostgreSQL: the queue's
// batches, wake-ups, timeouts and retries, for every consumer, router and
// publisher of a process (saga.ClientConfig.Transport). Zero values take
// the defaults above.
type Config struct {
	// DB is the database/sql handle over the process's pgx pool
	// (stdlib.OpenDBFromPool or stdlib.OpenDB): the transport sends its own
	// writes as pipelined pgx batches on the connection of each delivery.
	// Required.
	DB *sql.DB

	// Logger receives the transport's and Watermill's logs. Watermill's info
	// logs are lowered to debug. Default: slog.Default().
	Logger *slog.Logger

	// BatchSize is how many messages a consumer claims per transaction.
	// Larger batches commit less often; every message of a batch waits for
	// the ones before it. Keep it below 64: each attempt that writes leaves
	// a subtransaction in the batch, and PostgreSQL caches only 64 per
	// backend. Default: BatchSizeDefault.
	BatchSize int

	// Consumers is how many consumers each Router handler runs in parallel.
	// Each claims its own batches of the handler's consumer group (FOR
	// UPDATE SKIP LOCKED), so consumers in one process or in many never
	// wait for one another. Each holds a connection while it handles a
	// batch. Default: ConsumersDefault.
	Consumers int

	// DisableNotify stops this process's consumers from listening for
	// wake-ups: they poll every PollInterval instead. (Its publishes still
	// notify, for the processes that listen.) By default every publish sends
	// a notification in its transaction (delivered only if it commits) and
	// idle consumers wait for one instead of polling; the process holds one
	// LISTEN connection of the pool for all its consumers while any runs.
	DisableNotify bool

	// NotifyChannel is the notification channel of wake-ups. Every process
	// on a database must use the same: the first records it
	// (pgsaga_settings), and one configured otherwise is refused when it
	// starts (ErrSettingsDiffer). Default: NotifyChannelDefault.
	NotifyChannel string

	// PollInterval is how long an idle consumer waits before polling again
	// when wake-ups are off or the listening connection is down. Default:
	// PollIntervalDefault.
	PollInterval time.Duration

	// IdlePollInterval is how long an idle consumer waits for a wake-up
	// before polling anyway: a safety net for messages whose wake-up was
	// never sent (a publisher that crashed after committing, say), not the
	// normal path. Default: IdlePollIntervalDefault.
	IdlePollInterval time.Duration

	// RetryInterval is the first wait after a failed poll (a lost
	// connection, say); it doubles up to MaxRetryInterval. Defaults:
	// RetryIntervalDefault, MaxRetryIntervalDefault.
	RetryInterval    time.Duration
	MaxRetryInterval time.Duration

	// StatementTimeout bounds every statement of a delivery transaction
	// (statement_timeout). Default: StatementTimeoutDefault.
	StatementTimeout time.Duration

	// LockTimeout bounds every lock wait of a delivery transaction
	// (lock_timeout); a wait that outlasts it fails the attempt, which is
	// retried. Default: LockTimeoutDefault.
	LockTimeout time.Duration

	// AttemptTimeout bounds one delivery attempt. An attempt still running
	// then is cut off: its running statement is cancelled, everything it
	// did is rolled back, and it counts as a failed attempt. Its handler's
	// context is done at the same moment. Default: AttemptTimeoutDefault.
	AttemptTimeout time.Duration

	// BatchTimeout is how long a batch keeps starting attempts, counted
	// from its first; every batch runs one at least. Its messages not
	// started by then are released untouched, for other consumers, when
	// the batch commits what it did. Default: BatchTimeoutDefault.
	BatchTimeout time.Duration

	// Retry is the retry policy of every handler that does not set its own
	// (saga.ClientConfig.Retry sets the steps'). Default: see RetryPolicy.
	Retry RetryPolicy

	// Intercept wraps every handler the process delivers to (queued or in
	// process), inside each attempt: what the wrapper writes or fails is
	// part of the attempt. Test kits use it to inject faults at commit
	// boundaries. It receives the handler's name. Default: none.
	Intercept func(handler string, h message.NoPublishHandlerFunc) message.NoPublishHandlerFunc

	// CloseTimeout bounds how long stopping (saga.Client.Stop) waits for
	// attempts in flight; those still running then are cut off as by AttemptTimeout.
	// Default: CloseTimeoutDefault.
	CloseTimeout time.Duration

	// AwaitHold is how long a batch holds, once its deliveries are done,
	// for the calls their handlers await (steps.Await) before handing their
	// messages back: a call that returned by then (a fast service) is
	// followed by the handler's next run in the same batch, right before
	// its commit, without parking the message and delivering it again. The
	// batch goes on with its other messages while the calls run, so they
	// run together and a batch waits at most one AwaitHold for them,
	// whatever its size; a slow service costs each batch that much. The run
	// after the call has an attempt's whole time (AttemptTimeout); one
	// whose call returns when the batch has no room left for it, or the
	// router closes, is parked and woken instead. Negative: hand the
	// message back at once. Default: AwaitHoldDefault.
	AwaitHold time.Duration

	// HeartbeatInterval is how often a running router records its consumer
	// groups as alive (pgsaga_subscriptions.last_seen_at), so that
	// operators can tell the groups that no longer run
	// (saga.Client.ConsumerGroups). Default: HeartbeatIntervalDefault.
	HeartbeatInterval time.Duration

	// MaxMessageBytes caps a message's size (payload and metadata): a
	// larger one is refused at publish with ErrMessageTooLarge, a
	// permanent error, before anything is written. Every process that
	// delivers it holds a batch of messages in memory, several times
	// over. Default: MaxMessageBytesDefault (4 MiB); at most 256 MiB.
	MaxMessageBytes int

	// MaxAwaitedCalls caps the awaited calls (steps.Await) running at once in
	// this process, over all its routers: while that many run, its
	// consumers claim nothing more (each call holds a goroutine, and
	// usually a connection to a service, until it returns). A batch
	// claimed before the cap was reached may take it over by up to its
	// size. Default: MaxAwaitedCallsDefault.
	MaxAwaitedCalls int

	// Metrics, if set, is where this process's Prometheus metrics are
	// registered (prometheus.DefaultRegisterer, or a registry of your own):
	// retries and dead letters here, steps and sagas in the packages built
	// on the transport. Processes' parts given one registerer share its
	// metrics. Default: nil, nothing counted.
	Metrics prometheus.Registerer

	// TracerProvider makes the spans of every publish, delivery attempt,
	// step attempt and saga decision, whose context travels in the
	// messages' metadata (W3C trace context). Default: the global
	// provider (otel.GetTracerProvider), which exports nothing until a
	// program installs one.
	TracerProvider trace.TracerProvider
}

// MaxTransactionDuration is the longest a delivery transaction stays open:
// its claim (a statement), the batch's window for starting attempts, the
// last attempt, and the statement that lets it commit, with a second to
// spare. The transaction is rolled back if it gets
// there (an unresponsive connection, say), and PostgreSQL ends a session that
// sits idle in one for that long (a frozen worker).
func (c Config) MaxTransactionDuration() time.Duration {
	return c.BatchTimeout + c.AttemptTimeout + 2*c.StatementTimeout + time.Second
}

// RetryPolicy says how the failed attempts of a message are retried. A
// failed attempt is rolled back and the message is released with its
// attempt count; it is claimed again, by any consumer of its group, once
// its backoff has passed. No transaction is held meanwhile. Zero values
// take the defaults.
type RetryPolicy struct {
	// MaxAttempts is how many attempts a message gets before it is
	// dead-lettered. Default: MaxAttemptsDefault.
	MaxAttempts int
	// InitialBackoff is the wait after the first failed attempt; it doubles
	// up to MaxBackoff. Defaults: InitialBackoffDefault, MaxBackoffDefault.
	InitialBackoff time.Duration
	MaxBackoff     time.Duration
}
