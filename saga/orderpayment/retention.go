package orderpayment

import (
	"context"
	"errors"
	"sync"
	"time"

	"github.com/pgsaga/pgsaga/idempotency"
	"github.com/pgsaga/pgsaga/saga"
)

// Retention says how long the sample keeps what it no longer needs. Zero
// values take the documented defaults.
type Retention struct {
	// KeyTTL is how long finished idempotency keys are kept: a duplicate
	// arriving later runs again. Default: 7 days.
	KeyTTL time.Duration
	// Sagas prunes finished sagas. Default: timelines after 30 days,
	// instances kept.
	Sagas saga.PruneConfig
}

// RunRetention runs the retention jobs (finished idempotency keys, finished
// sagas) until ctx is done. Every job is safe to run in several processes;
// one per process is plenty. (Delivered messages need none: a queue row is
// deleted with the transaction that handled it.)
func (a *App) RunRetention(ctx context.Context, r Retention) error {
	if r.Sagas.History == 0 && r.Sagas.Instances == 0 {
		r.Sagas.History = 30 * 24 * time.Hour
	}
	keys, err := idempotency.NewReaper(idempotency.ReaperConfig{DB: a.DB, TTL: r.KeyTTL, Logger: a.log})
	if err != nil {
		return err
	}
	var (
		wg   sync.WaitGroup
		mu   sync.Mutex
		errs []error
	)
	for _, job := range []func(context.Context) error{
		keys.Run,
		func(ctx context.Context) error { return a.Engine.RunPrune(ctx, r.Sagas) },
	} {
		wg.Go(func() {
			if err := job(ctx); err != nil {
				mu.Lock()
				errs = append(errs, err)
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	return errors.Join(errs...)
}
