package transport

import (
	"errors"
	"fmt"
	"log/slog"
	"time"

	pub "github.com/pgsaga/pgsaga/saga/delivery"

	"github.com/jackc/pgx/v5/stdlib"
)

// Config and RetryPolicy are the delivery settings users give (package
// delivery); their defaults are delivery's.
type (
	Config      = pub.Config
	RetryPolicy = pub.RetryPolicy
)

// Defaults of Config and RetryPolicy.
const (
	BatchSizeDefault         = pub.BatchSizeDefault
	ConsumersDefault         = pub.ConsumersDefault
	NotifyChannelDefault     = pub.NotifyChannelDefault
	PollIntervalDefault      = pub.PollIntervalDefault
	IdlePollIntervalDefault  = pub.IdlePollIntervalDefault
	RetryIntervalDefault     = pub.RetryIntervalDefault
	MaxRetryIntervalDefault  = pub.MaxRetryIntervalDefault
	StatementTimeoutDefault  = pub.StatementTimeoutDefault
	LockTimeoutDefault       = pub.LockTimeoutDefault
	AttemptTimeoutDefault    = pub.AttemptTimeoutDefault
	BatchTimeoutDefault      = pub.BatchTimeoutDefault
	CloseTimeoutDefault      = pub.CloseTimeoutDefault
	AwaitHoldDefault         = pub.AwaitHoldDefault
	HeartbeatIntervalDefault = pub.HeartbeatIntervalDefault
	MaxMessageBytesDefault   = pub.MaxMessageBytesDefault
	MaxAwaitedCallsDefault   = pub.MaxAwaitedCallsDefault
	MaxAttemptsDefault       = pub.MaxAttemptsDefault
	InitialBackoffDefault    = pub.InitialBackoffDefault
	MaxBackoffDefault        = pub.MaxBackoffDefault
)

// setDefaults fills c's zero values with the defaults.
func setDefaults(c *Config) {
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
	setRetryDefaults(&c.Retry)
}

func setDefault[T comparable](field *T, def T) {
	var zero T
	if *field == zero {
		*field = def
	}
}

// validate says what is wrong with c, all of it.
func validate(c *Config) error {
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
	if err := validateRetry(c.Retry); err != nil {
		errs = append(errs, err)
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("transport: invalid config: %w", err)
	}
	return nil
}

func setRetryDefaults(p *RetryPolicy) {
	setDefault(&p.MaxAttempts, MaxAttemptsDefault)
	setDefault(&p.InitialBackoff, InitialBackoffDefault)
	setDefault(&p.MaxBackoff, MaxBackoffDefault)
}

func validateRetry(p RetryPolicy) error {
	if p.MaxAttempts < 1 {
		return fmt.Errorf("retry: MaxAttempts must be positive, got %d", p.MaxAttempts)
	}
	if p.InitialBackoff < 0 || p.MaxBackoff < p.InitialBackoff {
		return fmt.Errorf("retry: need 0 <= InitialBackoff (%s) <= MaxBackoff (%s)", p.InitialBackoff, p.MaxBackoff)
	}
	return nil
}

// final reports whether, under p, failed attempt n (1-based) is the message's last,
// wherever it runs (a consumer, HandleInTx): it failed permanently, its
// handler ended the transaction (it would every time), or it was the last
// attempt allowed.
func final(p RetryPolicy, n int, cause error) bool {
	return IsPermanent(cause) || errors.Is(cause, ErrTransactionEnded) || n >= p.MaxAttempts
}

// backoff is p's wait after the given failed attempt (1-based).
func backoff(p RetryPolicy, attempt int) time.Duration {
	d := p.InitialBackoff
	for i := 1; i < attempt && d < p.MaxBackoff; i++ {
		d *= 2
	}
	return min(d, p.MaxBackoff)
}
