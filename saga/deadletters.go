package saga

import (
	"context"

	"github.com/pgsaga/pgsaga/internal/transport"
)

// Dead letters and consumer groups, for operators. Like the calls on sagas
// (Get, Ask, …), these need a client that is neither started nor given a
// saga: an operator's tool builds one over the database.

// DeadLetter is a message kept in pgsaga_dead_letters: one no consumer
// could handle (with the reason and its attempts), or that no consumer
// group subscribed to. DeadLetters lists them with a bounded part of each
// (its PayloadPreview, a Reason cut at DeadLetterListText characters, its
// Metadata only up to DeadLetterListText bytes); DeadLetter reads one
// whole.
type DeadLetter = transport.DeadLetter

// DeadLetterFilter selects the dead letters DeadLetters lists: of a Topic
// ("" for all), after AfterID (paging), at most Limit (default 100).
type DeadLetterFilter = transport.DeadLetterFilter

// DeadLetterDeletion selects the dead letters DeleteDeadLetters deletes:
// those IDs, or those of Topic dead-lettered longer than OlderThan ago (by
// the database's clock), one way or the other, never all of them
// (ErrInvalidDeletion).
type DeadLetterDeletion = transport.DeadLetterDeletion

// ConsumerGroup is what a consumer group of a topic has waiting (Waiting,
// Retrying, NotYetAvailable, Oldest), and when a worker last showed it
// alive (LastSeen; Running says whether it still runs).
type ConsumerGroup = transport.GroupStats

// GroupDrop says which consumer group DropConsumerGroups drops (of Topic,
// or of every topic it reads), and that it refuses to drop one a worker
// showed alive within UnlessSeenWithin.
type GroupDrop = transport.GroupDrop

// DroppedGroup is a consumer group of a topic DropConsumerGroups dropped,
// with how many of its queued messages it deleted.
type DroppedGroup = transport.DroppedGroup

// ConsumerGroupAliveError is DropConsumerGroups' refusal to drop a group a
// worker showed alive within GroupDrop.UnlessSeenWithin: which topics, and
// when. It matches ErrConsumerGroupAlive.
type ConsumerGroupAliveError = transport.ConsumerGroupAliveError

// Bounds of what DeadLetters reads of each dead letter.
const (
	// DeadLetterPreviewBytes bounds a listed dead letter's PayloadPreview.
	DeadLetterPreviewBytes = transport.DeadLetterPreviewBytes
	// DeadLetterListText bounds the reason (in characters) and the
	// metadata (in bytes of its JSON text) of a listed dead letter.
	DeadLetterListText = transport.DeadLetterListText
)

// DeadLetters lists dead letters, oldest first, each with a bounded part
// of its payload, reason and metadata: a page takes memory in proportion
// to its Limit, however large the messages.
func (c *Client) DeadLetters(ctx context.Context, f DeadLetterFilter) ([]DeadLetter, error) {
	return c.transport.DeadLetters(ctx, f)
}

// DeadLetter reads dead letter id whole; ErrDeadLetterNotFound if there is
// none.
func (c *Client) DeadLetter(ctx context.Context, id int64) (DeadLetter, error) {
	return c.transport.DeadLetter(ctx, id)
}

// ReplayDeadLetter sends dead letter id back to its topic, once: to the
// queue of the consumer group that gave up on it, or, for a message no
// group read when it was published, to every group that reads its topic
// now. The message keeps its id, payload and metadata; the dead letter
// stays, marked replayed. It returns how many queues it went to. Replaying
// again is ErrAlreadyReplayed; a topic no group reads is
// ErrNoConsumerGroup; a message a broker bridge received but could not
// queue is ErrNotReplayable; in each case nothing changes.
func (c *Client) ReplayDeadLetter(ctx context.Context, id int64) (int, error) {
	return c.transport.ReplayDeadLetter(ctx, id)
}

// CountDeadLetters counts the dead letters DeleteDeadLetters would delete
// now.
func (c *Client) CountDeadLetters(ctx context.Context, d DeadLetterDeletion) (int64, error) {
	return c.transport.CountDeadLetters(ctx, d)
}

// DeleteDeadLetters deletes the dead letters d selects, replayed or not,
// and returns how many it deleted.
func (c *Client) DeleteDeadLetters(ctx context.Context, d DeadLetterDeletion) (int64, error) {
	return c.transport.DeleteDeadLetters(ctx, d)
}

// ConsumerGroups lists every consumer group of every topic with what
// waits for it, by topic and group. It counts every queued row: on queues
// of millions it takes a while.
func (c *Client) ConsumerGroups(ctx context.Context) ([]ConsumerGroup, error) {
	return c.transport.ConsumerGroups(ctx)
}

// DropConsumerGroups forgets a consumer group (of one topic, or of every
// topic it reads) and deletes what waits for it, in one transaction, and
// returns what it dropped, by topic: for a group that will never run
// again, whose queue would otherwise grow for ever. A group a worker
// showed alive within d.UnlessSeenWithin is not dropped
// (ErrConsumerGroupAlive); a group not recorded is ErrNoSuchConsumerGroup.
func (c *Client) DropConsumerGroups(ctx context.Context, d GroupDrop) ([]DroppedGroup, error) {
	return c.transport.DropConsumerGroups(ctx, d)
}
