package saga

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"strings"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/pgsaga/pgsaga/internal/transport"
	"github.com/pgsaga/pgsaga/saga/delivery"
	"github.com/pgsaga/pgsaga/saga/internal/unittier"
	"github.com/pgsaga/pgsaga/steps"
)

func init() {
	unittier.Transitions = tryTransitions
	unittier.Step = func(ctx context.Context, client any, step steps.AnyStep, msg *message.Message, inspect func(tx delivery.DBTX) error) (error, error) {
		c, ok := client.(*Client)
		if !ok || c == nil {
			return nil, errors.New("saga: a step's run needs a *saga.Client")
		}
		return c.runtime.Try(ctx, step, msg, inspect)
	}
}

// tryTransitions is unittier.Transitions: the engine's reactions to a
// trigger and to replies, as a worker would run them, in one delivery
// attempt (transport.TryInTx) that is rolled back.
func tryTransitions(ctx context.Context, client any, name string, trigger steps.Message, replies []unittier.Reply,
	observe func(tx delivery.DBTX, t unittier.Transition) error) (reactionErr, err error) {
	c, ok := client.(*Client)
	if !ok || c == nil {
		return nil, errors.New("saga: transitions need a *saga.Client")
	}
	msg, def, id, err := c.triggerMessage(name, trigger)
	if err != nil {
		return nil, err
	}
	// Each reaction is an attempt of its own in the transaction: the
	// trigger's first, then each reply's. After each, the saga is read as
	// it stands, and the next reply answers the command in flight.
	// The instance's id comes from the trigger's key: a saga of that key
	// committed in the database, or in another run's transaction now,
	// would be reported instead, or waited for. Neither is a reaction's
	// doing: the run stops, saying so.
	var kitErr error
	triggered := false
	h := func(msg *message.Message) error {
		if triggered {
			return c.engine.handleReply(msg)
		}
		triggered = true
		tx, _ := transport.TxFromContext(msg.Context())
		var mine bool
		if err := tx.QueryRowContext(msg.Context(), `SELECT pg_try_advisory_xact_lock(hashtextextended('pgsaga.unit/' || $1, 0))`, id.String()).Scan(&mine); err != nil {
			return err
		}
		if !mine {
			kitErr = fmt.Errorf("saga %s: another run of saga %s with this key is under way: give each test a key of its own", id, name)
			return kitErr
		}
		started, err := c.engine.startFrom(name, msg)
		if err == nil && !started {
			kitErr = fmt.Errorf("saga %s: a saga %s with this key exists in the database already: give the run a key no saga has", id, name)
			return kitErr
		}
		return err
	}
	var observeErr error
	var inFlight *message.Message
	next := func(tx delivery.DBTX) (*message.Message, error) {
		inst, err := loadInstance(ctx, tx, id, false)
		if err != nil {
			return nil, err
		}
		public, err := withHistory(ctx, tx, c.engine.public(inst))
		if err != nil {
			return nil, err
		}
		var sent *message.Message
		if inst.CommandID != "" && (inFlight == nil || inst.CommandID != inFlight.UUID) {
			if sent, err = sentCommand(ctx, tx, inst.CommandID); err != nil {
				return nil, err
			}
			inFlight = sent
		} else if inst.Status.Terminal() {
			inFlight = nil
		}
		if observeErr = observe(tx, unittier.Transition{Instance: public, Command: sent}); observeErr != nil {
			return nil, observeErr
		}
		if len(replies) == 0 {
			return nil, nil
		}
		r := replies[0]
		replies = replies[1:]
		if inFlight == nil {
			return nil, fmt.Errorf("saga %s: a reply answers nothing: no command is in flight", id)
		}
		return replyTo(inFlight, r)
	}
	reactionErr, err = c.transport.TryInTx(ctx, "saga."+name+".transitions", def.Trigger, msg, h, next)
	switch {
	case observeErr != nil:
		return nil, observeErr
	case kitErr != nil:
		return nil, kitErr
	}
	return reactionErr, err
}

// sentCommand reads the command a reaction sent (uuid), in its
// transaction: queued for the step's consumer groups, or, for a topic no
// group reads, kept as a dead letter.
func sentCommand(ctx context.Context, tx delivery.DBTX, id string) (*message.Message, error) {
	var payload []byte
	var meta []byte
	err := tx.QueryRowContext(ctx, `SELECT payload, metadata FROM (
    SELECT payload, metadata::text AS metadata, 1 AS o FROM pgsaga_queue WHERE uuid = $1
    UNION ALL
    SELECT payload, metadata::text, 2 FROM pgsaga_dead_letters WHERE uuid = $1 AND replayed_at IS NULL
) m ORDER BY o LIMIT 1`, id).Scan(&payload, &meta)
	if errors.Is(err, sql.ErrNoRows) {
		return nil, fmt.Errorf("saga: the command sent (%s) is not in the database", id)
	}
	if err != nil {
		return nil, fmt.Errorf("saga: reading the command sent (%s): %w", id, err)
	}
	msg := message.NewMessage(id, payload)
	if err := json.Unmarshal(meta, &msg.Metadata); err != nil {
		return nil, fmt.Errorf("saga: reading the command sent (%s): %w", id, err)
	}
	for k := range msg.Metadata {
		if strings.HasPrefix(k, "dead_letter_") { // a dead letter's own entries
			delete(msg.Metadata, k)
		}
	}
	return msg, nil
}

// replyTo is r as the step's reply to cmd, carrying its reply token back
// as the step runtime's would.
func replyTo(cmd *message.Message, r unittier.Reply) (*message.Message, error) {
	env := steps.EnvelopeOf(cmd)
	m := r.Message
	outcome := steps.OutcomeOK
	if r.Failed {
		outcome = steps.OutcomeFailed
		if m == nil {
			m = steps.FailureReply{Reason: r.Reason}
		}
	}
	if m == nil {
		m = steps.DoneReply{}
	}
	return steps.NewMessage(m, steps.Envelope{CorrelationID: env.CorrelationID, CausationID: cmd.UUID, SagaID: env.SagaID,
		Step: env.Step, Key: env.Key, Outcome: outcome, Reason: r.Reason, ReplyToken: env.ReplyToken})
}
