package saga

import (
	"context"

	"github.com/pgsaga/pgsaga/saga/delivery"
)

// Dead letters and consumer groups, for operators. Like the calls on sagas
// (Get, Ask, …), these need a client that is neither started nor given a
// saga: an operator's tool builds one over the database.

// DeadLetters lists dead letters, oldest first, each with a bounded part
// of its payload, reason and metadata: a page takes memory in proportion
// to its Limit, however large the messages.
func (c *Client) DeadLetters(ctx context.Context, f delivery.DeadLetterFilter) ([]delivery.DeadLetter, error) {
	return c.transport.DeadLetters(ctx, f)
}

// DeadLetter reads dead letter id whole; delivery.ErrNoSuchDeadLetter if there is
// none.
func (c *Client) DeadLetter(ctx context.Context, id int64) (delivery.DeadLetter, error) {
	return c.transport.DeadLetter(ctx, id)
}

// ReplayDeadLetter sends dead letter id back to its topic, once: to the
// queue of the consumer group that gave up on it, or, for a message no
// group read when it was published, to every group that reads its topic
// now. The message keeps its id, payload and metadata; the dead letter
// stays, marked replayed. It returns how many queues it went to. Replaying
// again is delivery.ErrAlreadyReplayed; a topic no group reads is
// delivery.ErrTopicNotSubscribed; a message a broker bridge received but could not
// queue is delivery.ErrNotReplayable; in each case nothing changes.
func (c *Client) ReplayDeadLetter(ctx context.Context, id int64) (int, error) {
	return c.transport.ReplayDeadLetter(ctx, id)
}

// CountDeadLetters counts the dead letters DeleteDeadLetters would delete
// now.
func (c *Client) CountDeadLetters(ctx context.Context, d delivery.DeadLetterDeletion) (int64, error) {
	return c.transport.CountDeadLetters(ctx, d)
}

// DeleteDeadLetters deletes the dead letters d selects, replayed or not,
// and returns how many it deleted.
func (c *Client) DeleteDeadLetters(ctx context.Context, d delivery.DeadLetterDeletion) (int64, error) {
	return c.transport.DeleteDeadLetters(ctx, d)
}

// ConsumerGroups lists every consumer group of every topic with what
// waits for it, by topic and group. It counts every queued row: on queues
// of millions it takes a while.
func (c *Client) ConsumerGroups(ctx context.Context) ([]delivery.ConsumerGroup, error) {
	return c.transport.ConsumerGroups(ctx)
}

// DropConsumerGroups forgets a consumer group (of one topic, or of every
// topic it reads) and deletes what waits for it, in one transaction, and
// returns what it dropped, by topic: for a group that will never run
// again, whose queue would otherwise grow for ever. A group a worker
// showed alive within d.UnlessSeenWithin is not dropped
// (delivery.ErrConsumerGroupAlive); a group not recorded is delivery.ErrNoSuchConsumerGroup.
func (c *Client) DropConsumerGroups(ctx context.Context, d delivery.GroupDrop) ([]delivery.DroppedGroup, error) {
	return c.transport.DropConsumerGroups(ctx, d)
}
