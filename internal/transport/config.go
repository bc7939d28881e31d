package transport

import (
	"database/sql"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5/stdlib"
	"go.opentelemetry.io/otel/trace"

	"github.com/prometheus/client_golang/prometheus"
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

// Config configures a Transport. Zero values take the defaults above.
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
	// (WithRetry). Default: see RetryPolicy.
	Retry RetryPolicy

	// Intercept wraps every handler of the transport's routers and of
	// HandleInTx, inside each attempt: what the wrapper writes or fails is
	// part of the attempt. Test kits use it to inject faults at commit
	// boundaries. It receives the handler's name. Default: none.
	Intercept func(handler string, h HandlerFunc) HandlerFunc

	// CloseTimeout bounds how long Router.Close waits for attempts in
	// flight; those still running then are cut off as by AttemptTimeout.
	// Default: CloseTimeoutDefault.
	CloseTimeout time.Duration

	// AwaitHold is how long a batch holds, once its deliveries are done,
	// for the calls their handlers await (Await) before handing their
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
	// (Transport.ConsumerGroups). Default: HeartbeatIntervalDefault.
	HeartbeatInterval time.Duration

	// MaxMessageBytes caps a message's size (payload and metadata): a
	// larger one is refused at publish with ErrMessageTooLarge, a
	// permanent error, before anything is written. Every process that
	// delivers it holds a batch of messages in memory, several times
	// over. Default: MaxMessageBytesDefault (4 MiB); at most 256 MiB.
	MaxMessageBytes int

	// MaxAwaitedCalls caps the awaited calls (Await) running at once in
	// this process, over all its routers: while that many run, its
	// consumers claim nothing more (each call holds a goroutine, and
	// usually a connection to a service, until it returns). A batch
	// claimed before the cap was reached may take it over by up to its
	// size. Default: MaxAwaitedCallsDefault.
	MaxAwaitedCalls int

	// Metrics, if set, is where this process's Prometheus metrics are
	// registered (prometheus.DefaultRegisterer, or a registry of your own):
	// retries and dead letters here, steps and sagas in the packages built
	// on the transport (they count through Transport.Metrics). Transports
	// given one registerer share its metrics. Default: nil, nothing counted.
	Metrics prometheus.Registerer

	// TracerProvider makes the spans of every publish, delivery attempt,
	// step attempt and saga decision, whose context travels in the
	// messages' metadata (see telemetry.Tracing). Default: the global
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

func (c *Config) setDefaults() {
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	setDefault(&c.BatchSize, BatchSizeDefault)
	setDefault(&c.Consumers, ConsumersDefault)
	setDefault(&c.NotifyChannel, NotifyChannelDefault)
	setDefault(&c.PollInterval, PollIntervalDefault)
	setDefault(&c.IdlePollInterval, IdlePollIntervalDefault)
	setDefault(&c.RetryInterval, RetryIntervalDefault)
	setDefault(&c.MaxRetryInterval, MaxRetryIntervalDefault)
	setDefault(&c.StatementTimeout, StatementTimeoutDefault)
	setDefault(&c.LockTimeout, LockTimeoutDefault)
	setDefault(&c.AttemptTimeout, AttemptTimeoutDefault)
	setDefault(&c.BatchTimeout, BatchTimeoutDefault)
	setDefault(&c.CloseTimeout, CloseTimeoutDefault)
	setDefault(&c.AwaitHold, AwaitHoldDefault)
	setDefault(&c.HeartbeatInterval, HeartbeatIntervalDefault)
	setDefault(&c.MaxMessageBytes, MaxMessageBytesDefault)
	setDefault(&c.MaxAwaitedCalls, MaxAwaitedCallsDefault)
	c.Retry.setDefaults()
}

func setDefault[T comparable](field *T, def T) {
	var zero T
	if *field == zero {
		*field = def
	}
}

func (c *Config) validate() error {
	var errs []error
	if c.DB == nil {
		errs = append(errs, errors.New("DB is required"))
	} else if _, ok := c.DB.Driver().(*stdlib.Driver); !ok {
		errs = append(errs, fmt.Errorf("%w, not %T", ErrNotPgx, c.DB.Driver()))
	}
	if c.BatchSize < 1 || c.BatchSize > 1000 {
		errs = append(errs, fmt.Errorf("BatchSize must be between 1 and 1000, got %d", c.BatchSize))
	}
	if c.Consumers < 1 || c.Consumers > 64 {
		errs = append(errs, fmt.Errorf("Consumers must be between 1 and 64, got %d", c.Consumers))
	}
	if len(c.NotifyChannel) > 63 || !namePattern.MatchString(c.NotifyChannel) {
		errs = append(errs, fmt.Errorf("NotifyChannel must be 1 to 63 characters from [A-Za-z0-9-$:._], got %q", c.NotifyChannel))
	}
	for _, d := range []struct {
		name string
		d    time.Duration
	}{
		{"PollInterval", c.PollInterval}, {"IdlePollInterval", c.IdlePollInterval}, {"RetryInterval", c.RetryInterval},
		{"MaxRetryInterval", c.MaxRetryInterval}, {"StatementTimeout", c.StatementTimeout}, {"LockTimeout", c.LockTimeout},
		{"AttemptTimeout", c.AttemptTimeout}, {"BatchTimeout", c.BatchTimeout}, {"CloseTimeout", c.CloseTimeout},
		{"HeartbeatInterval", c.HeartbeatInterval},
	} {
		if d.d < time.Millisecond {
			errs = append(errs, fmt.Errorf("%s must be at least 1ms, got %s", d.name, d.d))
		}
	}
	if c.MaxMessageBytes < 1 || c.MaxMessageBytes > 256<<20 {
		errs = append(errs, fmt.Errorf("MaxMessageBytes must be between 1 and %d, got %d", 256<<20, c.MaxMessageBytes))
	}
	if c.MaxAwaitedCalls < 1 {
		errs = append(errs, fmt.Errorf("MaxAwaitedCalls must be at least 1, got %d", c.MaxAwaitedCalls))
	}
	if c.AwaitHold > c.AttemptTimeout {
		errs = append(errs, fmt.Errorf("AwaitHold (%s) must not exceed AttemptTimeout (%s)", c.AwaitHold, c.AttemptTimeout))
	}
	if c.MaxRetryInterval < c.RetryInterval {
		errs = append(errs, fmt.Errorf("MaxRetryInterval (%s) must not be below RetryInterval (%s)", c.MaxRetryInterval, c.RetryInterval))
	}
	if err := c.Retry.validate(); err != nil {
		errs = append(errs, err)
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("transport: invalid config: %w", err)
	}
	return nil
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

func (p *RetryPolicy) setDefaults() {
	setDefault(&p.MaxAttempts, MaxAttemptsDefault)
	setDefault(&p.InitialBackoff, InitialBackoffDefault)
	setDefault(&p.MaxBackoff, MaxBackoffDefault)
}

func (p RetryPolicy) validate() error {
	if p.MaxAttempts < 1 {
		return fmt.Errorf("retry: MaxAttempts must be positive, got %d", p.MaxAttempts)
	}
	if p.InitialBackoff < 0 || p.MaxBackoff < p.InitialBackoff {
		return fmt.Errorf("retry: need 0 <= InitialBackoff (%s) <= MaxBackoff (%s)", p.InitialBackoff, p.MaxBackoff)
	}
	return nil
}

// final reports whether failed attempt n (1-based) is the message's last,
// wherever it runs (a consumer, HandleInTx): it failed permanently, its
// handler ended the transaction (it would every time), or it was the last
// attempt allowed.
func (p RetryPolicy) final(n int, cause error) bool {
	return IsPermanent(cause) || errors.Is(cause, ErrTransactionEnded) || n >= p.MaxAttempts
}

// backoff is the wait after the given failed attempt (1-based).
func (p RetryPolicy) backoff(attempt int) time.Duration {
	d := p.InitialBackoff
	for i := 1; i < attempt && d < p.MaxBackoff; i++ {
		d *= 2
	}
	return min(d, p.MaxBackoff)
}
