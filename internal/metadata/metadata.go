// Package metadata names every Watermill metadata key pgsaga reads or
// writes, in one place: the contract between the transport, the
// idempotency middleware, the step runtime, the event store, the saga
// engine and anything else that reads the topics. The public packages
// export the keys users read, one name each (steps.MetaType,
// steps.MetaReplyTo, events.MetaStreamID, …); the strings are fixed here.
package metadata

// The envelope: every message pgsaga sends carries these.
const (
	// Type is the payload's type name (steps.Message.MessageType).
	Type = "type"
	// CorrelationID ties together every message of one business
	// transaction (a saga): copied from command to reply to next command.
	CorrelationID = "correlation_id"
	// CausationID is the UUID of the message that caused this one.
	CausationID = "causation_id"
	// SagaID is the saga instance the message belongs to, if any.
	SagaID = "saga_id"
	// Step is the saga step a command or reply belongs to.
	Step = "step"
	// Key is the idempotency key of a command: stable across re-sends (for
	// a saga, derived from saga id and step, never from the attempt).
	Key = "idempotency_key"
	// ReplyTo is the topic a command's reply goes to.
	ReplyTo = "reply_to"
	// Outcome is "ok" or "failed" on a reply.
	Outcome = "outcome"
	// Reason explains a failed reply.
	Reason = "reason"
	// Replayed is "true" on a reply published again for a duplicate
	// command; the reply keeps its original UUID.
	Replayed = "idempotent_replay"
	// NotAfter is the time past which a command must not run, in RFC 3339
	// with nanoseconds, on the clock of the sender's database: a step
	// runtime refuses a command it gets later (Refusal "expired"), and the
	// saga engine gives up on it only once that time has passed.
	NotAfter = "not_after"
	// ReplyToken is an unguessable token a saga's command carries, which
	// its reply must carry back: a reply to the command in flight without
	// it is forged, and changes nothing.
	ReplyToken = "reply_token"
	// Refusal says why a failed reply refuses its command without having
	// run it: "expired" (past its NotAfter).
	Refusal = "refusal"
	// Saga, on a trigger StartTx published, names the one saga it starts:
	// other sagas on the same trigger topic leave it.
	Saga = "saga"
)

// Refusals.
const (
	// RefusalExpired: the command arrived past its NotAfter and did not run.
	RefusalExpired = "expired"
)

// Trace context, in the W3C Trace Context format: every publish sets them
// (see telemetry.Tracing) when tracing is on, so that every hop of a saga,
// in any process, joins one trace.
const (
	TraceParent = "traceparent"
	TraceState  = "tracestate"
)

// Event messages carry these besides the envelope.
const (
	// StreamID is the event's stream.
	StreamID = "stream_id"
	// StreamVersion is the event's version in its stream.
	StreamVersion = "stream_version"
	// PartitionKey is the stream id again, under the name partitioned
	// brokers order by.
	PartitionKey = "partition_key"
)

// Dead letters carry these besides the message's own.
const (
	DeadLetterReason   = "dead_letter_reason"
	DeadLetterAttempts = "dead_letter_attempts"
	DeadLetterTopic    = "dead_letter_topic"
	DeadLetterHandler  = "dead_letter_handler"
	DeadLetterGroup    = "dead_letter_group"
	DeadLetterAt       = "dead_letter_at"
)
