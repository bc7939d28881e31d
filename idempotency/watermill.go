package idempotency

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v3/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/pgsaga/pgsaga/steps/metadata"

	"github.com/pgsaga/pgsaga/steps/outcome"
)

// Metadata keys the Watermill middleware reads and writes.
const (
	// ReplyToMetadata names the topic replies go to, by default.
	ReplyToMetadata = metadata.ReplyTo
	// ReplayedMetadata is set to "true" on a reply published again for a
	// duplicate; the reply keeps its original message UUID.
	ReplayedMetadata = metadata.Replayed
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
	TxFromContext func(context.Context) (DBTX, bool)
	// Publisher publishes replies through tx (the outbox). Required when the
	// handler returns messages.
	Publisher func(tx DBTX) message.Publisher
	// ReplyTopic returns the topic for the replies to msg. Default: the
	// ReplyToMetadata entry.
	ReplyTopic func(msg *message.Message) string
}

// Rejection is a final business outcome for a message: the key is stored as
// failed with Replies, which are published like a success's and replayed to
// every duplicate. Return it (wrapped or not) from the handler.
type Rejection struct {
	Reason  string
	Replies []*message.Message
}

func (r *Rejection) Error() string { return "rejected: " + r.Reason }

// Outcome implements outcome.Classifier: a business failure.
func (r *Rejection) Outcome() outcome.Kind { return outcome.BusinessFailure }

// Reject returns a Rejection.
func Reject(reason string, replies ...*message.Message) error {
	return &Rejection{Reason: reason, Replies: replies}
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
// again, with their original UUIDs and ReplayedMetadata set, without running
// the handler. A handler error rolls nothing back by itself: the transaction
// owner (pgsaga's transport, for one) must roll the attempt back, which also
// releases the claim.
func (s *Store) Middleware(cfg MiddlewareConfig) (message.HandlerMiddleware, error) {
	if cfg.Scope == "" || len(cfg.Scope) > MaxScopeLen {
		return nil, fmt.Errorf("%w: middleware scope must be 1 to %d bytes", ErrInvalidRequest, MaxScopeLen)
	}
	if cfg.Fingerprint == nil {
		cfg.Fingerprint = func(m *message.Message) []byte { return Fingerprint(m.Payload) }
	}
	if cfg.TxFromContext == nil {
		cfg.TxFromContext = func(ctx context.Context) (DBTX, bool) { return wsql.TxFromContext(ctx) }
	}
	if cfg.ReplyTopic == nil {
		cfg.ReplyTopic = func(m *message.Message) string { return m.Metadata.Get(ReplyToMetadata) }
	}
	return func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			return nil, s.handleMessage(cfg, h, msg)
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

func (s *Store) handleMessage(cfg MiddlewareConfig, h message.HandlerFunc, msg *message.Message) error {
	ctx := msg.Context()
	tx, ok := cfg.TxFromContext(ctx)
	if !ok {
		return fmt.Errorf("idempotency: message %s carries no transaction", msg.UUID)
	}
	req := cfg.MessageRequest(msg)
	claim, err := s.ClaimTx(ctx, tx, req)
	if err != nil {
		return err
	}
	if !claim.Execute {
		return replay(cfg, tx, claim.Record)
	}
	status, body, err := runHandler(cfg, h, msg, tx)
	if err != nil {
		return err
	}
	if q, ok := tx.(queuer); ok {
		// The key was claimed in this transaction a moment ago, so the
		// completion cannot miss: it can go with the attempt's other writes.
		if err := q.QueueExec("completing idempotency key "+req.Scope+"/"+req.Key, completeSQL, req.Scope, req.Key, string(status), 0, body, nil); err != nil {
			return fmt.Errorf("idempotency: completing %s/%s: %w", req.Scope, req.Key, err)
		}
		return nil
	}
	return s.CompleteTx(ctx, tx, req, status, Response{Body: body})
}

// runHandler runs h on msg, publishes its replies through tx, and returns
// the outcome to store.
func runHandler(cfg MiddlewareConfig, h message.HandlerFunc, msg *message.Message, tx DBTX) (Status, []byte, error) {
	replies, herr := h(msg)
	status, outcome := StatusCompleted, storedOutcome{}
	var rej *Rejection
	switch {
	case errors.As(herr, &rej):
		status, outcome.Reason, replies = StatusFailed, rej.Reason, rej.Replies
	case herr != nil:
		return "", nil, herr
	}
	if len(replies) > 0 {
		topic := cfg.ReplyTopic(msg)
		if topic == "" {
			return "", nil, fmt.Errorf("idempotency: handler %s returned %d replies but message %s names no reply topic", cfg.Scope, len(replies), msg.UUID)
		}
		if cfg.Publisher == nil {
			return "", nil, fmt.Errorf("idempotency: handler %s returned replies but MiddlewareConfig.Publisher is nil", cfg.Scope)
		}
		if err := cfg.Publisher(tx).Publish(topic, replies...); err != nil {
			return "", nil, fmt.Errorf("idempotency: publishing replies of %s: %w", msg.UUID, err)
		}
		for _, r := range replies {
			outcome.Replies = append(outcome.Replies, storedReply{UUID: r.UUID, Topic: topic, Metadata: r.Metadata, Payload: r.Payload})
		}
	}
	body, err := json.Marshal(outcome)
	if err != nil {
		return "", nil, fmt.Errorf("idempotency: encoding outcome of %s: %w", msg.UUID, err)
	}
	return status, body, nil
}

// queuer is offered by the transaction of a pgsaga delivery attempt
// (transport.Queuer): statements whose result is not needed are sent with
// the attempt's other writes, in one round trip.
type queuer interface {
	QueueExec(name, query string, args ...any) error
}

func replay(cfg MiddlewareConfig, tx DBTX, rec Record) error {
	var outcome storedOutcome
	if err := json.Unmarshal(rec.Response.Body, &outcome); err != nil {
		return fmt.Errorf("idempotency: decoding stored outcome of %s/%s: %w", rec.Scope, rec.Key, err)
	}
	if len(outcome.Replies) == 0 {
		return nil
	}
	if cfg.Publisher == nil {
		return fmt.Errorf("idempotency: replaying %s/%s needs MiddlewareConfig.Publisher", rec.Scope, rec.Key)
	}
	byTopic := map[string][]*message.Message{}
	var topics []string
	for _, r := range outcome.Replies {
		m := message.NewMessage(r.UUID, r.Payload)
		for k, v := range r.Metadata {
			m.Metadata.Set(k, v)
		}
		m.Metadata.Set(ReplayedMetadata, "true")
		if _, seen := byTopic[r.Topic]; !seen {
			topics = append(topics, r.Topic)
		}
		byTopic[r.Topic] = append(byTopic[r.Topic], m)
	}
	pub := cfg.Publisher(tx)
	for _, topic := range topics {
		if err := pub.Publish(topic, byTopic[topic]...); err != nil {
			return fmt.Errorf("idempotency: replaying %s/%s to %s: %w", rec.Scope, rec.Key, topic, err)
		}
	}
	return nil
}
