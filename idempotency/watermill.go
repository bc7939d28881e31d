package idempotency

import (
	"context"
	"errors"
	"fmt"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/pgsaga/pgsaga/internal/dbtx"
	"github.com/pgsaga/pgsaga/saga/delivery"
)

// MiddlewareConfig configures Store.Middleware.
type MiddlewareConfig struct {
	// Scope of the handler's keys, usually the handler's name. Required.
	Scope string
	// KeyMetadata names the metadata entry that holds a message's key.
	// Default: none, the message UUID is the key; a message without the
	// entry also falls back to its UUID.
	KeyMetadata string
	// Fingerprint hashes a message to detect a key reused for a different
	// message. Default: Fingerprint(payload).
	Fingerprint func(*message.Message) []byte
	// TxFromContext returns the transaction the message is handled in; the
	// claim, the handler's writes and the replies share it. Default:
	// watermill-sql's subscriber transaction.
	TxFromContext func(context.Context) (delivery.DBTX, bool)
	// Publisher publishes replies through tx (the outbox). Required when the
	// handler returns messages.
	Publisher func(tx delivery.DBTX) message.Publisher
	// ReplyTopic returns the topic for the replies to msg. Default: the
	// "reply_to" metadata entry (steps.MetaReplyTo).
	ReplyTopic func(msg *message.Message) string
}

// Reject returns a Failure with replies: the key is stored failed with
// them, and they are published and replayed to every duplicate. Return it
// (wrapped or not) from a handler behind Middleware.
func Reject(reason string, replies ...*message.Message) error {
	return &Failure{Reason: reason, Replies: replies}
}

// storedReply is one reply as kept in a key's response body.
type storedReply struct {
	UUID     string            `json:"uuid"`
	Topic    string            `json:"topic"`
	Metadata map[string]string `json:"metadata,omitempty"`
	Payload  []byte            `json:"payload"`
}

// storedOutcome is the response body of a message key.
type storedOutcome struct {
	Reason  string        `json:"reason,omitempty"`
	Replies []storedReply `json:"replies"`
}

// Middleware makes a Watermill handler run at most once per key. In the
// message's transaction it claims the key; the first delivery runs the
// handler, publishes the messages it returns to the reply topic through that
// transaction and stores them; every duplicate publishes the stored replies
// again, with their original UUIDs and the "replayed" metadata entry (steps.MetaReplayed) set to "true", without running
// the handler. A handler error rolls nothing back by itself: the transaction
// owner (pgsaga's transport, for one) must roll the attempt back, which also
// releases the claim. It is MessageKeys in a Watermill handler chain.
func (s *Store) Middleware(cfg MiddlewareConfig) (message.HandlerMiddleware, error) {
	keys, err := s.MessageKeys(cfg)
	if err != nil {
		return nil, err
	}
	return func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			return nil, keys.handle(h, msg)
		}
	}, nil
}

// MessageRequest is the Request the middleware claims for msg.
func (cfg MiddlewareConfig) MessageRequest(msg *message.Message) Request {
	key := msg.UUID
	if cfg.KeyMetadata != "" {
		if k := msg.Metadata.Get(cfg.KeyMetadata); k != "" {
			key = k
		}
	}
	fp := Fingerprint(msg.Payload)
	if cfg.Fingerprint != nil {
		fp = cfg.Fingerprint(msg)
	}
	return Request{Scope: cfg.Scope, Key: key, Hash: fp}
}

// handle is the middleware around h for msg.
func (k *MessageKeys) handle(h message.HandlerFunc, msg *message.Message) error {
	ctx := msg.Context()
	tx, ok := k.cfg.TxFromContext(ctx)
	if !ok {
		return fmt.Errorf("idempotency: message %s carries no transaction", msg.UUID)
	}
	claim, err := k.ClaimTx(ctx, tx, msg)
	if err != nil || !claim.Run {
		return err
	}
	replies, herr := h(msg)
	var rej *Failure
	switch {
	case errors.As(herr, &rej):
		return k.FinishTx(ctx, tx, claim, StatusFailed, rej.Reason, rej.Replies...)
	case herr != nil:
		return herr
	}
	return k.FinishTx(ctx, tx, claim, StatusCompleted, "", replies...)
}

// completeWrite completes single-phase claims of message keys, made in
// the transaction of a pgsaga delivery attempt: their completions are
// written together when the attempt's batch ends (see dbtx.Batched). A row
// is scope, key, status and the stored outcome.
var completeWrite = &dbtx.Batched{
	Name: "completing idempotency keys",
	Statement: func(rows [][]any) (string, []any) {
		return completeManySQL, []any{dbtx.Column[string](rows, 0), dbtx.Column[string](rows, 1), dbtx.Column[string](rows, 2), dbtx.Column[[]byte](rows, 3)}
	},
}
