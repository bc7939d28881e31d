package saga

import (
	"context"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"database/sql"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"

	"github.com/pgsaga/pgsaga/internal/dbtx"
	"github.com/pgsaga/pgsaga/internal/metadata"
	"github.com/pgsaga/pgsaga/internal/telemetry"
	"github.com/pgsaga/pgsaga/internal/transport"
	"github.com/pgsaga/pgsaga/saga/delivery"
	"github.com/pgsaga/pgsaga/steps"
)

// Status of an instance, as stored in saga_instances.status.
type Status string

// Statuses. The last three are terminal.
const (
	StatusRunning      Status = "running"
	StatusCompensating Status = "compensating"
	StatusCompleted    Status = "completed"
	StatusCompensated  Status = "compensated"
	StatusFailed       Status = "failed"
)

// Terminal reports whether nothing more will happen to an instance in s.
func (s Status) Terminal() bool {
	return s == StatusCompleted || s == StatusCompensated || s == StatusFailed
}

// Phase says whether a step's action or its compensation is in flight.
type Phase string

// Phases.
const (
	PhaseAction       Phase = "action"
	PhaseCompensation Phase = "compensation"
)

// errBadCommand: a command cannot be built from the saga's data.
var errBadCommand = errors.New("saga: bad command")

// engineConfig configures an engine.
type engineConfig struct {
	// DB is required (the sweeper and the operator API open their own
	// transactions).
	DB *sql.DB
	// Transport publishes commands through the reaction's transaction.
	// Required.
	Transport *transport.Transport
	// Retry is the policy of the engine's handlers. Default: the
	// transport's. A trigger or reply the engine cannot use goes to
	// pgsaga_dead_letters, with the reason.
	Retry *transport.RetryPolicy
	// SweepInterval is how often RunSweeper looks for overdue commands.
	// Default: 1s.
	SweepInterval time.Duration
	// SweepBatch bounds the instances one sweep handles. Default: 100.
	SweepBatch int
	// FinishedChannel, if set, is a PostgreSQL notification channel: every
	// instance that reaches a terminal state (completed, compensated,
	// failed) sends a notification on it, with its id as the payload, in
	// the transaction that finishes it, so it is delivered when, and only
	// if, that transaction commits. Waiters (a client holding a request
	// open until its saga ends, a benchmark) LISTEN on it; see
	// ListenFinished. Each notification adds a little to the finishing
	// commit, so it is off by default. Default: "" (none).
	FinishedChannel string
	// Logger. Default: slog.Default().
	Logger *slog.Logger
}

// engine drives saga instances.
type engine struct {
	cfg     engineConfig
	log     *slog.Logger
	retry   transport.RetryPolicy
	metrics *telemetry.Metrics
	trace   *telemetry.Tracing

	mu     sync.RWMutex
	defs   map[string]map[int]*Definition // name → version → definition
	latest map[string]*Definition

	postponed postponements // the sweeper's, of instances it failed on
}

// newEngine validates cfg and returns an engine.
func newEngine(cfg engineConfig) (*engine, error) {
	if cfg.DB == nil || cfg.Transport == nil {
		return nil, errors.New("saga: Config.DB and Config.Transport are required")
	}
	if cfg.SweepInterval == 0 {
		cfg.SweepInterval = time.Second
	}
	if cfg.SweepBatch == 0 {
		cfg.SweepBatch = 100
	}
	if cfg.SweepInterval < 0 || cfg.SweepBatch < 0 {
		return nil, errors.New("saga: SweepInterval and SweepBatch must be positive")
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	retry := cfg.Transport.Config().Retry
	if cfg.Retry != nil {
		retry = *cfg.Retry
	}
	return &engine{cfg: cfg, log: cfg.Logger, retry: retry, metrics: cfg.Transport.Metrics(), trace: cfg.Transport.Tracing(),
		defs: map[string]map[int]*Definition{}, latest: map[string]*Definition{}}, nil
}

// Register adds a definition. Several versions of one saga may be registered:
// new instances start with the highest, running ones continue with theirs.
func (e *engine) Register(d *Definition) error {
	if d == nil || d.start == nil {
		return errors.New("saga: register a definition built with Define")
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.defs[d.Name] == nil {
		e.defs[d.Name] = map[int]*Definition{}
	}
	if _, dup := e.defs[d.Name][d.Version]; dup {
		return fmt.Errorf("saga: %s version %d is already registered", d.Name, d.Version)
	}
	if l := e.latest[d.Name]; l != nil && (l.Trigger != d.Trigger || l.ReplyTopic != d.ReplyTopic) {
		return fmt.Errorf("saga: versions of %s must share the trigger and reply topics", d.Name)
	}
	e.defs[d.Name][d.Version] = d
	if l := e.latest[d.Name]; l == nil || d.Version > l.Version {
		e.latest[d.Name] = d
	}
	return nil
}

// names lists the sagas registered, in no order.
func (e *engine) names() []string {
	e.mu.RLock()
	defer e.mu.RUnlock()
	names := make([]string, 0, len(e.defs))
	for name := range e.defs {
		names = append(names, name)
	}
	return names
}

func (e *engine) definition(name string, version int) (*Definition, bool) {
	e.mu.RLock()
	defer e.mu.RUnlock()
	d, ok := e.defs[name][version]
	return d, ok
}

// unknown is ErrUnknownDefinition for inst, saying which.
func (e *engine) unknown(inst *instance) error {
	if _, ok := e.definition(inst.Type, inst.DefVersion); ok {
		return fmt.Errorf("%w: %s version %d with the steps the instance started with (this process has other steps under that version)",
			ErrUnknownDefinition, inst.Type, inst.DefVersion)
	}
	return fmt.Errorf("%w: %s version %d", ErrUnknownDefinition, inst.Type, inst.DefVersion)
}

// definitionOf is inst's definition, if this process knows it: its
// version, with the step list inst started with (a process whose
// definition of the version has other steps would misread it).
func (e *engine) definitionOf(inst *instance) (*Definition, bool) {
	d, ok := e.definition(inst.Type, inst.DefVersion)
	if !ok || inst.Fingerprint != "" && inst.Fingerprint != d.fingerprint {
		return nil, false
	}
	return d, true
}

// Subscriptions lists what the engine consumes, for Transport.Subscribe:
// the trigger and reply topics of every registered saga, each under the
// consumer group of its handler.
func (e *engine) Subscriptions() []transport.Subscription {
	e.mu.RLock()
	defer e.mu.RUnlock()
	names := make([]string, 0, len(e.latest))
	for name := range e.latest {
		names = append(names, name)
	}
	sort.Strings(names)
	var out []transport.Subscription
	for _, name := range names {
		d := e.latest[name]
		out = append(out,
			transport.Subscription{Topic: d.Trigger, ConsumerGroup: triggerHandler(name)},
			transport.Subscription{Topic: d.ReplyTopic, ConsumerGroup: replyHandler(name)},
			transport.Subscription{Topic: RequestTopic(name), ConsumerGroup: requestHandler(name)})
	}
	return out
}

func triggerHandler(saga string) string { return "saga." + saga + ".trigger" }
func replyHandler(saga string) string   { return "saga." + saga + ".replies" }

// addHandlers subscribes the engine to the trigger and reply topics of every
// registered saga on r. opts add to the handlers' options
// (transport.InProcess, say); their retry policy is the engine's.
func (e *engine) addHandlers(r *transport.Router, opts ...transport.HandlerOption) error {
	e.mu.RLock()
	latest := make([]*Definition, 0, len(e.latest))
	for _, d := range e.latest {
		latest = append(latest, d)
	}
	e.mu.RUnlock()
	for _, d := range latest {
		name := d.Name
		hopts := append([]transport.HandlerOption{transport.WithRetry(e.retry)}, opts...)
		if err := r.AddHandler(triggerHandler(name), d.Trigger, "", func(msg *message.Message) error {
			return e.handleTrigger(name, msg)
		}, hopts...); err != nil {
			return err
		}
		// A batch of replies loads the instances they answer in one
		// statement.
		ropts := append([]transport.HandlerOption{transport.LoadPerBatch(replyLoad)}, hopts...)
		if err := r.AddHandler(replyHandler(name), d.ReplyTopic, "", e.handleReply, ropts...); err != nil {
			return err
		}
		// Operators' requests are queued, never in process: they come from
		// tools, not from this router's attempts.
		if err := r.AddHandler(requestHandler(name), RequestTopic(name), "", e.handleRequest, transport.WithRetry(e.retry)); err != nil {
			return err
		}
	}
	return nil
}

// ID is the instance id of saga name started by key: one instance per key.
func ID(name, key string) uuid.UUID {
	return uuid.NewSHA1(idSpace, []byte(name+"\x00"+key))
}

var idSpace = uuid.MustParse("4f0c2c2e-4a8b-4f4e-9d2a-7067736167a1")

// instance is a saga_instances row being worked on.
type instance struct {
	// lastStep is the step the timeline named last, when listed.
	lastStep      string
	ID            uuid.UUID
	Type          string
	DefVersion    int
	Status        Status
	Data          json.RawMessage
	Step          int
	Phase         Phase
	Attempt       int
	Generation    int
	Version       int
	CorrelationID string
	FailureReason string
	DeadlineAt    *time.Time
	CreatedAt     time.Time
	UpdatedAt     time.Time
	FinishedAt    *time.Time
	// TraceParent is the saga's trace (see decide); "" if none.
	TraceParent string
	// CommandTopic and CommandID name the command in flight (its latest
	// send); "" when none, or for an instance of an earlier release.
	CommandTopic string
	CommandID    string
	// CommandWaiting: the sweeper found the command in flight still
	// waiting in this database when its deadline passed.
	CommandWaiting bool
	// ExpiresAt is the saga's own deadline (Spec.Timeout); nil: none.
	ExpiresAt *time.Time
	// Fingerprint of the step list it started with ("" for an instance
	// of an earlier release).
	Fingerprint string
	// ReplySecret makes the reply tokens of its commands (replyToken);
	// nil for an instance of an earlier release, whose commands carry
	// none.
	ReplySecret []byte

	// readDB is the database's clock when the instance was read, at the
	// local time readLocal (see now); zero for an instance being started,
	// whose times the insert computes on the database's clock.
	readDB, readLocal time.Time
	// startWait is, for an instance being started, how long its first
	// command waits for a reply (see deadline).
	startWait time.Duration

	history  []historyEntry   // to write
	outbox   []pendingCommand // to publish
	finished bool             // reached a terminal state in this reaction
	// told is the status last told (logged and counted): as loaded, ""
	// for an instance being started.
	told Status
}

type historyEntry struct {
	Kind       string
	Step       string
	Phase      Phase
	Attempt    int
	MessageID  string
	Detail     string
	CommandKey string
}

type pendingCommand struct {
	topic  string
	msg    *message.Message
	action bool // a running saga's action: it carries the not-after
}

// handleTrigger starts an instance of saga name from a trigger message, in
// the message's transaction. A second trigger with the same key does
// nothing, and so does a trigger for another saga on the same topic
// (StartTx names the saga it starts; a trigger published otherwise starts
// every saga on its topic).
func (e *engine) handleTrigger(name string, msg *message.Message) error {
	if target := msg.Metadata.Get(metadata.Saga); target != "" && target != name {
		e.log.Debug("trigger for another saga on the same topic; left to it", "saga", name, "for", target, "message_uuid", msg.UUID)
		return nil
	}
	_, err := e.startFrom(name, msg)
	return err
}

// startFrom is handleTrigger, reporting whether it inserted the instance
// (false: one with the key exists already).
func (e *engine) startFrom(name string, msg *message.Message) (started bool, err error) {
	ctx := msg.Context()
	tx, ok := transport.TxFromContext(ctx)
	if !ok {
		return false, errors.New("saga: trigger needs a transaction in the message context")
	}
	e.mu.RLock()
	def := e.latest[name]
	e.mu.RUnlock()
	if def == nil {
		return false, transport.Permanent(fmt.Errorf("%w: %s", ErrUnknownDefinition, name))
	}
	key, data, err := def.start(msg)
	if err != nil {
		return false, transport.Permanent(fmt.Errorf("saga %s: bad trigger %s: %w", name, msg.UUID, err))
	}
	env := steps.EnvelopeOf(msg)
	inst := &instance{
		ID: ID(name, key), Type: name, DefVersion: def.Version, Status: StatusRunning, Data: data,
		Step: -1, Phase: PhaseAction, Version: 1, CorrelationID: env.CorrelationID,
	}
	if inst.CorrelationID == "" {
		inst.CorrelationID = inst.ID.String()
	}
	ctx, span := e.decide(ctx, "start", inst)
	defer func() { e.decided(span, inst, err) }()
	inst.TraceParent = e.trace.TraceParent(ctx)
	inst.Fingerprint = def.fingerprint
	if inst.ReplySecret, err = newReplySecret(); err != nil {
		return false, err
	}
	inst.note("started", -1, def, msg.UUID, "trigger "+key)
	if err := e.advance(inst, def, msg.UUID); err != nil {
		return false, transport.Permanent(err)
	}
	// The saga's own deadline and its first command's are computed by the
	// insert, on the database's clock; the command carries the former as
	// its not-after.
	inserted, err := insertInstance(ctx, tx, inst, def.Timeout, def.steps[inst.Step].deadline)
	if err != nil {
		return false, err
	}
	if !inserted {
		span.SetAttributes(telemetry.AttrOutcome.String("ignored: already started"))
		e.log.Debug("saga already started; trigger ignored", "saga", name, "saga_id", inst.ID, "message_uuid", msg.UUID)
		return false, nil
	}
	for _, c := range inst.outbox {
		if c.action {
			c.msg.Metadata.Set(steps.MetaNotAfter, inst.ExpiresAt.UTC().Format(time.RFC3339Nano))
		}
	}
	return true, e.flush(ctx, tx, inst)
}

// handleReply applies a participant's reply to its instance, in the
// message's transaction: it advances the saga, or starts or continues its
// compensation. A reply that is not for the command in flight (a duplicate,
// a late answer to a re-sent command, an answer after the saga moved on)
// changes nothing. A reply for an unknown saga, or for an instance of a
// definition version this process does not know, is dead-lettered with the
// reason.
func (e *engine) handleReply(msg *message.Message) (err error) {
	ctx := msg.Context()
	tx, ok := transport.TxFromContext(ctx)
	if !ok {
		return errors.New("saga: reply needs a transaction in the message context")
	}
	env := steps.EnvelopeOf(msg)
	id, err := uuid.Parse(env.SagaID)
	if err != nil {
		return transport.Permanent(fmt.Errorf("saga: reply %s names no saga (saga_id %q)", msg.UUID, env.SagaID))
	}
	// Most replies are not for the command in flight (duplicates, replays
	// for re-sent commands, late answers), and change nothing: they are
	// told from a plain read, without the instance's row lock. Taken, that
	// lock is held until the delivery's whole batch commits, and stalls
	// (or deadlocks) the batch of another consumer holding the reply the
	// saga waits for: under load, copies of one reply meet in concurrent
	// batches, and the reply queue backs up behind them. The plain read
	// suffices: the command a reply answers became the command in flight
	// in a transaction committed before the reply existed, and an instance
	// never returns to a command it has moved on from (keys only go
	// forward: step, phase, generation), so a reply not for the command in
	// flight as committed now never will be.
	//
	// A reply to the latest copy of the command in flight (its causation is
	// the instance's command_id) is told in one read that locks the
	// instance only then; any other reply falls back to the plain read.
	inst, def, err := e.replyInstanceByCommand(ctx, tx, id, env.CausationID, msg)
	if err != nil {
		return err
	}
	// An instance the batch loaded, or an earlier reaction of the batch
	// saved, is not locked, but the batch's save is checked: it fails if
	// the instance changed since, and the batch's replies are run again.
	locked := inst != nil
	if !locked {
		if inst, def, err = e.replyInstance(ctx, tx, id, msg, false); err != nil {
			return err
		}
	}
	if inst.mismatch(def) != nil {
		return e.parkMismatched(ctx, tx, id, msg)
	}
	if !locked && inst.forCommandInFlight(def, env.Key) {
		// Lock it and read it again: a concurrent reply may have moved it
		// on meanwhile.
		if inst, def, err = e.replyInstance(ctx, tx, id, msg, true); err != nil {
			return err
		}
		if inst.mismatch(def) != nil {
			return e.parkMismatched(ctx, tx, id, msg)
		}
	}
	ctx, span := e.decide(ctx, "reply", inst)
	defer func() { e.decided(span, inst, err) }()
	span.SetAttributes(telemetry.AttrKey.String(env.Key), telemetry.AttrOutcome.String(env.Outcome))
	if !inst.forCommandInFlight(def, env.Key) {
		span.SetAttributes(telemetry.AttrOutcome.String("ignored: not for the command in flight"))
		e.log.Debug("reply is not for the command in flight; ignored", "saga", inst.Type, "saga_id", id, "key", env.Key, "message_uuid", msg.UUID)
		return nil
	}
	if !inst.tokenMatches(env.Key, env.ReplyToken) {
		span.SetAttributes(telemetry.AttrOutcome.String("refused: forged"))
		return transport.Permanent(fmt.Errorf("%w: reply %s to %s of saga %s", ErrForgedReply, msg.UUID, env.Key, id))
	}
	step := def.steps[inst.Step]
	switch env.Outcome {
	case steps.OutcomeOK:
		inst.note("reply_ok", inst.Step, def, msg.UUID, env.Type)
		if inst.Phase == PhaseAction {
			if step.action.onReply != nil {
				data, err := step.action.onReply(inst.Data, msg)
				if err != nil {
					return transport.Permanent(fmt.Errorf("saga %s: step %s: reading reply %s: %w", id, step.name, msg.UUID, err))
				}
				inst.Data = data
			}
			err = e.advance(inst, def, msg.UUID)
		} else {
			err = e.compensate(inst, def, inst.Step, msg.UUID)
		}
	case steps.OutcomeFailed:
		inst.note("reply_failed", inst.Step, def, msg.UUID, env.Reason)
		switch {
		case inst.Phase == PhaseAction && env.Refusal == steps.RefusalExpired:
			// Refused unrun, past its not-after; an earlier run may have
			// acted on its own before it died, so this step is compensated
			// too, as when the engine gives up on it.
			inst.FailureReason = step.name + ": " + env.Reason
			err = e.compensate(inst, def, inst.Step+1, msg.UUID)
		case inst.Phase == PhaseAction:
			inst.FailureReason = step.name + ": " + env.Reason
			err = e.compensate(inst, def, inst.Step, msg.UUID)
		default:
			e.park(inst, def, fmt.Sprintf("compensation of %s failed: %s", step.name, env.Reason))
		}
	default:
		return transport.Permanent(fmt.Errorf("saga %s: reply %s has no outcome", id, msg.UUID))
	}
	if err != nil {
		return transport.Permanent(err)
	}
	return e.save(ctx, tx, inst)
}

// parkMismatched parks instance id, which its definition cannot read, in
// the transaction of reply msg, which it consumes: nothing it could do
// with the reply would be right.
func (e *engine) parkMismatched(ctx context.Context, tx delivery.DBTX, id uuid.UUID, msg *message.Message) (err error) {
	inst, def, err := e.replyInstance(ctx, tx, id, msg, true)
	if err != nil {
		return err
	}
	ctx, span := e.decide(ctx, "reply", inst)
	defer func() { e.decided(span, inst, err) }()
	m := inst.mismatch(def)
	if m == nil {
		return errors.New("saga: the instance changed meanwhile; trying the reply again") // transient
	}
	if inst.Status.Terminal() {
		return nil
	}
	span.SetAttributes(telemetry.AttrOutcome.String("parked: its definition cannot read it"))
	e.park(inst, def, mismatchReason(m))
	return e.save(ctx, tx, inst)
}

// replyInstance loads the instance reply msg is for, locking it if lock,
// and its definition.
func (e *engine) replyInstance(ctx context.Context, tx delivery.DBTX, id uuid.UUID, msg *message.Message, lock bool) (*instance, *Definition, error) {
	inst, err := loadInstance(ctx, tx, id, lock)
	if errors.Is(err, ErrNoSuchSaga) {
		return nil, nil, transport.Permanent(fmt.Errorf("saga: reply %s for unknown saga %s", msg.UUID, id))
	}
	if err != nil {
		return nil, nil, err
	}
	return e.withDefinition(inst, msg)
}

// replyInstanceByCommand loads and locks the instance reply msg is for,
// with its definition, if its command in flight is the message command
// (the reply's causation); nil if it is not (or there is no such
// instance, or no command named). An instance the batch loaded for the
// reply (see instanceLoad) is taken unlocked instead.
func (e *engine) replyInstanceByCommand(ctx context.Context, tx delivery.DBTX, id uuid.UUID, command string, msg *message.Message) (*instance, *Definition, error) {
	if command == "" {
		return nil, nil, nil
	}
	inst := preloadedInstance(tx, id, command)
	var err error
	if inst == nil {
		inst, err = loadInstanceForCommand(ctx, tx, id, command)
	}
	if errors.Is(err, ErrNoSuchSaga) {
		return nil, nil, nil
	}
	if err != nil {
		return nil, nil, err
	}
	return e.withDefinition(inst, msg)
}

// withDefinition returns inst with its definition. A reply msg for an
// instance of a definition this process does not know (another release's,
// during a rolling deploy) is handed back untouched, no attempt counted,
// for a process of its consumer group that knows it.
func (e *engine) withDefinition(inst *instance, msg *message.Message) (*instance, *Definition, error) {
	def, ok := e.definitionOf(inst)
	if !ok {
		return nil, nil, transport.HandBack(fmt.Errorf("reply %s for saga %s: %w", msg.UUID, inst.ID, e.unknown(inst)))
	}
	return inst, def, nil
}

// forCommandInFlight reports whether key is the key of the instance's
// command in flight.
func (inst *instance) forCommandInFlight(def *Definition, key string) bool {
	return !inst.Status.Terminal() && inst.Step >= 0 && key == inst.key(def)
}

// key is the idempotency key of the instance's in-flight command.
func (inst *instance) key(def *Definition) string {
	return CommandKey(inst.ID, def.steps[inst.Step].name, inst.Phase, inst.Generation)
}

// replyToken is the token the command of key carries and its reply must
// carry back: an HMAC of the key under the instance's secret, so that it
// is the same for every copy of one command (a replayed reply carries the
// first's) and cannot be guessed from the key. "" for an instance without
// a secret (started by an earlier release).
func (inst *instance) replyToken(key string) string {
	if len(inst.ReplySecret) == 0 {
		return ""
	}
	mac := hmac.New(sha256.New, inst.ReplySecret)
	mac.Write([]byte(key))
	return hex.EncodeToString(mac.Sum(nil)[:16])
}

// tokenMatches reports whether token is the reply token of the
// instance's command key (in constant time); any token does for an
// instance without a secret.
func (inst *instance) tokenMatches(key, token string) bool {
	want := inst.replyToken(key)
	return want == "" || hmac.Equal([]byte(want), []byte(token))
}

// newReplySecret makes an instance's reply secret.
func newReplySecret() ([]byte, error) {
	b := make([]byte, 32)
	if _, err := rand.Read(b); err != nil {
		return nil, fmt.Errorf("saga: making a reply secret: %w", err)
	}
	return b, nil
}

// now is the database's time now for an instance that was read: its
// clock then, plus what has elapsed since on this process's monotonic
// clock. Every deadline and timeout the engine sets or checks is on it,
// never the worker's wall clock.
func (inst *instance) now() time.Time { return inst.readDB.Add(time.Since(inst.readLocal)) }

// CommandKey is the idempotency key of a saga's command: derived from the
// saga, the step and the phase, never from the attempt. An operator retry
// (generation > 0) gets a fresh key, so a command whose failure was stored
// can be sent again.
func CommandKey(id uuid.UUID, step string, phase Phase, generation int) string {
	k := id.String() + ":" + step + ":" + string(phase)
	if generation > 0 {
		k += "#" + strconv.Itoa(generation)
	}
	return k
}

// advance moves past the current step to the next one with an action and
// sends it, or completes the saga.
func (e *engine) advance(inst *instance, def *Definition, cause string) error {
	for i := inst.Step + 1; i < len(def.steps); i++ {
		if def.steps[i].action == nil {
			continue // done by the trigger
		}
		inst.Step, inst.Phase, inst.Attempt = i, PhaseAction, 0
		return e.send(inst, def, cause)
	}
	e.finish(inst, StatusCompleted, "")
	inst.note("completed", -1, def, cause, "")
	return nil
}

// compensate undoes the steps before step `from`, last first: it sends the
// next compensation, or ends the saga compensated.
func (e *engine) compensate(inst *instance, def *Definition, from int, cause string) error {
	inst.Status = StatusCompensating
	for i := from - 1; i >= 0; i-- {
		if def.steps[i].compensation == nil {
			continue
		}
		inst.Step, inst.Phase, inst.Attempt = i, PhaseCompensation, 0
		return e.send(inst, def, cause)
	}
	e.finish(inst, StatusCompensated, "")
	inst.note("compensated", -1, def, cause, inst.FailureReason)
	return nil
}

// park ends the saga as failed: a compensation could not be done. The
// reason follows the original failure's, after parkSeparator.
func (e *engine) park(inst *instance, def *Definition, reason string) {
	if inst.FailureReason != "" {
		reason = inst.FailureReason + parkSeparator + reason
	}
	e.finish(inst, StatusFailed, reason)
	inst.note("failed", inst.Step, def, "", reason)
}

const parkSeparator = "; then "

func (e *engine) finish(inst *instance, status Status, reason string) {
	inst.Status = status
	if reason != "" {
		inst.FailureReason = reason
	}
	inst.DeadlineAt = nil
	inst.CommandTopic, inst.CommandID, inst.CommandWaiting = "", "", false
	now := inst.now()
	inst.FinishedAt = &now
	inst.finished = true
}

// send queues the in-flight command (again, on a re-send) and sets its
// deadline.
func (e *engine) send(inst *instance, def *Definition, cause string) error {
	step := def.steps[inst.Step]
	cmd := step.action
	if inst.Phase == PhaseCompensation {
		cmd = step.compensation
	}
	payload, err := cmd.build(inst.Data)
	if err != nil {
		return fmt.Errorf("%w: saga %s: step %s: building its %s: %w", errBadCommand, inst.ID, step.name, inst.Phase, err)
	}
	inst.Attempt++
	key := inst.key(def)
	env := steps.Envelope{
		ID:            uuid.NewSHA1(idSpace, []byte(key+"#attempt"+strconv.Itoa(inst.Attempt))).String(),
		CorrelationID: inst.CorrelationID,
		CausationID:   cause,
		SagaID:        inst.ID.String(),
		Step:          step.name,
		Key:           key,
		ReplyTo:       def.ReplyTopic,
		ReplyToken:    inst.replyToken(key),
	}
	action := inst.Status == StatusRunning && inst.Phase == PhaseAction
	if action && inst.ExpiresAt != nil {
		// Past the saga's own deadline the participant refuses it.
		env.NotAfter = *inst.ExpiresAt
	}
	msg, err := steps.NewMessage(payload, env)
	if err != nil {
		return err
	}
	inst.outbox = append(inst.outbox, pendingCommand{topic: cmd.topic, msg: msg, action: action})
	inst.CommandTopic, inst.CommandID, inst.CommandWaiting = cmd.topic, msg.UUID, false
	inst.DeadlineAt = inst.deadline(step, step.wait(inst.Phase, inst.Attempt))
	kind := "sent"
	if inst.Attempt > 1 {
		kind = "resent"
	}
	inst.note(kind, inst.Step, def, msg.UUID, payload.MessageType())
	return nil
}

// deadline is when the command in flight of step, sent or found departed
// now, is overdue: after wait, or when the engine gives up waiting for an
// action's answer (giveUpAt), whichever comes first. For an instance being
// started it is nil: the insert computes it, on the database's clock.
func (inst *instance) deadline(step stepDef, wait time.Duration) *time.Time {
	if inst.readDB.IsZero() {
		inst.startWait = wait
		return nil
	}
	d := inst.now().Add(wait)
	if at, ok := inst.giveUpAt(step); ok && at.Before(d) {
		d = at
	}
	return &d
}

// giveUpAt is, for a running saga's action in flight, when the engine
// stops waiting for its answer and compensates: a deadline of the step
// after the command's not-after (the saga's own deadline, ExpiresAt),
// past which the participant refuses it, so that one it took just before
// has time to answer. false for a compensation, which must happen, and for
// an instance of an earlier release, which has no not-after.
func (inst *instance) giveUpAt(step stepDef) (time.Time, bool) {
	if inst.Status != StatusRunning || inst.Phase != PhaseAction || inst.ExpiresAt == nil {
		return time.Time{}, false
	}
	return inst.ExpiresAt.Add(step.deadline), true
}

func (inst *instance) note(kind string, step int, def *Definition, msgID, detail string) {
	h := historyEntry{Kind: kind, MessageID: msgID, Detail: detail}
	if step >= 0 {
		h.Step, h.Phase, h.Attempt = stepName(def, step), inst.Phase, inst.Attempt
		h.CommandKey = CommandKey(inst.ID, h.Step, inst.Phase, inst.Generation)
	}
	inst.history = append(inst.history, h)
}

// stepName names step i of def, or "#i" if def has no such step.
func stepName(def *Definition, i int) string {
	if i >= 0 && i < len(def.steps) {
		return def.steps[i].name
	}
	return "#" + strconv.Itoa(i)
}

// mismatchReason is the failure reason of an instance parked for m.
func mismatchReason(m error) string {
	return "its definition cannot read it: " + strings.TrimPrefix(m.Error(), ErrDefinitionMismatch.Error()+": ")
}

// mismatch says why def cannot drive inst, nil if it can: its step must
// exist, and, unless inst is completed or compensated, hold the command
// of its phase.
func (inst *instance) mismatch(def *Definition) error {
	bad := func(format string, args ...any) error {
		return fmt.Errorf("%w: %s version %d %s", ErrDefinitionMismatch, def.Name, def.Version, fmt.Sprintf(format, args...))
	}
	if inst.Phase != PhaseAction && inst.Phase != PhaseCompensation {
		return bad("has no phase %q", string(inst.Phase))
	}
	if inst.Status == StatusCompleted || inst.Status == StatusCompensated {
		return nil
	}
	n := len(def.steps)
	if inst.Step < 0 || inst.Step >= n {
		return bad("has %d steps; the instance is at step %d", n, inst.Step)
	}
	s := def.steps[inst.Step]
	if inst.Phase == PhaseAction && s.action == nil {
		return bad("has no action at step %d (%s); the instance waits for one", inst.Step, s.name)
	}
	if inst.Phase == PhaseCompensation && s.compensation == nil {
		return bad("has no compensation at step %d (%s); the instance waits for one", inst.Step, s.name)
	}
	return nil
}

// save writes an existing instance's new state, its timeline and its
// commands in tx.
func (e *engine) save(ctx context.Context, tx delivery.DBTX, inst *instance) error {
	if err := updateInstance(ctx, tx, inst); err != nil {
		return err
	}
	return e.flush(ctx, tx, inst)
}

// flush writes the queued timeline entries and publishes the queued
// commands in tx.
func (e *engine) flush(ctx context.Context, tx delivery.DBTX, inst *instance) error {
	if err := appendHistory(ctx, tx, inst.ID, inst.history); err != nil {
		return err
	}
	told := e.tell(ctx, inst)
	inst.history = nil
	pub := e.cfg.Transport.Publisher(tx)
	for _, c := range inst.outbox {
		c.msg.SetContext(ctx) // its publish is a child of the decision's span
		if err := pub.Publish(c.topic, c.msg); err != nil {
			return fmt.Errorf("saga %s: sending %s: %w", inst.ID, c.topic, err)
		}
	}
	inst.outbox = nil
	if inst.finished && e.cfg.FinishedChannel != "" {
		if err := dbtx.WriteBatched(ctx, tx, notifyWrite, []any{e.cfg.FinishedChannel, inst.ID.String()}); err != nil {
			return fmt.Errorf("saga %s: notifying %s: %w", inst.ID, e.cfg.FinishedChannel, err)
		}
		inst.finished = false
	}
	if told != nil {
		afterCommit(tx, told)
	}
	return nil
}

// tell returns what logs and counts what a reaction did to inst, to run
// once its transaction commits (nil: nothing to tell): its change of
// status (one Info line each, pgsaga_sagas_started_total and
// pgsaga_sagas_finished_total) and the commands it sent again
// (pgsaga_saga_commands_resent_total). Call it before the reaction's
// timeline is written.
func (e *engine) tell(ctx context.Context, inst *instance) func() {
	from, to := inst.told, inst.Status
	var resent []string
	for _, h := range inst.history {
		if h.Kind == "resent" || h.Kind == "retried" {
			resent = append(resent, h.Step)
		}
	}
	if from == to && len(resent) == 0 {
		return nil
	}
	inst.told = to
	step := ""
	if def, ok := e.definitionOf(inst); ok && inst.Step >= 0 && inst.Step < len(def.steps) {
		step = def.steps[inst.Step].name
	}
	name, id, phase, reason := inst.Type, inst.ID, inst.Phase, inst.FailureReason
	took := inst.now().Sub(inst.CreatedAt) // the database's clock, both
	ids := telemetry.LogIDs(ctx)           // the reaction's span
	return func() {
		m := e.metrics
		for _, st := range resent {
			m.CommandResent(name, st)
		}
		if from == to {
			return
		}
		attrs := []any{"saga", name, "saga_id", id, "status", to}
		if from != "" {
			attrs = append(attrs, "from", from)
		}
		if step != "" && !to.Terminal() {
			attrs = append(attrs, "step", step, "phase", phase)
		}
		if reason != "" && to != StatusCompleted && to != StatusRunning {
			attrs = append(attrs, "reason", reason)
		}
		attrs = append(attrs, ids...)
		if from == "" {
			m.SagaStarted(name)
			e.log.Info("saga started", attrs...)
		}
		if to.Terminal() {
			m.SagaFinished(name, string(to), took)
		}
		if from != "" || to.Terminal() {
			e.log.Info("saga "+string(to), attrs...)
		}
	}
}

// heldTx is a transaction the engine opened itself (an operator's retry or
// cancel, a sweep): what its work is to tell (see tell) waits for its
// commit.
type heldTx struct {
	delivery.DBTX
	hooks []func()
}

// commit commits tx, the transaction under h, and tells.
func (h *heldTx) commit(tx *sql.Tx) error {
	if err := tx.Commit(); err != nil {
		return err
	}
	for _, f := range h.hooks {
		f()
	}
	h.hooks = nil
	return nil
}

// afterCommit runs fn once tx commits: a delivery attempt's transaction
// (transport.OnCommit) or one the engine holds (heldTx). In a caller's
// transaction, whose commit the engine cannot see, fn runs at once.
func afterCommit(tx delivery.DBTX, fn func()) {
	if transport.OnCommit(tx, fn) {
		return
	}
	if h, ok := tx.(*heldTx); ok {
		h.hooks = append(h.hooks, fn)
		return
	}
	fn()
}

// decide starts the span of an engine decision about inst ("start",
// "reply", "deadline", "retry", "cancel"), whose commands are published as
// its children. It is a child of ctx's span (the delivery of the trigger
// or reply) when there is one; otherwise, and for decisions no message of
// the saga led to (the sweeper's, an operator's, whose request is then a
// link), a child of the saga's trace as stored with the instance, so that
// one saga is one trace.
func (e *engine) decide(ctx context.Context, decision string, inst *instance) (context.Context, trace.Span) {
	var opts []trace.SpanStartOption
	own := decision != "start" && decision != "reply"
	if parent := trace.SpanContextFromContext(ctx); inst.TraceParent != "" && (own || !parent.IsValid()) {
		if parent.IsValid() {
			opts = append(opts, trace.WithLinks(trace.Link{SpanContext: parent}))
		}
		ctx = e.trace.ContextWithRemote(trace.ContextWithSpanContext(ctx, trace.SpanContext{}), inst.TraceParent, "")
	}
	opts = append(opts, trace.WithAttributes(telemetry.AttrSaga.String(inst.Type), telemetry.AttrSagaID.String(inst.ID.String()),
		telemetry.AttrDecision.String(decision), telemetry.AttrFrom.String(string(inst.Status))))
	return e.trace.Tracer().Start(ctx, "saga "+decision+" "+inst.Type, opts...)
}

// decided ends a decision's span with the state it left inst in.
func (e *engine) decided(span trace.Span, inst *instance, err error) {
	attrs := []attribute.KeyValue{telemetry.AttrStatus.String(string(inst.Status))}
	if inst.Step >= 0 {
		if def, ok := e.definitionOf(inst); ok && inst.Step < len(def.steps) {
			attrs = append(attrs, telemetry.AttrStep.String(def.steps[inst.Step].name), attribute.String("pgsaga.phase", string(inst.Phase)))
		}
	}
	span.SetAttributes(attrs...)
	telemetry.End(span, err)
}
