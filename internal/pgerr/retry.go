package pgerr

import (
	"context"
	"fmt"
	"time"

	"github.com/sethvargo/go-retry"
)

// retryAttempts bounds the calls RetryLost makes; with retryWaits they
// span about eleven seconds, more than a server takes to restart.
const retryAttempts = 10

// retryWaits are RetryLost's waits between calls: first, doubling, at most
// most, each within 20% either way (so that clients that lost their
// connections together do not come back together).
var retryWaits = struct{ first, most time.Duration }{100 * time.Millisecond, 2 * time.Second}

// RetryLost calls fn until it returns anything but a lost connection
// (ConnectionLost), at most ten times, waiting 100ms between the first two
// calls, then twice as long each time up to 2s: about eleven seconds in
// all. It returns fn's last error as it was. When ctx is done it stops
// waiting, and returns ctx's cause with fn's last error.
//
// Only an idempotent fn may be retried: one that, run again after a run
// whose outcome is unknown (the connection died during its COMMIT, which
// the server may have carried out), changes nothing more. A claimed
// idempotency key, INSERT … ON CONFLICT DO NOTHING, a change that is a
// no-op on the state it leaves are; an INSERT of a fresh row is not. Nor
// is pgconn.SafeToRetry the way to retry one that is not: pgx answers
// "conn closed", which it accepts, for a COMMIT it sent and the server
// carried out (orders' TestWritesRetryALostConnection cuts one off).
func RetryLost(ctx context.Context, fn func(ctx context.Context) error) error {
	_, err := RetryLostValue(ctx, func(ctx context.Context) (struct{}, error) { return struct{}{}, fn(ctx) })
	return err
}

// RetryLostValue is RetryLost for a function that returns a value.
func RetryLostValue[T any](ctx context.Context, fn func(ctx context.Context) (T, error)) (T, error) {
	waits := retry.WithMaxRetries(retryAttempts-1,
		retry.WithJitterPercent(20, retry.WithCappedDuration(retryWaits.most, retry.NewExponential(retryWaits.first))))
	var last error
	v, err := retry.DoValue(ctx, waits, func(ctx context.Context) (T, error) {
		v, err := fn(ctx)
		last = err
		if ConnectionLost(err) {
			return v, retry.RetryableError(err)
		}
		return v, err
	})
	if err != nil && ctx.Err() != nil && last != nil && err != last {
		return v, fmt.Errorf("%w (after: %w)", err, last)
	}
	return v, err
}
