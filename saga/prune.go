package saga

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"
)

// PruneConfig says what the retention job (ClientConfig.Prune) deletes. Zero durations keep
// everything of their kind.
type PruneConfig struct {
	// History deletes the timelines of sagas that completed or compensated
	// longer ago than this; the instances stay. Operators' requests
	// (saga_requests) carried out longer ago than this go too. Default: 0
	// (keep).
	History time.Duration
	// Instances deletes sagas that completed or compensated longer ago
	// than this, timeline included. A deleted instance no longer
	// deduplicates its trigger: a trigger delivered again after that starts
	// the saga anew, so keep instances longer than any trigger can be
	// redelivered (and longer than the participants' idempotency keys).
	// Failed sagas are never deleted: they wait for an operator. Default: 0
	// (keep). Without History, operators' requests carried out longer ago
	// than this go too.
	Instances time.Duration
	// BatchSize is how many rows one statement, in its own transaction,
	// deletes. Default: 500.
	BatchSize int
	// Interval between passes of RunPrune. Default: 1 minute.
	Interval time.Duration
}

func (c *PruneConfig) setDefaults() error {
	if c.BatchSize == 0 {
		c.BatchSize = 500
	}
	if c.Interval == 0 {
		c.Interval = time.Minute
	}
	if c.History < 0 || c.Instances < 0 || c.BatchSize < 1 || c.Interval < 0 {
		return errors.New("saga: PruneConfig: durations must not be negative and BatchSize must be positive")
	}
	return nil
}

// pruneResult says what one pass deleted.
type pruneResult struct {
	HistoryEntries int
	Instances      int
	Requests       int
}

// Prune deletes what cfg says, batch by batch, each batch its own
// transaction, skipping rows another pruner or a reaction holds: several
// processes may prune at once.
func (e *engine) Prune(ctx context.Context, cfg PruneConfig) (pruneResult, error) {
	var res pruneResult
	if err := cfg.setDefaults(); err != nil {
		return res, err
	}
	requests := cfg.History
	if requests == 0 {
		requests = cfg.Instances
	}
	for _, job := range []struct {
		age   time.Duration
		query string
		count *int
	}{
		{cfg.History, pruneHistorySQL, &res.HistoryEntries},
		{cfg.Instances, pruneInstancesSQL, &res.Instances},
		{requests, pruneRequestsSQL, &res.Requests},
	} {
		if job.age == 0 {
			continue
		}
		for {
			out, err := e.cfg.DB.ExecContext(ctx, job.query, job.age.Seconds(), cfg.BatchSize)
			if err != nil {
				return res, fmt.Errorf("saga: pruning: %w", err)
			}
			n, _ := out.RowsAffected()
			*job.count += int(n)
			if n < int64(cfg.BatchSize) {
				break
			}
		}
	}
	return res, nil
}

// RunPrune prunes every cfg.Interval until ctx is done.
func (e *engine) RunPrune(ctx context.Context, cfg PruneConfig) error {
	if err := cfg.setDefaults(); err != nil {
		return err
	}
	t := time.NewTicker(cfg.Interval)
	defer t.Stop()
	for {
		res, err := e.Prune(ctx, cfg)
		switch {
		case err != nil && ctx.Err() == nil:
			e.log.Error("pruning finished sagas", "err", err)
		case res != (pruneResult{}):
			e.log.Log(ctx, slog.LevelDebug, "pruned finished sagas", "history_entries", res.HistoryEntries, "instances", res.Instances,
				"requests", res.Requests)
		}
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
	}
}
