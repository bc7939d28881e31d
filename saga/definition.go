// Package saga is pgsaga's entry point and orchestrator.
//
// A process uses one Client over its pgx pool. It defines its sagas, adds
// the participant steps it serves, starts sagas in its own transactions and
// runs workers:
//
//	client, err := saga.NewClient(pool, saga.ClientConfig{FinishedChannel: "shop_finished"})
//	_, err = client.Migrate(ctx) // pgsaga's tables
//	reserve := steps.Define("stock.reserve", "stock.reserve", reserveStock) // func(ctx, *steps.Tx, Reserve) (steps.Message, error)
//	release := steps.Define("stock.release", "stock.release", releaseStock)
//	def := saga.MustDefine(saga.Spec[Order]{Name: "order",
//		Trigger: saga.On("shop.orders", func(o Ordered) (string, Order, error) { return o.ID, Order(o), nil }),
//		Steps: []saga.Step[Order]{{Name: "reserve",
//			Action:       saga.Send(reserve, func(o Order) Reserve { return Reserve{ID: o.ID} }),
//			Compensation: saga.Send(release, func(o Order) Release { return Release{ID: o.ID} })}},
//	})
//	err = client.Register(def)
//	err = client.AddSteps(reserve, release)
//	err = client.Start(ctx) // a worker, the deadline sweeper, retention; Stop drains them
//
//	tx, err := pool.Begin(ctx) // yours: the saga starts if, and only if, it commits
//	id, err := client.StartTx(ctx, saga.PgxTx(tx), "order", Ordered{ID: "o-1"})
//	err = tx.Commit(ctx)
//	inst, err := client.WaitFinished(ctx, id)
//
// A saga is a Definition (Define a Spec: a Trigger, On a topic, and
// ordered Steps, each an action and an optional compensation, with a
// deadline and attempts). An action or a compensation is the command sent
// to a participant's step (Send, which takes the topic and the command's
// type from the step: a mismatch does not compile); OnReply reads the
// step's typed reply into the saga's data. Its instances live in
// saga_instances with their timeline in saga_history. Every reaction of
// the engine is one transaction: the instance's update, its timeline, the
// next command (published through the outbox) and the removal of the
// message it reacted to. Commands carry keys derived from the saga and the
// step, never from the attempt, so a re-sent command is deduplicated by
// the participant, and a duplicate or late reply changes nothing. A failed
// step compensates the completed ones in reverse order; the deadline
// sweeper re-sends overdue commands and gives up on them in the end.
// Client.Get, List and Retry inspect and repair instances.
package saga

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"strings"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/pgsaga/pgsaga/internal/transport"
	"github.com/pgsaga/pgsaga/steps"
)

// Spec describes a saga over data of type D.
type Spec[D any] struct {
	// Name is the saga type, e.g. "order-payment". Required.
	Name string
	// Version of the definition, recorded on every instance it starts.
	// Change it when a change to the steps would confuse instances already
	// running; keep registering the old version until they finish.
	// Default: 1.
	Version int
	// Trigger starts instances. Required.
	Trigger Trigger[D]
	// Steps, in order. Required.
	Steps []Step[D]
	// ReplyTopic is where participants answer. Default: "saga.<Name>.replies".
	ReplyTopic string
	// Timeout bounds how long an instance may take to complete its
	// actions, on the database's clock: every action command carries the
	// instance's start plus Timeout as its not-after (steps.MetaNotAfter),
	// past which a participant's step runtime refuses it unrun. The engine
	// gives up on an action only a step's Deadline after that (the step
	// is compensated too: it may have run before), or when the participant
	// refuses it. So an outage of a participant, of the broker or of the
	// database shorter than Timeout delays sagas and gives up on none.
	// Compensations are not bounded by it. An operator's retry of a
	// running instance whose command has left starts it afresh. Default:
	// TimeoutDefault, or, if longer, what the actions allow themselves
	// (the sum of their attempts' waits, see Step.Deadline).
	Timeout time.Duration
}

// TimeoutDefault is Spec.Timeout's default, unless the actions allow
// themselves longer.
const TimeoutDefault = 24 * time.Hour

// Trigger starts an instance from a message, at most once per key: build
// it with On.
type Trigger[D any] struct {
	topic       string
	messageType string
	start       func(msg *message.Message) (key string, data D, err error)
	// keyOf is start's key for a trigger value, before it is encoded.
	keyOf func(trigger steps.Message) (string, error)
}

// On is the trigger of a saga over data D: messages of type T on topic
// (published there, or given to Client.StartTx). start makes the
// instance's key (one instance per key, ever) and initial data from the
// trigger; its error, or a message that does not decode, is permanent:
// StartTx returns it, and a published trigger is dead-lettered. start must
// be a function of the trigger alone (no clock, no random, no side
// effect): StartTx runs it to learn the saga's id, and the engine runs it
// again to start the saga.
func On[T steps.Message, D any](topic string, start func(trigger T) (key string, data D, err error)) Trigger[D] {
	var zero T
	t := Trigger[D]{topic: topic, messageType: zero.MessageType()}
	if start != nil {
		t.start = func(msg *message.Message) (string, D, error) {
			trigger, err := steps.Decode[T](msg)
			if err != nil {
				var none D
				return "", none, err
			}
			return start(trigger)
		}
		t.keyOf = func(m steps.Message) (string, error) {
			trigger, ok := m.(T)
			if !ok {
				return "", fmt.Errorf("the trigger is a %T", m)
			}
			key, _, err := start(trigger)
			return key, err
		}
	}
	return t
}

// Step is one stage of a saga's definition: the command its Action sends
// to a participant's step (a steps.Step, through Send), and the
// Compensation that undoes it. The participant's step is what a service
// serves; this is what the saga runs, in order.
type Step[D any] struct {
	// Name of the step, unique in the saga. Required.
	Name string
	// Action is the command that does the step. Nil means the trigger
	// already did it: the step is complete from the start, and only its
	// compensation matters.
	Action *Command[D]
	// Compensation undoes the step if a later step fails, or if the engine
	// gave up waiting for the action's reply. It must succeed whether or not
	// the action happened (or happens later: fence it). Optional.
	Compensation *Command[D]
	// Deadline is how long to wait for a reply before sending the command
	// again (with the same key), counted from when the command left this
	// database: relayed to a broker, or taken by a consumer group of its
	// topic. A command still waiting here (the broker or every participant
	// down, a backlog) is not overdue; once it leaves, it gets its whole
	// deadline (give or take one deadline: the sweeper looks again a
	// deadline after it found it waiting). Each re-send waits twice as long
	// as the one before, up to 8 deadlines (30s, 60s, 120s, 240s, 240s…),
	// so that a participant catching up on a backlog is not sent a copy of
	// everything it has not answered every deadline. Default: 30s.
	Deadline time.Duration
	// MaxAttempts is how many times a command is sent without an answer
	// (each after it left, see Deadline: with the defaults, 30+60+120s
	// apart). Then an action's command is sent no more (copies would pile
	// up before a participant that is down) and the engine waits for its
	// answer until its not-after (Spec.Timeout) and a Deadline more, and
	// only then gives up: the saga compensates, this step included, since
	// the action may have happened. A compensation that got no answer to
	// its attempts parks the saga as failed, for an operator. Default: 3.
	MaxAttempts int
	// CompensationDeadline and CompensationAttempts apply to the
	// compensation instead: a compensation may have to wait for its action
	// to finish. Defaults: Deadline and MaxAttempts.
	CompensationDeadline time.Duration
	CompensationAttempts int
}

// Command is what a saga step sends a participant: build it with Send,
// which takes the topic and the command's type from the participant's step.
type Command[D any] struct {
	topic   string
	build   func(data D) steps.Message
	onReply func(data *D, reply *message.Message) error
	err     error // what Define refuses it for
}

// Send is the command to step, made from the saga's data by build. The
// command's type is the step's: a saga cannot send a step a command it
// does not handle (it does not compile).
func Send[D any, C steps.Message](step steps.Step[C], build func(data D) C) *Command[D] {
	c := &Command[D]{topic: step.Topic()}
	if build != nil {
		c.build = func(data D) steps.Message { return build(data) }
	}
	return c
}

// OnReply returns c, whose step's successful reply, of type R, updates the
// saga's data with update. A reply of another type, or update's error,
// leaves the saga where it is and dead-letters the reply, with the reason.
func OnReply[D any, R steps.Message](c *Command[D], update func(data *D, reply R) error) *Command[D] {
	switch {
	case c == nil:
		return &Command[D]{err: errors.New("OnReply of no command (Send)")}
	case update == nil:
		c.err = errors.New("OnReply needs its update function")
		return c
	}
	c.onReply = func(data *D, msg *message.Message) error {
		reply, err := steps.Decode[R](msg)
		if err != nil {
			return err
		}
		return update(data, reply)
	}
	return c
}

// Definition is a Spec ready for a Client (Register): build it with Define.
type Definition struct {
	Name       string
	Version    int
	ReplyTopic string
	Trigger    string // the trigger's topic
	Timeout    time.Duration

	fingerprint string // of the step list (Fingerprint)
	triggerType string // the trigger's message type (On)
	// keyOf is the key of a trigger value (On's start), before encoding.
	keyOf func(trigger steps.Message) (string, error)
	start func(msg *message.Message) (key string, data json.RawMessage, err error)
	steps []stepDef
}

type stepDef struct {
	name         string
	action       *commandDef
	compensation *commandDef
	deadline     time.Duration
	maxAttempts  int
	compDeadline time.Duration
	compAttempts int
}

// limits returns the deadline and attempts of the step's command in phase.
func (s stepDef) limits(phase Phase) (time.Duration, int) {
	if phase == PhaseCompensation {
		return s.compDeadline, s.compAttempts
	}
	return s.deadline, s.maxAttempts
}

// maxBackoff bounds how many deadlines a re-send waits for its reply.
const maxBackoff = 8

// wait is how long send attempt (1: the first) of the step's command in
// phase waits for a reply once it left: the deadline, doubled for each
// re-send (at most maxBackoff deadlines), so that a participant catching
// up on a backlog, after an outage say, is not sent a copy of everything
// it has not answered yet every deadline, and given up on as soon.
func (s stepDef) wait(phase Phase, attempt int) time.Duration {
	deadline, _ := s.limits(phase)
	factor := time.Duration(1) << min(max(attempt-1, 0), 3)
	if deadline > math.MaxInt64/factor {
		return math.MaxInt64
	}
	return deadline * min(factor, maxBackoff)
}

type commandDef struct {
	topic   string
	build   func(data json.RawMessage) (steps.Message, error)
	onReply func(data json.RawMessage, reply *message.Message) (json.RawMessage, error)
}

// Define validates spec and builds a Definition.
func Define[D any](spec Spec[D]) (*Definition, error) {
	if spec.Name == "" {
		return nil, errors.New("saga: Spec.Name is required")
	}
	if spec.Version == 0 {
		spec.Version = 1
	}
	if spec.Version < 0 {
		return nil, fmt.Errorf("saga %s: Version must be positive", spec.Name)
	}
	if spec.ReplyTopic == "" {
		spec.ReplyTopic = "saga." + spec.Name + ".replies"
	}
	if spec.Timeout < 0 {
		return nil, fmt.Errorf("saga %s: Timeout must be positive", spec.Name)
	}
	if err := transport.ValidateTopic(spec.ReplyTopic); err != nil {
		return nil, fmt.Errorf("saga %s: reply topic: %w", spec.Name, err)
	}
	if err := transport.ValidateConsumerGroup("saga." + spec.Name + ".replies"); err != nil {
		return nil, fmt.Errorf("saga %s: name: %w", spec.Name, err)
	}
	if spec.Trigger.start == nil {
		return nil, fmt.Errorf("saga %s: the trigger's start function is required (On)", spec.Name)
	}
	if err := transport.ValidateTopic(spec.Trigger.topic); err != nil {
		return nil, fmt.Errorf("saga %s: trigger topic: %w", spec.Name, err)
	}
	if len(spec.Steps) == 0 {
		return nil, fmt.Errorf("saga %s: no steps", spec.Name)
	}
	d := &Definition{Name: spec.Name, Version: spec.Version, ReplyTopic: spec.ReplyTopic, Trigger: spec.Trigger.topic, Timeout: spec.Timeout,
		triggerType: spec.Trigger.messageType, keyOf: spec.Trigger.keyOf}
	d.start = func(msg *message.Message) (string, json.RawMessage, error) {
		key, data, err := spec.Trigger.start(msg)
		if err != nil {
			return "", nil, err
		}
		if err := checkKey(key); err != nil {
			return "", nil, err
		}
		raw, err := json.Marshal(data)
		return key, raw, err
	}
	seen := map[string]bool{}
	actions := 0
	for i, s := range spec.Steps {
		if s.Name == "" || seen[s.Name] {
			return nil, fmt.Errorf("saga %s: step %d needs a unique name", spec.Name, i)
		}
		if err := checkStepName(s.Name); err != nil {
			return nil, fmt.Errorf("saga %s: step %d: %w", spec.Name, i, err)
		}
		seen[s.Name] = true
		if s.Deadline == 0 {
			s.Deadline = 30 * time.Second
		}
		if s.MaxAttempts == 0 {
			s.MaxAttempts = 3
		}
		if s.CompensationDeadline == 0 {
			s.CompensationDeadline = s.Deadline
		}
		if s.CompensationAttempts == 0 {
			s.CompensationAttempts = s.MaxAttempts
		}
		if s.Deadline < 0 || s.MaxAttempts < 1 || s.CompensationDeadline < 0 || s.CompensationAttempts < 1 {
			return nil, fmt.Errorf("saga %s: step %s: deadlines and attempts must be positive", spec.Name, s.Name)
		}
		sd := stepDef{name: s.Name, deadline: s.Deadline, maxAttempts: s.MaxAttempts,
			compDeadline: s.CompensationDeadline, compAttempts: s.CompensationAttempts}
		var err error
		if sd.action, err = compileCommand(s.Action); err != nil {
			return nil, fmt.Errorf("saga %s: step %s: action: %w", spec.Name, s.Name, err)
		}
		if sd.compensation, err = compileCommand(s.Compensation); err != nil {
			return nil, fmt.Errorf("saga %s: step %s: compensation: %w", spec.Name, s.Name, err)
		}
		if sd.action != nil {
			actions++
		}
		d.steps = append(d.steps, sd)
	}
	if actions == 0 {
		return nil, fmt.Errorf("saga %s: no step has an action", spec.Name)
	}
	if d.Timeout == 0 {
		d.Timeout = max(TimeoutDefault, d.actionsAllow())
	}
	d.fingerprint = d.computeFingerprint()
	return d, nil
}

// MaxStepName bounds a step's name, in bytes: it is part of the
// idempotency key of the step's commands (CommandKey), which must fit in
// 255 bytes with the saga's id, the phase and a generation.
const MaxStepName = 128

// checkStepName refuses a step name that would make a command key
// PostgreSQL or a broker cannot carry as it is: empty, longer than
// MaxStepName, not UTF-8, or holding a control character (NUL among
// them). The name is not echoed.
func checkStepName(name string) error {
	if len(name) > MaxStepName || !printable(name) {
		return fmt.Errorf("%w: a step's name must be 1 to %d bytes of UTF-8 without control characters (got %d bytes)", ErrInvalidName, MaxStepName, len(name))
	}
	return nil
}

// checkKey refuses a trigger's key that is empty, not UTF-8 or holds a
// NUL: JSON and PostgreSQL would change it on the way (invalid bytes
// become U+FFFD), and two keys that differ only there would start one
// saga. The key is not echoed.
func checkKey(key string) error {
	switch {
	case key == "":
		return fmt.Errorf("%w: the trigger gave an empty key", ErrInvalidName)
	case !utf8.ValidString(key) || strings.ContainsRune(key, 0):
		return fmt.Errorf("%w: the trigger's key must be UTF-8 without NUL (got %d bytes)", ErrInvalidName, len(key))
	}
	return nil
}

// printable reports whether s is valid UTF-8 without control characters.
func printable(s string) bool {
	if !utf8.ValidString(s) {
		return false
	}
	for _, r := range s {
		if unicode.IsControl(r) {
			return false
		}
	}
	return true
}

// MustDefine is Define that panics, for package-level definitions.
func MustDefine[D any](spec Spec[D]) *Definition {
	d, err := Define(spec)
	if err != nil {
		panic(err)
	}
	return d
}

// actionsAllow is how long the actions' replies may take at most by their
// own deadlines and attempts (saturating, never overflowing).
func (d *Definition) actionsAllow() time.Duration {
	var total time.Duration
	for _, s := range d.steps {
		if s.action == nil {
			continue
		}
		for attempt := 1; attempt <= s.maxAttempts; attempt++ {
			w := s.wait(PhaseAction, attempt)
			if w > math.MaxInt64-total {
				return math.MaxInt64
			}
			total += w
		}
	}
	return total
}

func compileCommand[D any](c *Command[D]) (*commandDef, error) {
	if c == nil {
		return nil, nil
	}
	if c.err != nil {
		return nil, c.err
	}
	if c.build == nil {
		return nil, errors.New("its build function is required (Send)")
	}
	if err := transport.ValidateTopic(c.topic); err != nil {
		return nil, err
	}
	cd := &commandDef{topic: c.topic}
	cd.build = func(raw json.RawMessage) (steps.Message, error) {
		var data D
		if err := json.Unmarshal(raw, &data); err != nil {
			return nil, fmt.Errorf("decoding saga data: %w", err)
		}
		m := c.build(data)
		if m == nil {
			return nil, errors.New("its build function returned no command")
		}
		return m, nil
	}
	if c.onReply != nil {
		cd.onReply = func(raw json.RawMessage, reply *message.Message) (json.RawMessage, error) {
			var data D
			if err := json.Unmarshal(raw, &data); err != nil {
				return nil, fmt.Errorf("decoding saga data: %w", err)
			}
			if err := c.onReply(&data, reply); err != nil {
				return nil, err
			}
			return json.Marshal(data)
		}
	}
	return cd, nil
}

// StepNames lists the definition's steps in order.
func (d *Definition) StepNames() []string {
	out := make([]string, len(d.steps))
	for i, s := range d.steps {
		out[i] = s.name
	}
	return out
}

// CommandTopics lists the topics of the definition's commands (actions and
// compensations).
func (d *Definition) CommandTopics() []string {
	seen := map[string]bool{}
	var out []string
	for _, s := range d.steps {
		for _, c := range []*commandDef{s.action, s.compensation} {
			if c != nil && !seen[c.topic] {
				seen[c.topic] = true
				out = append(out, c.topic)
			}
		}
	}
	return out
}

// Topics lists every topic the definition uses: trigger, replies, commands.
func (d *Definition) Topics() []string {
	seen := map[string]bool{}
	var out []string
	add := func(t string) {
		if !seen[t] {
			seen[t] = true
			out = append(out, t)
		}
	}
	add(d.Trigger)
	add(d.ReplyTopic)
	for _, s := range d.steps {
		for _, c := range []*commandDef{s.action, s.compensation} {
			if c != nil {
				add(c.topic)
			}
		}
	}
	return out
}

// stepShape is how an instance reads a step of its definition: what
// saga_definitions records of each version.
type stepShape struct {
	Name         string `json:"name"`
	Action       bool   `json:"action"`
	Compensation bool   `json:"compensation"`
}

// shape is the definition's step list as instances read it: the steps'
// names, in order, and which have an action and a compensation. An
// instance stores the index of its step and the phase of its command, so
// any change to this list misreads the instances started before it;
// deadlines, attempts and topics may change freely.
func (d *Definition) shape() []stepShape {
	out := make([]stepShape, len(d.steps))
	for i, s := range d.steps {
		out[i] = stepShape{Name: s.name, Action: s.action != nil, Compensation: s.compensation != nil}
	}
	return out
}

// Fingerprint identifies the definition's step list (see shape): two
// definitions with the same fingerprint read every instance alike. An
// instance records the fingerprint it started with, and a process whose
// definition of its version has another leaves it alone.
func (d *Definition) Fingerprint() string { return d.fingerprint }

func (d *Definition) computeFingerprint() string {
	raw, _ := json.Marshal(d.shape())
	sum := sha256.Sum256(raw)
	return hex.EncodeToString(sum[:])
}
