package transport

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"time"

	pub "github.com/pgsaga/pgsaga/saga/delivery"
)

// ConsumerGroups lists every consumer group of every topic with what waits
// for it, by topic and group. It counts every queued row: on queues of
// millions it takes a while.
func (t *Transport) ConsumerGroups(ctx context.Context) ([]GroupStats, error) {
	rows, err := t.db.QueryContext(ctx, groupsSQL)
	if err != nil {
		return nil, fmt.Errorf("transport: listing consumer groups: %w", migrationHint(err))
	}
	defer rows.Close()
	var out []GroupStats
	for rows.Next() {
		var g GroupStats
		if err := rows.Scan(&g.Topic, &g.ConsumerGroup, &g.Created, &g.LastSeen, &g.Waiting, &g.Retrying, &g.NotYetAvailable, &g.Oldest, &g.ReadAt); err != nil {
			return nil, fmt.Errorf("transport: listing consumer groups: %w", err)
		}
		out = append(out, g)
	}
	return out, rows.Err()
}

// Alive records subs as run by a live process now, as a running router's
// heartbeat does (Config.HeartbeatInterval), so that ConsumerGroups and
// pgsaga consumers list them as running: for code that reads a group its
// own way (the relay to a broker).
func (t *Transport) Alive(ctx context.Context, subs ...Subscription) error { return t.seen(ctx, subs) }

// seen records subs as running now.
func (t *Transport) seen(ctx context.Context, subs []Subscription) error {
	topics, groups := make([]string, len(subs)), make([]string, len(subs))
	for i, s := range subs {
		topics[i], groups[i] = s.Topic, s.ConsumerGroup
	}
	if _, err := t.db.ExecContext(ctx, seenSQL, topics, groups); err != nil {
		return fmt.Errorf("transport: recording consumer groups as running: %w", migrationHint(err))
	}
	return nil
}

// heartbeat shows r's groups alive every Config.HeartbeatInterval until
// done is closed.
func (r *Router) heartbeat(done <-chan struct{}) {
	tick := time.NewTicker(r.t.cfg.HeartbeatInterval)
	defer tick.Stop()
	for {
		select {
		case <-done:
			return
		case <-tick.C:
		}
		ctx, cancel := context.WithTimeout(context.Background(), r.t.cfg.StatementTimeout)
		if err := r.t.seen(ctx, r.Subscriptions()); err != nil {
			r.log.Warn("heartbeat of the router's consumer groups failed; they may be listed as not running", "err", err)
		}
		cancel()
	}
}

// SubscribedGroups lists the consumer groups recorded for topic, by name.
func (t *Transport) SubscribedGroups(ctx context.Context, topic string) ([]string, error) {
	rows, err := t.db.QueryContext(ctx, `SELECT consumer_group FROM pgsaga_subscriptions WHERE topic = $1 ORDER BY consumer_group`, topic)
	if err != nil {
		return nil, fmt.Errorf("transport: listing the consumer groups of %s: %w", topic, migrationHint(err))
	}
	defer rows.Close()
	var out []string
	for rows.Next() {
		var g string
		if err := rows.Scan(&g); err != nil {
			return nil, err
		}
		out = append(out, g)
	}
	return out, rows.Err()
}

// Departed reports whether message uuid, published to topic, has left
// this database: it waits neither in the queue of the relay to a message
// broker (RelayGroup) nor, on a topic the relay does not read, in the
// queue of every local consumer group of topic untouched (once relayed,
// a local group's copy says nothing of the participant beyond the
// broker). A group's copy that is being handled, was handled,
// failed an attempt or is parked while its handler's call runs has been
// taken; so has a copy handled in process (no row). A message queued for
// a group that nobody runs, beside groups that took it, has left too. It
// reads through q, a transaction of the caller's or the database.
//
// It is what a saga's reply deadline counts from: a command still waiting
// here (the broker or every participant down) is not overdue, and sending
// it again would only queue a copy.
func (t *Transport) Departed(ctx context.Context, q Tx, topic, uuid string) (bool, error) {
	var waiting bool
	if err := q.QueryRowContext(ctx, waitingHereSQL, topic, uuid).Scan(&waiting); err != nil {
		return false, fmt.Errorf("transport: has message %s of %s left: %w", uuid, topic, migrationHint(err))
	}
	return !waiting, nil
}

// What users read and give of consumer groups (package delivery).
type (
	GroupStats              = pub.ConsumerGroup
	ConsumerGroupAliveError = pub.ConsumerGroupAliveError
	GroupDrop               = pub.GroupDrop
	DroppedGroup            = pub.DroppedGroup
)

// DropConsumerGroups forgets d.ConsumerGroup of d.Topic (of every topic it
// reads, if none), as DropConsumerGroup does, in one transaction; it
// returns what it dropped, by topic. With d.UnlessSeenWithin, a group a
// router showed alive that recently is not dropped
// (ErrConsumerGroupAlive): the check locks the group's rows first, so a
// heartbeat in flight is waited for and counts, and one that comes later
// waits for the drop (and records the group again). A group not recorded
// is ErrNoSuchConsumerGroup.
func (t *Transport) DropConsumerGroups(ctx context.Context, d GroupDrop) ([]DroppedGroup, error) {
	if err := ValidateConsumerGroup(d.ConsumerGroup); err != nil {
		return nil, err
	}
	if d.Topic != "" {
		if err := ValidateTopic(d.Topic); err != nil {
			return nil, err
		}
	}
	if d.UnlessSeenWithin < 0 {
		return nil, fmt.Errorf("transport: dropping consumer group %s: UnlessSeenWithin must not be negative, got %s", d.ConsumerGroup, d.UnlessSeenWithin)
	}
	dropped, err := t.dropGroups(ctx, d)
	if err != nil && !errors.Is(err, ErrConsumerGroupAlive) && !errors.Is(err, ErrNoSuchConsumerGroup) {
		return nil, fmt.Errorf("transport: dropping consumer group %s: %w", d.ConsumerGroup, migrationHint(err))
	}
	return dropped, err
}

func (t *Transport) dropGroups(ctx context.Context, d GroupDrop) ([]DroppedGroup, error) {
	tx, err := t.db.BeginTx(ctx, &sql.TxOptions{Isolation: sql.LevelReadCommitted})
	if err != nil {
		return nil, err
	}
	defer tx.Rollback() //nolint:errcheck // a no-op after Commit
	type sub struct {
		topic    string
		lastSeen *time.Time
	}
	var subs []sub
	rows, err := tx.QueryContext(ctx, lockGroupSQL, d.ConsumerGroup, d.Topic)
	if err != nil {
		return nil, err
	}
	for rows.Next() {
		var s sub
		if err := rows.Scan(&s.topic, &s.lastSeen); err != nil {
			rows.Close()
			return nil, err
		}
		subs = append(subs, s)
	}
	if err := rows.Err(); err != nil {
		return nil, err
	}
	if len(subs) == 0 {
		where := ""
		if d.Topic != "" {
			where = " of topic " + d.Topic
		}
		return nil, fmt.Errorf("%w: %s%s", ErrNoSuchConsumerGroup, d.ConsumerGroup, where)
	}
	if d.UnlessSeenWithin > 0 {
		// The time now, once the rows are locked: a heartbeat that held one
		// has committed, and the next one waits.
		var now time.Time
		if err := tx.QueryRowContext(ctx, `SELECT clock_timestamp()`).Scan(&now); err != nil {
			return nil, err
		}
		alive := &ConsumerGroupAliveError{ConsumerGroup: d.ConsumerGroup}
		for _, s := range subs {
			if s.lastSeen != nil && now.Sub(*s.lastSeen) <= d.UnlessSeenWithin {
				alive.Topics = append(alive.Topics, s.topic)
				if s.lastSeen.After(alive.LastSeen) {
					alive.LastSeen, alive.Ago = *s.lastSeen, now.Sub(*s.lastSeen)
				}
			}
		}
		if len(alive.Topics) > 0 {
			return nil, alive
		}
	}
	out := make([]DroppedGroup, len(subs))
	for i, s := range subs {
		res, err := tx.ExecContext(ctx, dropGroupSQL, s.topic, d.ConsumerGroup)
		if err != nil {
			return nil, err
		}
		n, _ := res.RowsAffected()
		out[i] = DroppedGroup{Topic: s.topic, Messages: n}
	}
	return out, tx.Commit()
}

// lockGroupSQL locks the subscriptions of consumer group $1 (of topic $2,
// or of every topic if $2 = ”), for a drop that checks when the group was
// last seen: a heartbeat (seenSQL) updating one of them is waited for, and
// its time read.
const lockGroupSQL = `SELECT topic, last_seen_at FROM pgsaga_subscriptions
WHERE consumer_group = $1 AND ($2 = '' OR topic = $2)
ORDER BY topic
FOR UPDATE`
