package pgerr_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgerrcode"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/internal/pgerr"
)

// lost is what pg_terminate_backend makes a statement fail with.
var lost = &pgconn.PgError{Severity: "FATAL", Code: pgerrcode.AdminShutdown, Message: "terminating connection due to administrator command"}

func TestRetryLost(t *testing.T) {
	t.Cleanup(pgerr.FastRetries(time.Millisecond, 4*time.Millisecond))
	ctx := context.Background()

	t.Run("a lost connection is retried until the call succeeds", func(t *testing.T) {
		calls := 0
		v, err := pgerr.RetryLostValue(ctx, func(context.Context) (int, error) {
			calls++
			if calls < 3 {
				return 0, lost
			}
			return 42, nil
		})
		require.NoError(t, err)
		assert.Equal(t, 42, v)
		assert.Equal(t, 3, calls)
	})

	t.Run("any other error ends it at once", func(t *testing.T) {
		calls := 0
		other := &pgconn.PgError{Severity: "ERROR", Code: pgerrcode.QueryCanceled}
		err := pgerr.RetryLost(ctx, func(context.Context) error { calls++; return other })
		assert.Same(t, other, err)
		assert.Equal(t, 1, calls)
	})

	t.Run("attempts are bounded; the last error is returned as it was", func(t *testing.T) {
		calls := 0
		err := pgerr.RetryLost(ctx, func(context.Context) error { calls++; return lost })
		assert.Same(t, lost, err)
		assert.Equal(t, pgerr.RetryAttempts, calls)
	})

	t.Run("a done context stops the waits", func(t *testing.T) {
		t.Cleanup(pgerr.FastRetries(time.Hour, time.Hour))
		cctx, cancel := context.WithCancelCause(ctx)
		stop := errors.New("stopped")
		calls := 0
		start := time.Now()
		err := pgerr.RetryLost(cctx, func(context.Context) error {
			calls++
			cancel(stop)
			return lost
		})
		assert.ErrorIs(t, err, stop)
		assert.ErrorIs(t, err, lost, "what was being retried is said")
		assert.Equal(t, 1, calls)
		assert.Less(t, time.Since(start), time.Minute)
	})
}
