package steps

import (
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"

	"github.com/pgsaga/pgsaga/idempotency"
	"github.com/pgsaga/pgsaga/internal/metadata"
	"github.com/pgsaga/pgsaga/internal/outcome"
	"github.com/pgsaga/pgsaga/saga/delivery"
)

// Message is the payload of a command, a reply or an event: a value that
// encodes to JSON and names its type. MessageType must be a constant of the
// type (value receiver, no field access): it is called on zero values.
type Message interface {
	MessageType() string
}

// Metadata keys of the envelope (see package metadata). Every message
// pgsaga sends carries them; they are the contract between the saga
// engine, the participants and anything else reading the topics.
const (
	// MetaType is the payload's type name (Message.MessageType).
	MetaType = metadata.Type
	// MetaCorrelationID ties together every message of one business
	// transaction (a saga): copied from command to reply to next command.
	MetaCorrelationID = metadata.CorrelationID
	// MetaCausationID is the UUID of the message that caused this one.
	MetaCausationID = metadata.CausationID
	// MetaSagaID is the saga instance the message belongs to, if any.
	MetaSagaID = metadata.SagaID
	// MetaStep is the saga step a command or reply belongs to.
	MetaStep = metadata.Step
	// MetaKey is the idempotency key of a command: stable across re-sends
	// (for a saga, derived from saga id and step, never from the attempt).
	MetaKey = metadata.Key
	// MetaReplyTo is the topic a command's reply goes to.
	MetaReplyTo = metadata.ReplyTo
	// MetaOutcome is "ok" or "failed" on a reply.
	MetaOutcome = metadata.Outcome
	// MetaReason explains a failed reply.
	MetaReason = metadata.Reason
	// MetaReplayed is "true" on a reply published again for a duplicate
	// command; it keeps the original reply's UUID.
	MetaReplayed = metadata.Replayed
	// MetaNotAfter is when a command stops being worth running (RFC 3339,
	// on the sender's database clock): the runtime refuses a command it
	// gets later, never running its handler, and answers it as refused
	// (MetaRefusal "expired"). A saga's actions carry it: the saga's own
	// deadline (saga.Spec.Timeout); its compensations never do.
	MetaNotAfter = metadata.NotAfter
	// MetaReplyToken is the token a saga's command carries and its reply
	// must carry back (the runtime copies it): the engine refuses a reply
	// to the command in flight without it as forged.
	MetaReplyToken = metadata.ReplyToken
	// MetaRefusal, on a failed reply, says the command was refused without
	// running: RefusalExpired.
	MetaRefusal = metadata.Refusal
)

// RefusalExpired is MetaRefusal on the answer to a command that arrived
// past its MetaNotAfter: its handler did not run.
const RefusalExpired = metadata.RefusalExpired

// Outcomes of a reply.
const (
	OutcomeOK     = "ok"
	OutcomeFailed = "failed"
)

// Envelope is a message's metadata, typed.
type Envelope struct {
	ID            string // the message UUID
	Type          string
	CorrelationID string
	CausationID   string
	SagaID        string
	Step          string
	Key           string
	ReplyTo       string
	Outcome       string
	Reason        string
	Replayed      bool
	// NotAfter is when the command stops being worth running; zero for
	// none (or one that cannot be read: the runtime refuses such a
	// command).
	NotAfter   time.Time
	ReplyToken string
	Refusal    string
}

// EnvelopeOf reads msg's envelope.
func EnvelopeOf(msg *message.Message) Envelope {
	md := msg.Metadata
	return Envelope{
		ID:            msg.UUID,
		Type:          md.Get(MetaType),
		CorrelationID: md.Get(MetaCorrelationID),
		CausationID:   md.Get(MetaCausationID),
		SagaID:        md.Get(MetaSagaID),
		Step:          md.Get(MetaStep),
		Key:           md.Get(MetaKey),
		ReplyTo:       md.Get(MetaReplyTo),
		Outcome:       md.Get(MetaOutcome),
		Reason:        md.Get(MetaReason),
		Replayed:      md.Get(MetaReplayed) == "true",
		NotAfter:      parseNotAfter(md.Get(MetaNotAfter)),
		ReplyToken:    md.Get(MetaReplyToken),
		Refusal:       md.Get(MetaRefusal),
	}
}

// parseNotAfter reads a MetaNotAfter value; zero if it is absent or
// cannot be read.
func parseNotAfter(s string) time.Time {
	t, err := time.Parse(time.RFC3339Nano, s)
	if err != nil {
		return time.Time{}
	}
	return t
}

// formatNotAfter writes a MetaNotAfter value.
func formatNotAfter(t time.Time) string { return t.UTC().Format(time.RFC3339Nano) }

// NewMessage encodes m as JSON in a message carrying env. env.Type is set
// from m; an empty env.ID gets a random UUID; empty fields are left out.
func NewMessage(m Message, env Envelope) (*message.Message, error) {
	if m == nil {
		return nil, errors.New("steps: nil message")
	}
	payload, err := json.Marshal(m)
	if err != nil {
		return nil, fmt.Errorf("steps: encoding %s: %w", m.MessageType(), err)
	}
	id := env.ID
	if id == "" {
		id = uuid.NewString()
	}
	msg := message.NewMessage(id, payload)
	env.Type = m.MessageType()
	if !env.NotAfter.IsZero() {
		msg.Metadata.Set(MetaNotAfter, formatNotAfter(env.NotAfter))
	}
	for k, v := range map[string]string{
		MetaType: env.Type, MetaCorrelationID: env.CorrelationID, MetaCausationID: env.CausationID,
		MetaSagaID: env.SagaID, MetaStep: env.Step, MetaKey: env.Key, MetaReplyTo: env.ReplyTo,
		MetaOutcome: env.Outcome, MetaReason: env.Reason, MetaReplyToken: env.ReplyToken, MetaRefusal: env.Refusal,
	} {
		if v != "" {
			msg.Metadata.Set(k, v)
		}
	}
	return msg, nil
}

// DecodeError is returned for a message that cannot be decoded as the
// expected type: a poison message, never worth retrying.
type DecodeError struct {
	MessageID string
	Want, Got string
	Err       error
}

// Error implements error.
func (e *DecodeError) Error() string {
	if e.Err != nil {
		return fmt.Sprintf("steps: message %s: decoding %s: %v", e.MessageID, e.Want, e.Err)
	}
	return fmt.Sprintf("steps: message %s has type %q, want %q", e.MessageID, e.Got, e.Want)
}

// Outcome implements outcome.Classifier: a message that cannot be decoded
// never will be.
func (e *DecodeError) Outcome() delivery.Outcome { return outcome.Permanent }

// Unwrap returns the underlying error.
func (e *DecodeError) Unwrap() error { return e.Err }

// Decode decodes msg's payload as T after checking its type name.
func Decode[T Message](msg *message.Message) (T, error) {
	var v T
	want := v.MessageType()
	if got := msg.Metadata.Get(MetaType); got != want {
		return v, &DecodeError{MessageID: msg.UUID, Want: want, Got: got}
	}
	if err := json.Unmarshal(msg.Payload, &v); err != nil {
		return v, &DecodeError{MessageID: msg.UUID, Want: want, Got: want, Err: err}
	}
	return v, nil
}

// derivedID returns a UUID that is the same every time for the same parts:
// a reply or an outgoing message keeps its id across attempts and replays.
func derivedID(parts ...string) string {
	h := idempotency.Fingerprint(bytesOf(parts)...)
	return uuid.NewSHA1(idNamespace, h).String()
}

var idNamespace = uuid.MustParse("6f1c1d0e-5a5b-4b8e-9a55-70677361676d")

func bytesOf(parts []string) [][]byte {
	out := make([][]byte, len(parts))
	for i, p := range parts {
		out[i] = []byte(p)
	}
	return out
}
