package sagatest

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"

	"github.com/pgsaga/pgsaga/saga"
	"github.com/pgsaga/pgsaga/steps"
)

// The unit tier: one step, run once, in a transaction that is rolled back
// when the test has looked at what it did. No worker runs, nothing is
// queued or committed, and tests of it share a database freely.

// StepResult is what one run of a step did (Step).
type StepResult struct {
	// Reply is the answer the step published, as a saga would receive it:
	// decode it with steps.Decode. nil if the attempt failed.
	Reply *message.Message
	// Envelope is the reply's: Outcome is steps.OutcomeOK, or
	// steps.OutcomeFailed for a business failure (steps.Fail), with its
	// Reason.
	Envelope steps.Envelope
	// Err is the attempt's error, when the step neither answered nor
	// refused: a transient error (it would be retried) or a permanent one
	// (steps.IsPermanent: it would be dead-lettered). Nothing is stored then.
	Err error
}

// Failed reports whether the step refused the command (steps.Fail).
func (r StepResult) Failed() bool { return r.Envelope.Outcome == steps.OutcomeFailed }

// Step runs step on cmd once, as a worker of client would (the command's
// key claimed, the handler, its events, its reply, the key stored), in a
// transaction of its own. inspect, if not nil, is called in that
// transaction after the step, to read what it wrote; then everything is
// rolled back. A failure to run at all (the database, an inspect that
// returns an error) fails the test; the step's own error is in the result.
//
// The client needs the step's event types (ClientConfig.RegisterEvents);
// it need not be started, nor serve the step.
func Step[C steps.Message](t testing.TB, client *saga.Client, step steps.Step[C], cmd C, inspect func(tx steps.DBTX) error) StepResult {
	t.Helper()
	if client == nil {
		t.Fatalf("sagatest: Step of %s: a nil client", step.Name())
	}
	replyTo := "sagatest.reply." + uuid.NewString()
	id := uuid.NewString()
	msg, err := steps.NewMessage(cmd, steps.Envelope{ID: id, CorrelationID: id, Key: "sagatest:" + id, ReplyTo: replyTo})
	if err != nil {
		t.Fatalf("sagatest: Step of %s: encoding the command: %v", step.Name(), err)
	}
	var res StepResult
	var kitErr error // ours or inspect's, not the step's
	err = client.Runtime().Try(context.Background(), step, msg, func(tx steps.DBTX) error {
		if kitErr = readReply(tx, replyTo, &res); kitErr == nil && inspect != nil {
			if kitErr = inspect(tx); kitErr != nil {
				kitErr = fmt.Errorf("inspect: %w", kitErr)
			}
		}
		return kitErr
	})
	switch {
	case kitErr != nil:
		t.Fatalf("sagatest: Step of %s: %v", step.Name(), kitErr)
	case err != nil:
		res.Err = err
	}
	return res
}

// readReply reads the reply the step published to replyTo into res. The
// topic has no consumer group: the reply is kept, in the step's
// transaction, as a dead letter of it, with the dead letter's own entries
// added to its metadata (dropped here).
func readReply(tx steps.DBTX, replyTo string, res *StepResult) error {
	var uuid string
	var payload, meta []byte
	err := tx.QueryRowContext(context.Background(),
		`SELECT uuid, payload, metadata FROM pgsaga_dead_letters WHERE topic = $1 ORDER BY id DESC LIMIT 1`, replyTo).Scan(&uuid, &payload, &meta)
	if err != nil {
		return fmt.Errorf("reading the step's reply: %w", err)
	}
	reply := message.NewMessage(uuid, payload)
	if err := json.Unmarshal(meta, &reply.Metadata); err != nil {
		return fmt.Errorf("reading the step's reply: %w", err)
	}
	for k := range reply.Metadata {
		if strings.HasPrefix(k, "dead_letter_") {
			delete(reply.Metadata, k)
		}
	}
	res.Reply, res.Envelope = reply, steps.EnvelopeOf(reply)
	return nil
}
