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
	"github.com/pgsaga/pgsaga/saga/delivery"
	"github.com/pgsaga/pgsaga/saga/internal/unittier"
	"github.com/pgsaga/pgsaga/steps"
)

// The unit tier: one step, run once, or a saga's reactions, in a
// transaction that is rolled back when the test has looked at what it
// did. No worker runs and nothing is queued or committed in it, so tests
// of it share a database (what a step commits on its own, an awaited
// call's record say, is the exception: see Step; and a saga's key must be
// the test's own: see Transitions).

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
// rolled back. Anything but the step that stops it (the database, an
// inspect that returns an error) fails the test; the step's own error is
// the result's Err.
//
// A step that awaits a call (steps.Await) has the call run at once, as an
// in-process delivery would, and then runs again (steps.Awaited): only
// the step's transaction is rolled back, so what the call, or the step in
// a transaction of its own, commits (a lease, the call's record, a
// request to a fake service) stays.
//
// The client needs the step's event types (ClientConfig.RegisterEvents);
// it need not be started, nor serve the step.
func Step[C steps.Message](t testing.TB, client *saga.Client, step steps.Step[C], cmd C, inspect func(tx delivery.DBTX) error) StepResult {
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
	stepErr, err := unittier.Step(context.Background(), client, step, msg, func(tx delivery.DBTX) error {
		if err := readReply(tx, replyTo, &res); err != nil {
			return err
		}
		if inspect != nil {
			if err := inspect(tx); err != nil {
				return fmt.Errorf("inspect: %w", err)
			}
		}
		return nil
	})
	if err != nil { // the kit's, the database's or inspect's: not the step's
		t.Fatalf("sagatest: Step of %s: %v", step.Name(), err)
	}
	res.Err = stepErr
	return res
}

// readReply reads the reply the step published to replyTo into res. The
// topic has no consumer group: the reply is kept, in the step's
// transaction, as a dead letter of it, with the dead letter's own entries
// added to its metadata (dropped here).
func readReply(tx delivery.DBTX, replyTo string, res *StepResult) error {
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

// Reply is a participant's answer to a saga's command in flight, for
// Transitions: Answer or Refuse.
type Reply struct{ r unittier.Reply }

// Answer is the step's reply m (nil: the step answered with nothing, a
// steps.DoneReply).
func Answer(m steps.Message) Reply { return Reply{unittier.Reply{Message: m}} }

// Refuse is the step's refusal (steps.Fail): reply m (nil: a
// steps.FailureReply) with reason.
func Refuse(m steps.Message, reason string) Reply {
	return Reply{unittier.Reply{Message: m, Failed: true, Reason: reason}}
}

// Transition is a saga after one reaction of the engine (to its trigger,
// or to a reply), as it would commit.
type Transition struct {
	// Instance is the saga: its status, step, phase, data and timeline.
	Instance saga.Instance
	// Command is the command the reaction sent (decode it with
	// steps.Decode; its envelope names the step and the key); nil if it
	// sent none (the saga ended, or the reply changed nothing).
	Command *message.Message
}

// TransitionsResult is what Transitions saw.
type TransitionsResult struct {
	// Transitions are the saga after its start, then after each reply.
	Transitions []Transition
	// Err is the reaction's error that stopped the run (a reply of
	// another type than its step's, say): the saga, as it was before it,
	// is in Transitions.
	Err error
}

// Last is the saga after the last reaction that ran.
func (r TransitionsResult) Last() Transition {
	if len(r.Transitions) == 0 {
		return Transition{}
	}
	return r.Transitions[len(r.Transitions)-1]
}

// Transitions starts saga name from trigger and answers its command in
// flight with each of replies in turn, as a worker of client would react
// (the instance, its timeline, the next command), in one transaction
// that is rolled back at the end: the saga's reactions, one at a time,
// with no step running and nothing left behind. inspect, if not nil, is
// called in that transaction after each reaction. The client needs the
// saga registered (Register); it need not be started. The trigger's key
// must be the run's own: a saga of that key committed in the database, or
// another run of it under way, fails the test (say so, at once), as do a
// reply with no command left to answer, a failure of the kit, of the
// database or of inspect; the engine's failure is the result's Err.
func Transitions(t testing.TB, client *saga.Client, name string, trigger steps.Message, inspect func(tx delivery.DBTX, t Transition) error,
	replies ...Reply) TransitionsResult {
	t.Helper()
	if client == nil {
		t.Fatalf("sagatest: Transitions of %s: a nil client", name)
	}
	rs := make([]unittier.Reply, len(replies))
	for i, r := range replies {
		rs[i] = r.r
	}
	var res TransitionsResult
	reactionErr, err := unittier.Transitions(context.Background(), client, name, trigger, rs, func(tx delivery.DBTX, u unittier.Transition) error {
		tr := Transition{Instance: u.Instance.(saga.Instance), Command: u.Command}
		res.Transitions = append(res.Transitions, tr)
		if inspect != nil {
			if err := inspect(tx, tr); err != nil {
				return fmt.Errorf("inspect: %w", err)
			}
		}
		return nil
	})
	if err != nil { // the kit's, the database's, inspect's, or the test's (a reply too many): not the engine's
		t.Fatalf("sagatest: Transitions of %s: %v", name, err)
	}
	res.Err = reactionErr
	return res
}
