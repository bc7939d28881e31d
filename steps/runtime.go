// Package steps is the participant side of pgsaga: the typed step contract
// and the runtime that runs every step the same way.
//
// A step handles one command type C: Define makes a Step[C] from its name,
// its topic and a handler, and a saga sends to it with saga.Send. Commands
// and replies are plain structs with a MessageType method:
//
//	type Reserve struct{ SKU string }
//
//	func (Reserve) MessageType() string { return "stock.Reserve" }
//
//	reserve := steps.Define("stock.reserve", "stock.reserve",
//		func(ctx context.Context, tx *steps.Tx, r Reserve) (steps.Message, error) {
//			res, err := tx.ExecContext(ctx, `UPDATE stock SET on_hand = on_hand - 1 WHERE sku = $1 AND on_hand > 0`, r.SKU)
//			if err != nil {
//				return nil, err // transient: rolled back, retried, then dead-lettered
//			}
//			if n, _ := res.RowsAffected(); n == 0 {
//				return nil, steps.Fail(nil, "out of stock") // final: stored, answered; the saga compensates
//			}
//			return nil, nil // done (DoneReply)
//		})
//
// A step served by another process is defined with a nil handler, for
// sagas to send to; the process that serves it adds the handler (Handle)
// and registers the step (saga.Client.AddSteps).
//
// For each delivery of a command the
// runtime, in one transaction (a watermill-sql subscriber's batch, inside a
// savepoint of the delivery attempt, or a transaction of its own):
//
//  1. decodes the command (a message that cannot be decoded is dead-lettered
//     at once, with the reason);
//  2. claims the command's idempotency key in the step's scope; a duplicate
//     publishes the stored reply again, with the same message id, and stops;
//  3. runs the handler, whose writes and outgoing messages go through the
//     same transaction (Tx);
//  4. publishes the reply to the command's reply-to topic and marks the key
//     completed with it.
//
// A handler returns a reply, a business failure (Fail: final, the key is
// stored failed, the handler's writes are rolled back and the failure reply
// is published) or any other error (transient: everything is rolled back
// and the attempt is retried with backoff, then the command is
// dead-lettered).
package steps

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"reflect"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"

	"github.com/pgsaga/pgsaga/idempotency"
	"github.com/pgsaga/pgsaga/internal/keysql"
	"github.com/pgsaga/pgsaga/internal/outcome"
	"github.com/pgsaga/pgsaga/internal/stepsrt"
	"github.com/pgsaga/pgsaga/internal/telemetry"
	"github.com/pgsaga/pgsaga/internal/transport"
	"github.com/pgsaga/pgsaga/saga/delivery"
	"github.com/pgsaga/pgsaga/steps/events"
)

// Handler handles one command of type C in the step's transaction. It
// returns the reply, Fail for a business failure (stored and answered), or
// another error: transient ones are retried, final ones (IsPermanent:
// Permanent, and the other packages' business failures such as
// idempotency.Reject, which a step does not answer) dead-letter the command.
type Handler[C Message] func(ctx context.Context, tx *Tx, cmd C) (Message, error)

// businessError is a final business outcome (Fail): the command was
// understood and refused (insufficient funds, an order already cancelled).
// The key is stored failed and Reply is published and replayed as the
// answer.
type businessError struct {
	Reply  Message
	Reason string
	// refusal, if set, says the command was refused without running
	// (MetaRefusal): RefusalExpired.
	refusal string
}

// Error implements error.
func (e *businessError) Error() string { return "business failure: " + e.Reason }

// Outcome implements outcome.Classifier: a business failure.
func (e *businessError) Outcome() delivery.Outcome { return outcome.BusinessFailure }

// Fail refuses the command: a final business outcome (insufficient funds,
// an order already cancelled). The key is stored failed, without the
// handler's writes, and reply is published and replayed as the answer.
// reply may be nil: a command that expects a reply (a saga's) is then
// answered with a FailureReply carrying reason, so the failure, and why,
// always reaches the sender.
func Fail(reply Message, reason string) error { return &businessError{Reply: reply, Reason: reason} }

// FailureReply is the reply to a command that expects one (its reply_to
// is set) when its handler failed it (Fail) without a reply of its own.
// Like every reply, it carries the outcome and the reason in its envelope
// (MetaOutcome, MetaReason).
type FailureReply struct {
	Reason string `json:"reason"`
}

// MessageType implements Message.
func (FailureReply) MessageType() string { return "pgsaga.StepFailed" }

// DoneReply is the reply to a command that expects one when its handler
// completed it without a reply of its own (a nil Message): a sender
// waiting for the answer (a saga) is told the step is done.
type DoneReply struct{}

// MessageType implements Message.
func (DoneReply) MessageType() string { return "pgsaga.StepDone" }

// Step is a participant's step, whose commands are of type C: its name,
// its topic and, where it is served, its handler (what a service serves;
// a saga's definition runs saga.Step stages that command it). Build it with Define. A saga sends to it
// (saga.Send), which takes its topic and command type from it, so that a
// saga cannot send a step a command of another type.
type Step[C Message] struct{ c core }

// core is a step, whatever its command type.
type core struct {
	Name        string
	Topic       string
	CommandType string

	handle func(ctx context.Context, tx *Tx, msg *message.Message) (Message, error)
}

// AnyStep is a Step of any command type: what a saga.Client serves
// (AddSteps).
type AnyStep interface {
	// Name scopes the step's idempotency keys and names its handler and
	// consumer group.
	Name() string
	// Topic the step's commands arrive on.
	Topic() string
	stepCore() core
}

var _ AnyStep = Step[DoneReply]{}

// Define builds the step name on topic whose commands are of type C,
// handled by h. A step served elsewhere (another service, another
// process) is defined with a nil h: a saga can send to it, and the process
// that serves it adds the handler (Handle).
func Define[C Message](name, topic string, h Handler[C]) Step[C] {
	var zero C
	return Step[C]{c: core{Name: name, Topic: topic, CommandType: zero.MessageType()}}.Handle(h)
}

// Handle returns the step, handled by h.
func (s Step[C]) Handle(h Handler[C]) Step[C] {
	s.c.handle = nil
	if h != nil {
		s.c.handle = func(ctx context.Context, tx *Tx, msg *message.Message) (Message, error) {
			cmd, err := Decode[C](msg)
			if err != nil {
				return nil, transport.Permanent(err)
			}
			return h(ctx, tx, cmd)
		}
	}
	return s
}

// Name scopes the step's idempotency keys and names its handler and
// consumer group.
func (s Step[C]) Name() string { return s.c.Name }

// Topic is the topic the step's commands arrive on.
func (s Step[C]) Topic() string { return s.c.Topic }

// CommandType is the type name of the step's commands (C's MessageType).
func (s Step[C]) CommandType() string { return s.c.CommandType }

func (s Step[C]) stepCore() core { return s.c }

func (s core) validate() error {
	switch {
	case s.handle == nil:
		return fmt.Errorf("steps: step %s has no handler: it is served elsewhere (add one with Handle)", s.Name)
	case s.Name == "" || len(s.Name) > idempotency.MaxScopeLen:
		return fmt.Errorf("steps: step name must be 1 to %d bytes", idempotency.MaxScopeLen)
	}
	if err := transport.ValidateConsumerGroup(s.Name); err != nil {
		return fmt.Errorf("steps: step %s: %w", s.Name, err)
	}
	if err := transport.ValidateTopic(s.Topic); err != nil {
		return fmt.Errorf("steps: step %s: %w", s.Name, err)
	}
	return nil
}

// runtime runs steps: the saga client's (internal/stepsrt is its door).
type runtime struct {
	tr    *transport.Transport
	store *idempotency.Store
	// keyLockTimeout is store's LockTimeout, for the batch claims.
	keyLockTimeout time.Duration
	events         *events.Store
	retry          transport.RetryPolicy
	log            *slog.Logger
	metrics        *telemetry.Metrics
	trace          *telemetry.Tracing
}

func init() { stepsrt.New = newRuntime }

// newRuntime validates cfg and returns a runtime (stepsrt.New).
func newRuntime(cfg stepsrt.Config) (stepsrt.Runtime, error) {
	if cfg.Transport == nil || cfg.Store == nil {
		return nil, errors.New("steps: Config.Transport and Config.Store are required")
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.KeyLockTimeout == 0 {
		cfg.KeyLockTimeout = 5 * time.Second
	}
	retry := cfg.Transport.Config().Retry
	if cfg.Retry != nil {
		retry = *cfg.Retry
	}
	return door{&runtime{tr: cfg.Transport, store: cfg.Store, keyLockTimeout: cfg.KeyLockTimeout, events: cfg.Events, retry: retry, log: cfg.Logger,
		metrics: cfg.Transport.Metrics(), trace: cfg.Transport.Tracing()}}, nil
}

// door is a runtime as stepsrt.Runtime: its steps are any.
type door struct{ rt *runtime }

func anyStep(step any) (AnyStep, error) {
	s, ok := step.(AnyStep)
	if !ok || s == nil {
		return nil, fmt.Errorf("steps: %T is not a step", step)
	}
	return s, nil
}

func (d door) Register(r *transport.Router, step any, opts ...transport.HandlerOption) error {
	if step == nil {
		return errors.New("steps: registering a nil step")
	}
	s, err := anyStep(step)
	if err != nil {
		return err
	}
	return d.rt.Register(r, s, opts...)
}

func (d door) Subscriptions(steps ...any) []transport.Subscription {
	var out []AnyStep
	for _, st := range steps {
		if s, err := anyStep(st); err == nil {
			out = append(out, s)
		}
	}
	return d.rt.Subscriptions(out...)
}

func (d door) Execute(ctx context.Context, step any, msg *message.Message) error {
	if step == nil {
		return errors.New("steps: executing a nil step")
	}
	s, err := anyStep(step)
	if err != nil {
		return err
	}
	return d.rt.Execute(ctx, s, msg)
}

func (d door) Try(ctx context.Context, step any, msg *message.Message, inspect func(tx delivery.DBTX) error) (stepErr, err error) {
	if step == nil {
		return nil, errors.New("steps: trying a nil step")
	}
	s, err := anyStep(step)
	if err != nil {
		return nil, err
	}
	return d.rt.Try(ctx, s, msg, inspect)
}

// Subscriptions lists what the steps consume, for Transport.Subscribe: each
// step's topic, as a consumer group named after the step.
func (rt *runtime) Subscriptions(steps ...AnyStep) []transport.Subscription {
	out := make([]transport.Subscription, 0, len(steps))
	for _, s := range steps {
		if s != nil {
			out = append(out, transport.Subscription{Topic: s.Topic(), ConsumerGroup: s.Name()})
		}
	}
	return out
}

// Register subscribes step s to its topic on r, under the consumer group
// s.Name. opts add to the handler's options (transport.InProcess, say);
// its retry policy is the runtime's.
func (rt *runtime) Register(r *transport.Router, step AnyStep, opts ...transport.HandlerOption) error {
	if step == nil {
		return errors.New("steps: registering a nil step")
	}
	s := step.stepCore()
	if err := s.validate(); err != nil {
		return err
	}
	kc := rt.keysConfig(s)
	keyOf := func(msg *message.Message) (string, string, []byte, bool) {
		req := kc.MessageRequest(msg)
		return req.Scope, req.Key, req.Hash, true
	}
	// A batch's commands claim their keys in one statement.
	base := []transport.HandlerOption{transport.WithRetry(rt.retry), transport.ClaimKeysPerBatch(keyOf, keysql.Claims(rt.keyLockTimeout))}
	return r.AddHandler(s.Name, s.Topic, s.Name, rt.handler(s), append(base, opts...)...)
}

// keysConfig is how step s claims its commands' keys.
func (rt *runtime) keysConfig(s core) idempotency.MiddlewareConfig {
	return idempotency.MiddlewareConfig{
		Scope:       s.Name,
		KeyMetadata: MetaKey,
		Fingerprint: func(m *message.Message) []byte {
			return idempotency.Fingerprint([]byte(m.Metadata.Get(MetaType)), m.Payload)
		},
		Publisher: func(tx delivery.DBTX) message.Publisher { return rt.tr.Publisher(tx) },
	}
}

// Execute runs step s for msg outside a subscriber, each attempt in a READ
// COMMITTED transaction of its own, with the same retries and dead-lettering
// as a registered step.
func (rt *runtime) Execute(ctx context.Context, step AnyStep, msg *message.Message) error {
	if step == nil {
		return errors.New("steps: executing a nil step")
	}
	s := step.stepCore()
	if err := s.validate(); err != nil {
		return err
	}
	return rt.tr.HandleInTx(ctx, s.Name, s.Topic, msg, rt.handler(s), transport.WithRetry(rt.retry))
}

// Try runs step s once for msg, as Execute's first attempt would (claim,
// handler, reply, key), in a transaction it rolls back once inspect has
// seen what the step did there: nothing of that transaction stays, nothing
// is retried or dead-lettered. An awaited call (Await) runs at once, and
// what it commits on its own stays. The step's failure is stepErr;
// anything else that stopped it (the database, inspect) is err. It returns the attempt's error (inspect is not called
// then), or inspect's. The test kit's unit tier (sagatest.Step) is built
// on it.
func (rt *runtime) Try(ctx context.Context, step AnyStep, msg *message.Message, inspect func(tx delivery.DBTX) error) (stepErr, err error) {
	if step == nil {
		return nil, errors.New("steps: trying a nil step")
	}
	s := step.stepCore()
	if err := s.validate(); err != nil {
		return nil, err
	}
	return rt.tr.TryInTx(ctx, s.Name, s.Topic, msg, rt.handler(s), func(tx delivery.DBTX) (*message.Message, error) {
		if inspect == nil {
			return nil, nil
		}
		return nil, inspect(tx)
	})
}

// handler composes the step in the attempt's transaction: claim the
// command's key (a duplicate gets its stored reply again), run the handler,
// publish the reply and finish the key, calling the idempotency store
// directly.
func (rt *runtime) handler(s core) transport.HandlerFunc {
	keys, err := rt.store.MessageKeys(rt.keysConfig(s))
	if err != nil {
		// Scope was validated with the step; this cannot happen.
		panic(err)
	}
	return func(msg *message.Message) (err error) {
		start := time.Now()
		ctx, span := rt.startSpan(s, msg)
		var biz *businessError
		defer func() {
			if p := recover(); p != nil {
				rt.attemptPanicked(s, span, start, ctx, p)
				panic(p)
			}
			spanErr := err
			switch {
			case errors.As(err, &biz):
				// An answer, stored by the attempt that follows (its own
				// span), not an error of the step.
				span.SetAttributes(telemetry.AttrOutcome.String(telemetry.StepFailed), attribute.String("pgsaga.reason", biz.Reason))
				spanErr = nil
			case transport.IsAwait(err) || transport.IsHandBack(err):
				// Not a failure: the attempt waits on a call, or leaves its
				// message to the key's holder. A call that fails is one
				// (rt.observeCall).
				outcome := telemetry.StepAwaiting
				var aw *transport.AwaitError
				if errors.As(err, &aw) {
					rt.observeCall(ctx, s, aw)
				} else {
					outcome = telemetry.StepHandedBack
				}
				rt.metrics.StepAttempt(s.Name, outcome, time.Since(start), transport.AttemptFromContext(ctx))
				span.SetAttributes(telemetry.AttrOutcome.String(outcome))
				spanErr = nil
			case err != nil:
				rt.metrics.StepAttempt(s.Name, telemetry.StepError, time.Since(start), transport.AttemptFromContext(ctx))
				span.SetAttributes(telemetry.AttrOutcome.String(telemetry.StepError))
			}
			telemetry.End(span, spanErr)
		}()
		ttx, claim, err := claimIn(s, keys, msg)
		if err != nil {
			return err // ErrKeyReused is permanent (outcome.Permanent)
		}
		env := EnvelopeOf(msg)
		key := idempotencyKey(msg)
		if !claim.Run {
			span.SetAttributes(telemetry.AttrOutcome.String(telemetry.StepReplayed))
			rt.observe(ctx, ttx, s, env, key, telemetry.StepReplayed, start, "")
			return nil
		}
		if !transport.AwaitedFromContext(ctx) {
			// Past its not-after, a command is refused, never run. Not
			// after an awaited call: the handler has acted already.
			refusal, err := expired(ctx, ttx, msg)
			if err != nil {
				return err
			}
			if refusal != nil {
				return transport.Instead(rt.recordFailure(s, keys, refusal, start), refusal)
			}
		}
		reply, err := s.handle(ctx, &Tx{DBTX: ttx, rt: rt, step: s, env: env, key: key, payload: msg.Payload}, msg)
		switch {
		case errors.As(err, &biz):
			// The attempt, the handler's writes and the claim with it, is
			// rolled back; the failure is stored in a fresh one.
			return transport.Instead(rt.recordFailure(s, keys, biz, start), err)
		case err != nil:
			return err
		}
		replies, err := rt.replies(s, env, key, reply, OutcomeOK, "", "")
		if err != nil {
			return err
		}
		withContext(ctx, replies)
		if err := keys.FinishTx(ctx, ttx, claim, idempotency.StatusCompleted, "", replies...); err != nil {
			return err
		}
		span.SetAttributes(telemetry.AttrOutcome.String(telemetry.StepCompleted))
		rt.observe(ctx, ttx, s, env, key, telemetry.StepCompleted, start, "")
		return nil
	}
}

// observeCall makes the awaited call aw of step s, whose attempt ran under
// ctx, traced and counted: its own span ("await <name>", a child of the
// attempt's), an error if the call fails, and a failed call counted as an
// error of the step (the attempt that awaited it counted as awaiting).
func (rt *runtime) observeCall(ctx context.Context, s core, aw *transport.AwaitError) {
	call, parent, attempt := aw.Call, trace.SpanContextFromContext(ctx), transport.AttemptFromContext(ctx)
	aw.Call = func(callCtx context.Context) (err error) {
		began := time.Now()
		callCtx, span := rt.trace.Start(trace.ContextWithSpanContext(callCtx, parent), "await "+s.Name, trace.SpanKindClient,
			telemetry.AttrHandler.String(s.Name), telemetry.AttrAttempt.Int(attempt))
		defer func() {
			if p := recover(); p != nil {
				rt.metrics.StepAttempt(s.Name, telemetry.StepError, time.Since(began), attempt)
				telemetry.End(span, fmt.Errorf("the awaited call panicked: %v", p))
				panic(p)
			}
			if err != nil {
				rt.metrics.StepAttempt(s.Name, telemetry.StepError, time.Since(began), attempt)
				span.SetAttributes(telemetry.AttrOutcome.String(telemetry.StepError))
			}
			telemetry.End(span, err)
		}()
		return call(callCtx)
	}
}

// startSpan starts the span of a step attempt on msg, a child of its
// delivery's: "step <name>".
func (rt *runtime) startSpan(s core, msg *message.Message) (context.Context, trace.Span) {
	ctx := msg.Context()
	attrs := []attribute.KeyValue{telemetry.AttrHandler.String(s.Name), telemetry.AttrKey.String(idempotencyKey(msg)),
		telemetry.AttrAttempt.Int(transport.AttemptFromContext(ctx))}
	if step := msg.Metadata.Get(MetaStep); step != "" {
		attrs = append(attrs, telemetry.AttrStep.String(step))
	}
	if id := msg.Metadata.Get(MetaSagaID); id != "" {
		attrs = append(attrs, telemetry.AttrSagaID.String(id))
	}
	return rt.trace.Start(ctx, "step "+s.Name, trace.SpanKindInternal, attrs...)
}

// attemptPanicked counts and ends the span of a step attempt whose handler
// panicked (the transport recovers it: a failed attempt).
func (rt *runtime) attemptPanicked(s core, span trace.Span, start time.Time, ctx context.Context, p any) {
	rt.metrics.StepAttempt(s.Name, telemetry.StepError, time.Since(start), transport.AttemptFromContext(ctx))
	span.SetAttributes(telemetry.AttrOutcome.String(telemetry.StepError))
	telemetry.End(span, fmt.Errorf("%w: %v", transport.ErrHandlerPanicked, p))
}

// withContext sets ctx on msgs: their publish spans are children of ctx's.
func withContext(ctx context.Context, msgs []*message.Message) {
	for _, m := range msgs {
		m.SetContext(ctx)
	}
}

// observe counts a step attempt that answered its command (completed,
// failed or replayed) and logs it, once its transaction commits (see
// transport.OnCommit).
func (rt *runtime) observe(ctx context.Context, tx delivery.DBTX, s core, env Envelope, key, outcome string, start time.Time, detail string) {
	took := time.Since(start)
	attempt := transport.AttemptFromContext(ctx)
	done := func() {
		rt.metrics.StepAttempt(s.Name, outcome, took, attempt)
		attrs := []any{"step", s.Name, "outcome", outcome, "key", key, "attempt", attempt, "took_ms", telemetry.Millis(took)}
		if env.SagaID != "" {
			attrs = append(attrs, "saga_id", env.SagaID)
		}
		if detail != "" {
			attrs = append(attrs, "reason", detail)
		}
		attrs = append(attrs, telemetry.LogIDs(ctx)...)
		rt.log.Info("step "+outcome, attrs...)
	}
	if !transport.OnCommit(tx, done) {
		done()
	}
}

// recordFailure stores a business failure for the command and publishes its
// reply, without running the handler again. A duplicate handled meanwhile
// has its stored reply published again instead.
func (rt *runtime) recordFailure(s core, keys *idempotency.MessageKeys, biz *businessError, start time.Time) transport.HandlerFunc {
	return func(msg *message.Message) (err error) {
		ctx, span := rt.startSpan(s, msg)
		defer func() {
			if p := recover(); p != nil {
				rt.attemptPanicked(s, span, start, ctx, p)
				panic(p)
			}
			outcome := telemetry.StepFailed
			if err != nil {
				outcome = telemetry.StepError
				rt.metrics.StepAttempt(s.Name, telemetry.StepError, time.Since(start), transport.AttemptFromContext(ctx))
			}
			span.SetAttributes(telemetry.AttrOutcome.String(outcome), attribute.String("pgsaga.reason", biz.Reason))
			telemetry.End(span, err)
		}()
		ttx, claim, err := claimIn(s, keys, msg)
		if err != nil {
			return err
		}
		env, key := EnvelopeOf(msg), idempotencyKey(msg)
		if !claim.Run {
			rt.observe(ctx, ttx, s, env, key, telemetry.StepReplayed, start, "")
			return nil
		}
		replies, err := rt.replies(s, env, key, biz.Reply, OutcomeFailed, biz.Reason, biz.refusal)
		if err != nil {
			return err
		}
		withContext(ctx, replies)
		if err := keys.FinishTx(ctx, ttx, claim, idempotency.StatusFailed, biz.Reason, replies...); err != nil {
			return err
		}
		rt.observe(ctx, ttx, s, env, key, telemetry.StepFailed, start, biz.Reason)
		return nil
	}
}

// claimIn claims msg's key in the transaction of its attempt.
func claimIn(s core, keys *idempotency.MessageKeys, msg *message.Message) (delivery.DBTX, *idempotency.MessageClaim, error) {
	ttx, ok := transport.TxFromContext(msg.Context())
	if !ok {
		return nil, nil, fmt.Errorf("steps: %s: message %s carries no transaction", s.Name, msg.UUID)
	}
	claim, err := keys.ClaimTx(msg.Context(), ttx, msg)
	return ttx, claim, err
}

// replies builds the reply to a command; none when the command names no
// reply topic. A command that names one is always answered, with
// FailureReply or DoneReply when the handler gave no reply of its own,
// and the reply carries the command's reply token back. A reply that is
// a nil pointer (var out *Out; return out, nil) is the handler's mistake:
// permanent, nothing of the attempt is kept.
func (rt *runtime) replies(s core, cmd Envelope, key string, reply Message, outcome, reason, refusal string) ([]*message.Message, error) {
	if reply != nil && nilPointer(reply) {
		return nil, transport.Permanent(fmt.Errorf("%w: %s (%T)", ErrNilReply, s.Name, reply))
	}
	if cmd.ReplyTo == "" {
		return nil, nil
	}
	if reply == nil {
		reply = DoneReply{}
		if outcome == OutcomeFailed {
			reply = FailureReply{Reason: reason}
		}
	}
	m, err := NewMessage(reply, Envelope{
		ID:            derivedID("reply", s.Name, key),
		CorrelationID: cmd.CorrelationID,
		CausationID:   cmd.ID,
		SagaID:        cmd.SagaID,
		Step:          cmd.Step,
		Key:           key,
		Outcome:       outcome,
		Reason:        reason,
		ReplyToken:    cmd.ReplyToken,
		Refusal:       refusal,
	})
	if err != nil {
		return nil, transport.Permanent(err)
	}
	return []*message.Message{m}, nil
}

// nilPointer reports whether m is a nil pointer of some type, whose
// methods may panic and which encodes as JSON null.
func nilPointer(m Message) bool {
	v := reflect.ValueOf(m)
	return v.Kind() == reflect.Pointer && v.IsNil()
}

// expired returns the refusal of msg if it is past its not-after
// (MetaNotAfter) on the database's clock, nil if it may run: it has none
// (not a saga's action, or sent by an earlier release), or its time has
// not come. A not-after that cannot be read is ErrBadNotAfter, without
// the text.
func expired(ctx context.Context, tx delivery.DBTX, msg *message.Message) (*businessError, error) {
	raw := msg.Metadata.Get(MetaNotAfter)
	if raw == "" {
		return nil, nil
	}
	notAfter := parseNotAfter(raw)
	if notAfter.IsZero() {
		return nil, transport.Permanent(fmt.Errorf("%w (message %s, %d bytes)", ErrBadNotAfter, msg.UUID, len(raw)))
	}
	now, err := transport.Now(ctx, tx)
	if err != nil {
		return nil, err
	}
	if !now.After(notAfter) {
		return nil, nil
	}
	reason := fmt.Sprintf("refused: the command arrived past its not-after (%s, %s late); it did not run",
		formatNotAfter(notAfter), now.Sub(notAfter).Round(time.Millisecond))
	return &businessError{Reason: reason, refusal: RefusalExpired}, nil
}

func idempotencyKey(msg *message.Message) string {
	if k := msg.Metadata.Get(MetaKey); k != "" {
		return k
	}
	return msg.UUID
}

// Tx is a handler's view of its step: the transaction its writes go through
// (the methods of DBTX), the command's envelope, and an outbox for
// further messages. The handler does not end that transaction: the
// runtime commits it with the command's key and reply, and a COMMIT or
// ROLLBACK sent through it fails the attempt
// (delivery.ErrTransactionEnded).
type Tx struct {
	delivery.DBTX
	rt   *runtime
	step core
	env  Envelope
	key  string
	sent int
	// payload is the command's, whose fingerprint a Call's record keeps.
	payload []byte
}

// Command returns the envelope of the command being handled.
func (t *Tx) Command() Envelope { return t.env }

// Key returns the command's idempotency key: pass it to external services so
// they can deduplicate too.
func (t *Tx) Key() string { return t.key }

// Append appends evs to stream in the step's transaction, expecting the
// stream at version expected (events.AnyVersion: after its last event), with
// the command's correlation, causation, saga id and key as metadata. A
// conflict (events.ErrVersionConflict) is transient: returning it retries
// the step on fresh state.
func (t *Tx) Append(ctx context.Context, stream string, expected int, evs ...events.Event) ([]events.Recorded, error) {
	if t.rt.events == nil {
		return nil, ErrNoEventStore
	}
	return t.rt.events.AppendTx(ctx, t.DBTX, stream, expected, events.Metadata{
		CorrelationID: t.env.CorrelationID, CausationID: t.env.ID, SagaID: t.env.SagaID, IdempotencyKey: t.key,
	}, evs...)
}

// Version returns stream's current version in the step's transaction.
func (t *Tx) Version(ctx context.Context, stream string) (int, error) {
	if t.rt.events == nil {
		return 0, ErrNoEventStore
	}
	return t.rt.events.VersionTx(ctx, t.DBTX, stream)
}

// Fold loads stream in the step's transaction and applies it to agg,
// returning the version reached.
func (t *Tx) Fold(ctx context.Context, stream string, agg events.Aggregate) (int, error) {
	if t.rt.events == nil {
		return 0, ErrNoEventStore
	}
	return t.rt.events.FoldTx(ctx, t.DBTX, stream, 0, agg)
}

// Savepoint runs fn in a savepoint of the step's transaction: if fn fails,
// what it wrote and published is taken back (a queued write, a message
// published from fn, an event appended) and the step goes on with its
// work before it. A handler must not run SAVEPOINT, ROLLBACK or COMMIT
// itself.
func (t *Tx) Savepoint(ctx context.Context, fn func(tx *Tx) error) error {
	return transport.Savepoint(ctx, t.DBTX, func(inner delivery.DBTX) error {
		nested := *t
		nested.DBTX = inner
		err := fn(&nested)
		t.sent = nested.sent
		return err
	})
}

// Publish sends m to topic through the step's transaction: it exists if and
// only if the step commits. It carries the command's correlation and saga
// ids, and an id derived from the command's key and its position among the
// step's outgoing messages, so a retried step publishes the same ids.
func (t *Tx) Publish(topic string, m Message) error {
	t.sent++
	msg, err := NewMessage(m, Envelope{
		ID:            derivedID("out", t.step.Name, t.key, fmt.Sprint(t.sent)),
		CorrelationID: t.env.CorrelationID,
		CausationID:   t.env.ID,
		SagaID:        t.env.SagaID,
	})
	if err != nil {
		return err
	}
	return t.rt.tr.Publisher(t.DBTX).Publish(topic, msg)
}
