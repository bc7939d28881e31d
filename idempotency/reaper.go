package idempotency

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"log/slog"
	"time"
)

// ReaperConfig configures a Reaper. Zero values take the documented defaults.
type ReaperConfig struct {
	// DB is required.
	DB *sql.DB
	// TTL is how long a finished key is kept. A duplicate that arrives later
	// than this is executed again, so TTL must exceed the longest time a
	// message can be redelivered or a client can retry. Default: 7 days.
	TTL time.Duration
	// BatchSize is how many keys one statement deletes; small batches keep
	// locks and WAL bursts short. Default: 500.
	BatchSize int
	// Interval between passes of Run. Default: 1 minute.
	Interval time.Duration
	// Logger. Default: slog.Default().
	Logger *slog.Logger
}

// Reaper deletes finished keys older than a TTL. It never deletes a pending
// key, and skips rows locked by another reaper or a replaying request, so
// several processes can run one each.
type Reaper struct {
	cfg ReaperConfig
}

// NewReaper validates cfg and returns a Reaper.
func NewReaper(cfg ReaperConfig) (*Reaper, error) {
	if cfg.TTL == 0 {
		cfg.TTL = 7 * 24 * time.Hour
	}
	if cfg.BatchSize == 0 {
		cfg.BatchSize = 500
	}
	if cfg.Interval == 0 {
		cfg.Interval = time.Minute
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	var errs []error
	if cfg.DB == nil {
		errs = append(errs, errors.New("DB is required"))
	}
	if cfg.TTL < 0 {
		errs = append(errs, fmt.Errorf("TTL must not be negative, got %s", cfg.TTL))
	}
	if cfg.BatchSize < 1 {
		errs = append(errs, fmt.Errorf("BatchSize must be positive, got %d", cfg.BatchSize))
	}
	if cfg.Interval <= 0 {
		errs = append(errs, fmt.Errorf("Interval must be positive, got %s", cfg.Interval))
	}
	if err := errors.Join(errs...); err != nil {
		return nil, fmt.Errorf("idempotency: invalid reaper config: %w", err)
	}
	return &Reaper{cfg: cfg}, nil
}

// RunOnce deletes expired keys batch by batch, each batch its own
// transaction, until a batch comes back short. It returns how many it
// deleted and how many batches it ran.
func (r *Reaper) RunOnce(ctx context.Context) (deleted, batches int, err error) {
	for {
		res, err := r.cfg.DB.ExecContext(ctx, reapSQL, r.cfg.TTL.Seconds(), r.cfg.BatchSize)
		if err != nil {
			return deleted, batches, fmt.Errorf("idempotency: reaping keys: %w", err)
		}
		n, _ := res.RowsAffected()
		deleted += int(n)
		batches++
		if n < int64(r.cfg.BatchSize) {
			return deleted, batches, nil
		}
	}
}

// Run reaps every Interval until ctx is done.
func (r *Reaper) Run(ctx context.Context) error {
	t := time.NewTicker(r.cfg.Interval)
	defer t.Stop()
	for {
		n, _, err := r.RunOnce(ctx)
		switch {
		case err != nil && ctx.Err() == nil:
			r.cfg.Logger.Error("reaping idempotency keys", "err", err)
		case n > 0:
			r.cfg.Logger.Info("reaped idempotency keys", "deleted", n, "ttl", r.cfg.TTL)
		}
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
	}
}
