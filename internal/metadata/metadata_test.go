package metadata_test

import (
	"testing"

	"github.com/stretchr/testify/assert"

	"github.com/pgsaga/pgsaga/internal/metadata"
)

// The keys are a contract with everything that reads the topics and with
// the SQL that writes dead letters (migrations): changing one breaks them.
func TestKeysAreTheContract(t *testing.T) {
	for want, got := range map[string]string{
		"type": metadata.Type, "correlation_id": metadata.CorrelationID, "causation_id": metadata.CausationID,
		"saga_id": metadata.SagaID, "step": metadata.Step, "idempotency_key": metadata.Key, "reply_to": metadata.ReplyTo,
		"outcome": metadata.Outcome, "reason": metadata.Reason, "idempotent_replay": metadata.Replayed,
		"stream_id": metadata.StreamID, "stream_version": metadata.StreamVersion, "partition_key": metadata.PartitionKey,
		"dead_letter_reason": metadata.DeadLetterReason, "dead_letter_attempts": metadata.DeadLetterAttempts,
		"dead_letter_topic": metadata.DeadLetterTopic, "dead_letter_handler": metadata.DeadLetterHandler,
		"dead_letter_group": metadata.DeadLetterGroup, "dead_letter_at": metadata.DeadLetterAt,
		"traceparent": metadata.TraceParent, "tracestate": metadata.TraceState,
		"not_after": metadata.NotAfter, "reply_token": metadata.ReplyToken, "refusal": metadata.Refusal,
		"expired": metadata.RefusalExpired, "saga": metadata.Saga,
	} {
		assert.Equal(t, want, got)
	}
}
