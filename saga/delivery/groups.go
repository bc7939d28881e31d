package delivery

import (
	"fmt"
	"strings"
	"time"
)

// ConsumerGroup is what a consumer group of a topic has waiting, and whether
// it runs.
type ConsumerGroup struct {
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
	// ReadAt is the database's clock when the group was read: ages of the
	// times above are measured from it, never from this process's clock.
	ReadAt time.Time
}

// Running reports whether a router showed the group alive within stale
// (a few heartbeats) before the group was read, by the database's clock.
func (g ConsumerGroup) Running(stale time.Duration) bool {
	return g.LastSeen != nil && g.ReadAt.Sub(*g.LastSeen) <= stale
}

// ConsumerGroupAliveError is saga.Client.DropConsumerGroups' refusal to drop a group a
// router showed alive within GroupDrop.UnlessSeenWithin. It matches
// ErrConsumerGroupAlive.
type ConsumerGroupAliveError struct {
	ConsumerGroup string
	// Topics are those of the group's topics a router showed it alive on
	// within the window, by name.
	Topics []string
	// LastSeen is when a router last showed it alive, and Ago how long
	// before the refusal that was, by the database's clock.
	LastSeen time.Time
	Ago      time.Duration
}

func (e *ConsumerGroupAliveError) Error() string {
	return fmt.Sprintf("transport: consumer group %s of %s runs: a worker showed it alive %s ago",
		e.ConsumerGroup, strings.Join(e.Topics, ", "), e.Ago.Round(time.Millisecond))
}

// Is makes the error match ErrConsumerGroupAlive.
func (e *ConsumerGroupAliveError) Is(target error) bool { return target == ErrConsumerGroupAlive }

// GroupDrop says which consumer group saga.Client.DropConsumerGroups drops, and when it
// refuses to.
type GroupDrop struct {
	ConsumerGroup string
	// Topic drops the group of this topic only; "" of every topic it reads.
	Topic string
	// UnlessSeenWithin refuses to drop a group a router showed alive
	// within this long on any of those topics (a few of its heartbeats,
	// Config.HeartbeatInterval): nothing is dropped then. 0 drops it even
	// if it runs.
	UnlessSeenWithin time.Duration
}

// DroppedGroup is a consumer group of a topic saga.Client.DropConsumerGroups dropped,
// with how many of its queued messages it deleted.
type DroppedGroup struct {
	Topic    string
	Messages int64
}

// Subscription is a consumer group's subscription to a topic: every
// message published to the topic is queued for the group.
type Subscription struct {
	Topic         string
	ConsumerGroup string
}
