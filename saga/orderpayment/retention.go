package orderpayment

import (
	"context"
	"time"

	"github.com/pgsaga/pgsaga/saga"
)

// Retention says how long the sample keeps what it no longer needs. Zero
// values take the defaults of saga.ClientConfig.
type Retention struct {
	// KeyTTL is how long finished idempotency keys are kept: a duplicate
	// arriving later runs again. Default: saga.KeyTTLDefault.
	KeyTTL time.Duration
	// Sagas prunes finished sagas. Default: timelines after
	// saga.HistoryTTLDefault, instances kept.
	Sagas saga.PruneConfig
}

// RunRetention runs the retention jobs (finished idempotency keys, finished
// sagas) until ctx is done (see saga.Client.RunRetention).
func (a *App) RunRetention(ctx context.Context) error { return a.Client.RunRetention(ctx) }
