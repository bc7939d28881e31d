package idempotency

import (
	"context"
	"encoding/json"
	"fmt"
	"reflect"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v3/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/pgsaga/pgsaga/internal/dbtx"
	"github.com/pgsaga/pgsaga/internal/metadata"
	"github.com/pgsaga/pgsaga/saga/delivery"
)

// MessageKeys claims and finishes the idempotency keys of messages in one
// scope, in the transaction each message is handled in. Middleware is
// MessageKeys in a Watermill handler chain; use MessageKeys itself when your
// code decides when the work runs and how it ends (pgsaga's step runtime
// does): ClaimTx, then the work, then FinishTx, all in one transaction.
type MessageKeys struct {
	s   *Store
	cfg MiddlewareConfig
}

// MessageKeys returns the keys of cfg.Scope. It uses cfg's KeyMetadata,
// Fingerprint, Publisher and ReplyTopic (TxFromContext is the middleware's
// alone).
func (s *Store) MessageKeys(cfg MiddlewareConfig) (*MessageKeys, error) {
	if cfg.Scope == "" || len(cfg.Scope) > MaxScopeLen {
		return nil, fmt.Errorf("%w: message scope must be 1 to %d bytes", ErrInvalidRequest, MaxScopeLen)
	}
	if cfg.Fingerprint == nil {
		cfg.Fingerprint = func(m *message.Message) []byte { return Fingerprint(m.Payload) }
	}
	if cfg.TxFromContext == nil {
		cfg.TxFromContext = func(ctx context.Context) (delivery.DBTX, bool) { return wsql.TxFromContext(ctx) }
	}
	if cfg.ReplyTopic == nil {
		cfg.ReplyTopic = func(m *message.Message) string { return m.Metadata.Get(metadata.ReplyTo) }
	}
	return &MessageKeys{s: s, cfg: cfg}, nil
}

// MessageClaim is a message's claim on its key, made by ClaimTx.
type MessageClaim struct {
	// Run is true when the caller owns the key: run the work, then FinishTx
	// in the same transaction. False for a duplicate of a finished message,
	// whose stored replies ClaimTx already published again.
	Run bool

	msg      *message.Message
	req      Request
	tx       delivery.DBTX // the transaction that made the claim
	finished bool
}

// ClaimTx claims msg's key in tx. For a duplicate of a finished message it
// publishes the stored replies again through tx, with their original UUIDs
// and the "replayed" metadata entry (steps.MetaReplayed) set to "true", and returns a claim with Run false. Errors are
// ClaimTx's: ErrKeyReused, ErrInProgress, ErrConflict, ErrInvalidRequest.
func (k *MessageKeys) ClaimTx(ctx context.Context, tx delivery.DBTX, msg *message.Message) (*MessageClaim, error) {
	req := k.cfg.MessageRequest(msg)
	claim, err := k.s.ClaimTx(ctx, tx, req)
	if err != nil {
		return nil, err
	}
	if !claim.Execute {
		return &MessageClaim{msg: msg, req: req}, k.replay(tx, claim.Record)
	}
	return &MessageClaim{Run: true, msg: msg, req: req, tx: tx}, nil
}

// sameTx reports whether a and b are the same transaction value.
func sameTx(a, b delivery.DBTX) bool {
	va, vb := reflect.ValueOf(a), reflect.ValueOf(b)
	return va.IsValid() && vb.IsValid() && va.Type() == vb.Type() && va.Comparable() && va.Equal(vb)
}

// FinishTx publishes replies through tx to the claimed message's reply
// topic and stores the key's final outcome with them: StatusCompleted, or
// StatusFailed with reason (a business failure, replayed like a success).
// Every later duplicate gets the same replies. A claim is finished once,
// in the transaction that made it: in another, FinishTx fails with
// ErrNotClaimed, and a second time with ErrNothingToFinish, before
// anything is published.
func (k *MessageKeys) FinishTx(ctx context.Context, tx delivery.DBTX, c *MessageClaim, status Status, reason string, replies ...*message.Message) error {
	switch {
	case c == nil:
		return fmt.Errorf("%w: no claim to finish", ErrInvalidRequest)
	case !c.Run || c.finished:
		return fmt.Errorf("%w: %s/%s", ErrNothingToFinish, c.req.Scope, c.req.Key)
	case !sameTx(c.tx, tx):
		return fmt.Errorf("%w: %s/%s was claimed in another transaction", ErrNotClaimed, c.req.Scope, c.req.Key)
	}
	if err := checkFinal(status); err != nil {
		return err
	}
	c.finished = true
	out := storedOutcome{Reason: reason}
	if len(replies) > 0 {
		topic := k.cfg.ReplyTopic(c.msg)
		if topic == "" {
			return fmt.Errorf("idempotency: %s has %d replies for message %s, which names no reply topic", k.cfg.Scope, len(replies), c.msg.UUID)
		}
		if k.cfg.Publisher == nil {
			return fmt.Errorf("idempotency: %s has replies to publish but MiddlewareConfig.Publisher is nil", k.cfg.Scope)
		}
		if err := k.cfg.Publisher(tx).Publish(topic, replies...); err != nil {
			return fmt.Errorf("idempotency: publishing replies of %s: %w", c.msg.UUID, err)
		}
		for _, r := range replies {
			out.Replies = append(out.Replies, storedReply{UUID: r.UUID, Topic: topic, Metadata: r.Metadata, Payload: r.Payload})
		}
	}
	body, err := json.Marshal(out)
	if err != nil {
		return fmt.Errorf("idempotency: encoding outcome of %s: %w", c.msg.UUID, err)
	}
	if _, ok := tx.(dbtx.BatchQueuer); ok {
		// The claim was made in this transaction, so the completion cannot
		// miss: it is written with the batch's other completions.
		if err := dbtx.WriteBatched(ctx, tx, completeWrite, []any{c.req.Scope, c.req.Key, string(status), body}); err != nil {
			return fmt.Errorf("idempotency: completing %s/%s: %w", c.req.Scope, c.req.Key, err)
		}
		return nil
	}
	return k.s.CompleteTx(ctx, tx, c.req, status, Response{Body: body})
}

// replay publishes a finished key's stored replies again, grouped by topic
// in their original order.
func (k *MessageKeys) replay(tx delivery.DBTX, rec Record) error {
	var out storedOutcome
	if err := json.Unmarshal(rec.Response.Body, &out); err != nil {
		return fmt.Errorf("idempotency: decoding stored outcome of %s/%s: %w", rec.Scope, rec.Key, err)
	}
	if len(out.Replies) == 0 {
		return nil
	}
	if k.cfg.Publisher == nil {
		return fmt.Errorf("idempotency: replaying %s/%s needs MiddlewareConfig.Publisher", rec.Scope, rec.Key)
	}
	byTopic := map[string][]*message.Message{}
	var topics []string
	for _, r := range out.Replies {
		m := message.NewMessage(r.UUID, r.Payload)
		for key, v := range r.Metadata {
			m.Metadata.Set(key, v)
		}
		m.Metadata.Set(metadata.Replayed, "true")
		if _, seen := byTopic[r.Topic]; !seen {
			topics = append(topics, r.Topic)
		}
		byTopic[r.Topic] = append(byTopic[r.Topic], m)
	}
	pub := k.cfg.Publisher(tx)
	for _, topic := range topics {
		if err := pub.Publish(topic, byTopic[topic]...); err != nil {
			return fmt.Errorf("idempotency: replaying %s/%s to %s: %w", rec.Scope, rec.Key, topic, err)
		}
	}
	return nil
}
