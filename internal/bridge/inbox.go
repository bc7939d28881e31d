package bridge

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strings"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/pgsaga/pgsaga/internal/pgerr"
	"github.com/pgsaga/pgsaga/internal/transport"
	"github.com/pgsaga/pgsaga/steps/broker"
)

// transport.ReceiveHandler names the bridge's receiving side in the dead letters it
// leaves; they cannot be replayed (pgsaga dead-letters replay refuses them).

// startInbox subscribes Consumers consumers to each received topic.
func (b *Bridge) startInbox(ctx context.Context) error {
	if len(b.cfg.Receive) == 0 {
		return nil
	}
	sub, err := b.cfg.Broker.Subscriber(b.cfg.Group)
	if err != nil {
		return fmt.Errorf("broker: subscribing as %s: %w", b.cfg.Group, err)
	}
	b.subs = append(b.subs, sub)
	for _, topic := range b.cfg.Receive {
		for range b.cfg.Consumers {
			msgs, err := sub.Subscribe(ctx, topic)
			if err != nil {
				return fmt.Errorf("broker: subscribing to %s as %s: %w", topic, b.cfg.Group, err)
			}
			b.inbox.Go(func() {
				for msg := range msgs {
					b.receiveSafely(topic, msg)
				}
			})
		}
	}
	return nil
}

// receiveSafely receives msg (receive): a panic is this message's failure
// alone, its stack logged; the message is dead-lettered with the panic's
// value (the same message would panic again), or handed back if even that
// fails.
func (b *Bridge) receiveSafely(topic string, msg *message.Message) {
	defer func() {
		p := recover()
		if p == nil {
			return
		}
		perr := transport.Recovered("receiving a message from the broker", p)
		log := b.log.With("topic", topic, "message_uuid", transport.Storable(msg.UUID))
		log.Error("receiving a message from the broker panicked", "panic", perr.Value, "stack", string(perr.Stack))
		if err := b.deadLetterReceived(topic, msg, perr.Error()); err != nil {
			log.Warn("could not dead-letter a message whose receiving panicked; it will be delivered again", "err", err)
			msg.Nack()
			return
		}
		msg.Ack()
	}()
	b.receive(topic, msg)
}

// deadLetterReceived keeps msg, received on topic, as a dead letter of the
// receiving side with reason; a panic doing so is an error.
func (b *Bridge) deadLetterReceived(topic string, msg *message.Message, reason string) (err error) {
	defer func() {
		if p := recover(); p != nil {
			err = transport.Recovered("dead-lettering", p)
		}
	}()
	ctx, cancel := context.WithTimeout(context.Background(), 2*b.t.Config().StatementTimeout)
	defer cancel()
	in := message.NewMessage(msg.UUID, msg.Payload)
	in.Metadata = msg.Metadata
	return b.t.StoreDeadLetter(ctx, topic, b.cfg.Group, transport.ReceiveHandler, in, "received from the broker but cannot be queued: "+reason)
}

// receive queues msg, received from the broker on topic, for this
// database's consumer groups of topic, then acknowledges it; what cannot be
// queued ever is dead-lettered and acknowledged; what cannot be queued now
// (the database does not answer) is handed back for redelivery.
func (b *Bridge) receive(topic string, msg *message.Message) {
	tc := b.t.Config()
	// The work is bounded by the transport's timeouts, not by the bridge
	// stopping: a stop does not waste a queue insert under way.
	ctx, cancel := context.WithTimeout(context.WithoutCancel(msg.Context()), 2*tc.StatementTimeout)
	defer cancel()
	in := message.NewMessage(msg.UUID, msg.Payload)
	in.Metadata = make(message.Metadata, len(msg.Metadata))
	for k, v := range msg.Metadata {
		if !strings.HasPrefix(k, "_pgsaga_") {
			in.Metadata[k] = v
		}
	}
	in.SetContext(msg.Context())
	log := b.log.With("topic", topic, "message_uuid", transport.Storable(msg.UUID))

	reason := broker.Malformed(msg)
	if reason == "" {
		reason = unqueueable(in)
	}
	var err error
	if reason == "" {
		err = b.queue(ctx, topic, in)
		if err != nil && permanent(err) {
			reason, err = err.Error(), nil
		}
	}
	switch {
	case err != nil:
		log.Warn("could not queue a message from the broker; it will be delivered again", "err", err)
		b.handedBack.Add(1)
		b.t.Metrics().ReceiveFailed(topic)
		msg.Nack()
		return
	case reason != "":
		reason = "received from the broker but cannot be queued: " + reason
		if err := b.t.StoreDeadLetter(ctx, topic, b.cfg.Group, transport.ReceiveHandler, in, reason); err != nil {
			log.Warn("could not dead-letter a message from the broker; it will be delivered again", "reason", reason, "err", err)
			b.handedBack.Add(1)
			b.t.Metrics().ReceiveFailed(topic)
			msg.Nack()
			return
		}
		log.Error("message from the broker dead-lettered", "reason", reason)
		b.deadLettered.Add(1)
		msg.Ack()
		return
	}
	b.received.Add(1)
	b.t.Metrics().Received(topic)
	if f := b.cfg.Faults; f != nil && f.RedeliverAfterStore(topic, msg) {
		msg.Nack()
		return
	}
	msg.Ack()
}

// queue publishes in to topic in a transaction of its own, bounded like
// the transport's: its statements, lock waits and idle time (a queue
// insert blocked by a table lock gives up, and the message is delivered
// again).
func (b *Bridge) queue(ctx context.Context, topic string, in *message.Message) error {
	tx, err := b.t.DB().BeginTx(ctx, &sql.TxOptions{Isolation: sql.LevelReadCommitted})
	if err != nil {
		return fmt.Errorf("queuing a message from the broker: %w", err)
	}
	defer tx.Rollback() //nolint:errcheck // a no-op after Commit
	tc := b.t.Config()
	if _, err := tx.ExecContext(ctx, boundSQL, tc.StatementTimeout.Milliseconds(), tc.LockTimeout.Milliseconds(), receiveBound(tc).Milliseconds()); err != nil {
		return fmt.Errorf("queuing a message from the broker: bounding the transaction: %w", err)
	}
	if err := b.t.Publisher(tx).Publish(topic, in); err != nil {
		return fmt.Errorf("queuing a message from the broker: %w", err)
	}
	if err := tx.Commit(); err != nil {
		return fmt.Errorf("queuing a message from the broker: committing: %w", err)
	}
	return nil
}

// unqueueable says why the queue cannot store msg as it is ("" if it can):
// no usable id, or text PostgreSQL cannot keep.
func unqueueable(msg *message.Message) string {
	if msg.UUID == "" || len(msg.UUID) > 255 {
		return fmt.Sprintf("its id must be 1 to 255 bytes, it has %d", len(msg.UUID))
	}
	if why := transport.Unstorable(msg.UUID); why != "" {
		return "its id holds " + why
	}
	for k, v := range msg.Metadata {
		if why := transport.Unstorable(k); why != "" {
			return fmt.Sprintf("a metadata key (%q) holds %s", transport.Storable(k), why)
		}
		if why := transport.Unstorable(v); why != "" {
			return fmt.Sprintf("metadata %s holds %s", transport.Storable(k), why)
		}
	}
	return ""
}

// permanent reports whether queuing failed on what the message holds
// rather than on the database's state.
func permanent(err error) bool {
	return pgerr.BadInput(err) || errors.Is(err, transport.ErrInvalidMessageID) || errors.Is(err, transport.ErrInvalidTopic)
}

// boundSQL bounds a transaction's statements, lock waits and idle time
// (milliseconds).
const boundSQL = `SELECT set_config('statement_timeout', $1::bigint::text, true), set_config('lock_timeout', $2::bigint::text, true),
    set_config('idle_in_transaction_session_timeout', $3::bigint::text, true)`
