package transport

import (
	"context"
	"fmt"
	"time"
)

// GroupStats is what a consumer group of a topic has waiting, and whether
// it runs.
type GroupStats struct {
	Topic         string
	ConsumerGroup string
	// Created is when the group was first recorded.
	Created time.Time
	// LastSeen is when a running router last showed the group alive (its
	// start, then every Config.HeartbeatInterval); nil if no router ever
	// ran it (it was only set up with Subscribe).
	LastSeen *time.Time
	// Waiting counts the messages queued for the group; Retrying those of
	// them that failed before; NotYetAvailable those waiting out a backoff
	// or an awaited call.
	Waiting, Retrying, NotYetAvailable int
	// Oldest is when the oldest waiting message was published; nil if none
	// waits.
	Oldest *time.Time
}

// Running reports whether a router showed the group alive within stale
// (a few heartbeats).
func (g GroupStats) Running(now time.Time, stale time.Duration) bool {
	return g.LastSeen != nil && now.Sub(*g.LastSeen) <= stale
}

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
		if err := rows.Scan(&g.Topic, &g.ConsumerGroup, &g.Created, &g.LastSeen, &g.Waiting, &g.Retrying, &g.NotYetAvailable, &g.Oldest); err != nil {
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
