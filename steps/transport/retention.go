package transport

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"time"
)

// RetentionConfig configures a Retention. Zero values take the documented
// defaults.
type RetentionConfig struct {
	// Topics to prune (logical names; every lane of each). Default: every
	// topic CreateTopics has recorded in this database.
	Topics []string
	// MinAge keeps consumed messages at least this long, for inspection.
	// Default: 0 (delete as soon as every consumer group has passed them).
	MinAge time.Duration
	// BatchSize is how many rows one statement, in its own transaction,
	// deletes: small batches keep locks and WAL bursts short. Default: 1000.
	BatchSize int
	// Interval between passes of Run. Default: 5s.
	Interval time.Duration
}

// Retention deletes the messages every consumer group of their topic has
// passed. watermill-sql never deletes a consumed message, and its poll
// slows as a table grows; with a Retention running, a topic holds only
// what some group has still to read (and MinAge's worth).
//
// A message is kept while any consumer group recorded in the topic's
// offsets table has not passed it, so a group that no longer runs holds
// back its topic's retention: drop it with DropConsumerGroup. A topic with
// no consumer group at all (a dead-letter topic read by people) is never
// pruned. Deleted rows are locked with SKIP LOCKED, so several processes may
// run a Retention each.
type Retention struct {
	t   *Transport
	cfg RetentionConfig
}

// NewRetention validates cfg and returns a Retention over t's database.
func (t *Transport) NewRetention(cfg RetentionConfig) (*Retention, error) {
	if cfg.BatchSize == 0 {
		cfg.BatchSize = 1000
	}
	if cfg.Interval == 0 {
		cfg.Interval = 5 * time.Second
	}
	var errs []error
	if cfg.BatchSize < 1 {
		errs = append(errs, fmt.Errorf("BatchSize must be positive, got %d", cfg.BatchSize))
	}
	if cfg.Interval < 0 || cfg.MinAge < 0 {
		errs = append(errs, errors.New("Interval and MinAge must not be negative"))
	}
	for _, topic := range cfg.Topics {
		if err := t.validateLanes(topic); err != nil {
			errs = append(errs, err)
		}
	}
	if err := errors.Join(errs...); err != nil {
		return nil, fmt.Errorf("transport: invalid retention config: %w", err)
	}
	return &Retention{t: t, cfg: cfg}, nil
}

// PruneResult says what one pass deleted.
type PruneResult struct {
	// Deleted messages, over all lanes.
	Deleted int
	// Batches run (statements, each its own transaction).
	Batches int
}

// RunOnce prunes every topic, batch by batch, until a batch comes back
// short.
func (r *Retention) RunOnce(ctx context.Context) (PruneResult, error) {
	var res PruneResult
	lanes, err := r.lanes(ctx)
	if err != nil {
		return res, err
	}
	for _, lane := range lanes {
		q := fmt.Sprintf(pruneSQL, r.t.MessagesTable(lane), r.t.OffsetsTable(lane))
		for {
			out, err := r.t.db.ExecContext(ctx, q, strconv.FormatInt(r.cfg.MinAge.Microseconds(), 10)+" microseconds", r.cfg.BatchSize)
			if isUndefinedTable(err) {
				break // recorded but not created in this database yet
			}
			if err != nil {
				return res, fmt.Errorf("transport: pruning %s: %w", lane, err)
			}
			n, _ := out.RowsAffected()
			res.Deleted += int(n)
			res.Batches++
			if n < int64(r.cfg.BatchSize) {
				break
			}
		}
	}
	return res, nil
}

// lanes lists the physical topics to prune.
func (r *Retention) lanes(ctx context.Context) ([]string, error) {
	if len(r.cfg.Topics) > 0 {
		var out []string
		for _, topic := range r.cfg.Topics {
			out = append(out, r.t.LaneTopics(topic)...)
		}
		return out, nil
	}
	rows, err := r.t.db.QueryContext(ctx, recordedTopicsSQL)
	if err != nil {
		return nil, fmt.Errorf("transport: listing topics to prune: %w", lanesTableHint(err))
	}
	defer rows.Close()
	var out []string
	for rows.Next() {
		var topic string
		var n int
		if err := rows.Scan(&topic, &n); err != nil {
			return nil, fmt.Errorf("transport: listing topics to prune: %w", err)
		}
		// The recorded count, not this process's configuration: it is
		// what the tables hold.
		out = append(out, laneNames(topic, n)...)
	}
	return out, rows.Err()
}

// Run prunes every Interval until ctx is done.
func (r *Retention) Run(ctx context.Context) error {
	t := time.NewTicker(r.cfg.Interval)
	defer t.Stop()
	for {
		res, err := r.RunOnce(ctx)
		switch {
		case err != nil && ctx.Err() == nil:
			r.t.log.Error("pruning consumed messages", "err", err)
		case res.Deleted > 0:
			r.t.log.Debug("pruned consumed messages", "deleted", res.Deleted, "batches", res.Batches)
		}
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
	}
}

// DropConsumerGroup forgets consumerGroup's position on every lane of
// topic, so it no longer holds back retention. A subscriber of that group
// that starts later reads what retention has left, from the start.
func (t *Transport) DropConsumerGroup(ctx context.Context, topic, consumerGroup string) error {
	if err := ValidateConsumerGroup(consumerGroup); err != nil {
		return err
	}
	for _, lane := range t.LaneTopics(topic) {
		if _, err := t.db.ExecContext(ctx, fmt.Sprintf(dropGroupSQL, t.OffsetsTable(lane)), consumerGroup); err != nil {
			return fmt.Errorf("transport: dropping consumer group %s of %s: %w", consumerGroup, lane, err)
		}
	}
	return nil
}
