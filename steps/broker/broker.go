// Package broker connects a pgsaga database to a message broker (NATS
// JetStream: steps/broker/natsjs; Kafka: steps/broker/kafka), so that a
// saga's steps can run in services with databases of their own, and other
// teams can read a service's domain events.
//
// A Bridge does two things, each for the topics it is given:
//
//   - Relay: every message published to a relayed topic in this database
//     (through the outbox, in the publisher's transaction) is queued for
//     the relay's consumer group ("pgsaga.relay") and published to
//     the broker, at least once and in the order it was queued: one relay
//     per topic at a time on the database, messages taken from the head of
//     the queue, each published and stored by the broker before the next,
//     the first failure stopping the batch (it is tried again after a
//     backoff, never skipped). The message's UUID is its deduplication id
//     at the broker, so a relay that dies between the broker's
//     acknowledgement and its own commit, and publishes again, stores
//     nothing twice within the broker's deduplication window.
//   - Receive: every message of a received topic that the broker delivers
//     to this service's consumer group is queued in this database, in a
//     transaction of its own, for the consumer groups subscribed here, and
//     acknowledged to the broker once that committed. A broker delivers at
//     least once; so does the bridge: a delivery queued twice is handled
//     twice, which idempotent handlers absorb (a step by its command's key,
//     the saga engine by the command in flight). The handlers then run as
//     any: bounded attempts, retries with backoff, dead letters.
//
// Nothing waits behind a bad message: a message the broker refuses for
// good (too large) is dead-lettered by the relay, which goes on; a message
// from the broker that the database cannot store (a NUL, bytes that are not
// UTF-8, no usable id) is dead-lettered on receipt and acknowledged.
package broker

import (
	"context"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
)

// Broker is a message broker a Bridge relays to and receives from.
type Broker interface {
	// Provision makes sure the broker keeps what is published to each of
	// topics (JetStream: a stream capturing the topic's subject; Kafka:
	// the topic). It is idempotent and safe from several processes.
	Provision(ctx context.Context, topics ...string) error
	// Publish publishes msg to topic and returns once the broker has
	// stored it, or with why not. Where the broker can, msg.UUID is its
	// deduplication id: a message published again within the broker's
	// window is stored once.
	Publish(ctx context.Context, topic string, msg *message.Message) error
	// Permanent reports whether a Publish error means that the broker
	// will never take the message, however often it is tried (too large,
	// say). Any other error is tried again.
	Permanent(err error) bool
	// Subscriber returns a subscriber of the broker's durable consumer
	// group group: each of its Subscribe calls is one more consumer of the
	// group, sharing the topic's messages with the others, in this process
	// and elsewhere. A message nacked, or neither acked nor nacked within
	// the broker's acknowledgement wait, is delivered again. A subscriber
	// never fails on what a message holds: one it cannot read is handed
	// out marked (see Malformed).
	Subscriber(group string) (message.Subscriber, error)
	// Close releases the broker's connections.
	Close() error
}

// A PublishBound bounds how long one Publish of its broker takes. The
// relay, which publishes inside a transaction, starts no publish that
// could outlast the transaction's bound; a broker without one is assumed
// to take up to the transport's AttemptTimeout.
type PublishBound interface {
	MaxPublishDuration() time.Duration
}

// An AckWaiter tells how long its broker waits for the acknowledgement of
// a delivery before delivering it again. Queuing a received message must
// end well within it (New checks), or every delivery would come again.
type AckWaiter interface {
	AckWait() time.Duration
}

// A Resetter deletes what the broker keeps of topics (JetStream: their
// streams and consumers; Kafka: the topics), for a run that must start
// from nothing (a benchmark on fresh databases). Never for production: it
// drops what was relayed and not yet received.
type Resetter interface {
	Reset(ctx context.Context, topics ...string) error
}

// MalformedKey is the metadata entry a Broker's subscriber sets on a
// message it could not read whole (a header it cannot decode, say): the
// reason. A Bridge dead-letters such a message on receipt.
const MalformedKey = "_pgsaga_malformed"

// Malformed is the reason msg is marked malformed, or "".
func Malformed(msg *message.Message) string { return msg.Metadata.Get(MalformedKey) }

// Faults inject failures at the broker boundary, for tests (the failure
// kit's sagatest.BrokerFaults implements them). Decisions must be safe to
// call from several goroutines.
type Faults interface {
	// CrashAfterPublish reports whether the relay dies right after the
	// broker stored msg and before its batch commits: the batch is
	// abandoned, and its messages, msg included, are published again.
	CrashAfterPublish(topic string, msg *message.Message) bool
	// RedeliverAfterStore reports whether the bridge, having queued msg
	// received from the broker, hands it back (nack) instead of
	// acknowledging it, so that the broker delivers it again.
	RedeliverAfterStore(topic string, msg *message.Message) bool
}
