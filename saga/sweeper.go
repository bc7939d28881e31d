package saga

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"log/slog"
	"runtime/debug"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/google/uuid"

	"github.com/pgsaga/pgsaga/internal/telemetry"
	"github.com/pgsaga/pgsaga/internal/transport"
	"github.com/pgsaga/pgsaga/saga/delivery"
)

// sweepResult says what one sweep did.
type sweepResult struct {
	// Resent commands whose deadline passed, with the same key.
	Resent int
	// GaveUp on actions whose attempts ran out: their sagas compensate.
	GaveUp int
	// Parked sagas whose compensation got no answer: now failed.
	Parked int
	// Waiting: overdue commands found still waiting in this database (for
	// the relay to a broker, or for every consumer group of their topic);
	// their deadline starts when they leave.
	Waiting int
	// Departed: commands found waiting before that have left since; their
	// deadline started again, no attempt counted.
	Departed int
	// TimedOut sagas whose action in flight got no answer by its
	// not-after (the saga's own deadline, Spec.Timeout) and a deadline of
	// the step more: they gave up on it and compensate.
	TimedOut int
	// Awaiting actions sent as often as their step allows without an
	// answer: no more copies go out, and the engine waits for the answer
	// until their not-after (see TimedOut).
	Awaiting int
	// SetAside instances the sweeper could not handle: parked (a command
	// that cannot be built, an instance its definition cannot read, a
	// decision that panicked) or postponed a minute (the database).
	SetAside int
}

// Sweep handles instances whose in-flight command is overdue, each in a
// transaction of its own. A command that has not left this database yet
// (it is still queued for its consumer group or the relay: the broker or every participant is down, or
// behind) is not overdue: its deadline starts again once it leaves. One
// that left and got no reply is sent again with the same key until the
// step's MaxAttempts, then given up on (an action: the saga compensates; a
// compensation: the saga is parked as failed). A running saga past its own
// deadline (Spec.Timeout) gives up on its action at once. Instances
// locked by another sweeper or a reply are skipped (FOR UPDATE SKIP
// LOCKED), so any number of processes may sweep. Instances of definition
// versions this process does not know are left alone: a process that
// knows them sweeps them (see Register and ErrUnknownDefinition). An
// instance that cannot be handled (see sweepResult.SetAside) never holds
// up the others, and a panic deciding it is its failure alone.
func (e *engine) Sweep(ctx context.Context) (sweepResult, error) {
	var res sweepResult
	known := e.knownDefinitions()
	for range e.cfg.SweepBatch {
		did, err := e.sweepOne(ctx, known, &res)
		if err != nil || !did {
			return res, err
		}
	}
	return res, nil
}

// knownDefinitions lists the definitions this process drives, for
// overdueSQL: "name:version", and "name:version:fingerprint" (instances
// started with another step list are left alone).
type knownDefinitions struct{ versions, fingerprints []string }

func (e *engine) knownDefinitions() knownDefinitions {
	e.mu.RLock()
	defer e.mu.RUnlock()
	var out knownDefinitions
	for name, vs := range e.defs {
		for v, d := range vs {
			out.versions = append(out.versions, name+":"+strconv.Itoa(v))
			out.fingerprints = append(out.fingerprints, name+":"+strconv.Itoa(v)+":"+d.fingerprint)
		}
	}
	return out
}

// errDecisionPanicked: deciding what to do with an overdue instance
// panicked (a command's Build, say); the stack is logged.
var errDecisionPanicked = errors.New("saga: deciding panicked")

func (e *engine) sweepOne(ctx context.Context, known knownDefinitions, res *sweepResult) (bool, error) {
	tx, err := e.cfg.DB.BeginTx(ctx, &sql.TxOptions{Isolation: sql.LevelReadCommitted})
	if err != nil {
		return false, fmt.Errorf("saga: sweeping: %w", err)
	}
	defer tx.Rollback() //nolint:errcheck // no-op after Commit
	// Only instances of known definitions: the rest are reported, never
	// driven by a process that cannot read them.
	inst, err := scanInstance(tx.QueryRowContext(ctx, overdueSQL, known.versions, known.fingerprints))
	if errors.Is(err, sql.ErrNoRows) {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("saga: sweeping: %w", err)
	}
	def, _ := e.definitionOf(inst)
	held := &heldTx{DBTX: tx}
	outcome, what, err := e.overdue(ctx, held, inst, def, res)
	if err == nil {
		err = e.save(ctx, held, inst)
	}
	if err == nil {
		err = held.commit(tx)
	}
	if err != nil {
		// One instance that cannot be handled must not hold up the others.
		_ = tx.Rollback()
		if ctx.Err() != nil {
			return false, err
		}
		e.setAside(ctx, inst, def, err)
		res.SetAside++
		return true, nil
	}
	*outcome++
	e.postponed.done(inst.ID)
	if outcome == &res.Waiting {
		e.log.Debug("a saga command overdue has not left this database yet; its deadline starts when it leaves",
			"saga", inst.Type, "saga_id", inst.ID, "step", stepName(def, inst.Step), "phase", inst.Phase, "message_uuid", inst.CommandID)
		return true, nil
	}
	e.log.Info(what, "saga", inst.Type, "saga_id", inst.ID, "step", stepName(def, inst.Step), "phase", inst.Phase, "status", inst.Status, "attempt", inst.Attempt)
	return true, nil
}

// overdue decides what becomes of inst, whose command's deadline passed,
// and says which result counts it and what to log. A panic is inst's
// failure (errDecisionPanicked), its stack logged.
func (e *engine) overdue(ctx context.Context, tx delivery.DBTX, inst *instance, def *Definition, res *sweepResult) (outcome *int, what string, err error) {
	ctx, span := e.decide(ctx, "deadline", inst)
	defer func() {
		if p := recover(); p != nil {
			e.log.Error("deciding on an overdue saga panicked; parking it", "saga", inst.Type, "saga_id", inst.ID, "panic", p, "stack", string(debug.Stack()))
			err = fmt.Errorf("%w: %s", errDecisionPanicked, transport.PanicValue(p))
		}
		e.decided(span, inst, err)
	}()
	if m := inst.mismatch(def); m != nil {
		return nil, "", m
	}
	step := def.steps[inst.Step]
	_, attempts := step.limits(inst.Phase)
	wait := step.wait(inst.Phase, inst.Attempt)
	giveUp, bounded := inst.giveUpAt(step)
	if bounded && !inst.now().Before(giveUp) {
		// Its not-after passed a deadline ago: the participant refuses it
		// from then on, so it can no longer happen, though it may have.
		// Compensate this step too.
		reason := fmt.Sprintf("%s: no answer by its not-after, the saga's timeout (%s)", step.name, def.Timeout)
		inst.note("timed_out", inst.Step, def, "", reason)
		inst.FailureReason = reason
		return &res.TimedOut, "gave up on a saga past its timeout", e.compensate(inst, def, inst.Step+1, "")
	}
	if inst.CommandID != "" {
		departed, err := e.cfg.Transport.Departed(ctx, tx, inst.CommandTopic, inst.CommandID)
		if err != nil {
			return nil, "", err
		}
		switch {
		case !departed:
			if !inst.CommandWaiting {
				inst.CommandWaiting = true
				inst.note("waiting", inst.Step, def, inst.CommandID,
					"not left this database yet (queued for a broker, or for its consumers); its deadline starts when it leaves")
			}
			inst.DeadlineAt = inst.deadline(step, wait)
			return &res.Waiting, "", nil
		case inst.CommandWaiting:
			// It left within the last deadline: it gets a whole one.
			inst.CommandWaiting = false
			inst.DeadlineAt = inst.deadline(step, wait)
			return &res.Departed, "a saga command that waited has left; its deadline starts now", nil
		}
	}
	switch {
	case inst.Attempt < attempts:
		inst.note("deadline", inst.Step, def, "", fmt.Sprintf("no reply after %s", wait))
		return &res.Resent, "swept overdue saga command", e.send(inst, def, "")
	case bounded:
		// Sent as often as allowed: more copies would only pile up before a
		// participant that is down. Its answer may still come, until its
		// not-after.
		inst.note("awaiting_reply", inst.Step, def, "", fmt.Sprintf(
			"no reply after %d sends; none more: waiting for the answer until its not-after (%s) and a deadline (%s) more",
			inst.Attempt, inst.ExpiresAt.UTC().Format(time.RFC3339), step.deadline))
		inst.DeadlineAt = &giveUp
		return &res.Awaiting, "a saga command sent as often as allowed awaits its answer until its not-after", nil
	case inst.Phase == PhaseAction:
		// The action may or may not have happened: compensate this step too.
		reason := fmt.Sprintf("%s: no reply after %d attempts", step.name, inst.Attempt)
		inst.note("gave_up", inst.Step, def, "", reason)
		inst.FailureReason = reason
		return &res.GaveUp, "swept overdue saga command", e.compensate(inst, def, inst.Step+1, "")
	default:
		e.park(inst, def, fmt.Sprintf("compensation of %s got no reply after %d attempts", step.name, inst.Attempt))
		return &res.Parked, "swept overdue saga command", nil
	}
}

// setAside deals with an instance the sweeper could not handle: one whose
// command cannot be built or sent at all, that its definition cannot read,
// or whose decision panicked is parked as failed with the cause; after any
// other error (the database, say) its deadline moves a minute on, so the
// sweeper moves on to the others.
func (e *engine) setAside(ctx context.Context, inst *instance, def *Definition, cause error) {
	step := stepName(def, inst.Step)
	if errors.Is(cause, errBadCommand) || errors.Is(cause, transport.ErrInvalidTopic) || transport.IsPermanent(cause) ||
		errors.Is(cause, ErrDefinitionMismatch) || errors.Is(cause, errDecisionPanicked) {
		reason := fmt.Sprintf("cannot send the %s of %s: %v", inst.Phase, step, cause)
		switch {
		case errors.Is(cause, ErrDefinitionMismatch):
			reason = mismatchReason(cause)
		case errors.Is(cause, errDecisionPanicked):
			reason = fmt.Sprintf("deciding on the %s of %s panicked: %s", inst.Phase, step, strings.TrimPrefix(cause.Error(), errDecisionPanicked.Error()+": "))
		}
		var parked int
		if err := e.cfg.DB.QueryRowContext(ctx, parkBrokenSQL, inst.ID, reason, e.cfg.FinishedChannel).Scan(&parked); err != nil {
			e.log.Error("parking a saga the sweeper cannot handle", "saga", inst.Type, "saga_id", inst.ID, "cause", cause, "err", err)
			return
		}
		if parked == 1 {
			e.metrics.SagaFinished(inst.Type, string(StatusFailed), inst.now().Sub(inst.CreatedAt))
			e.log.Error("parked a saga the sweeper cannot handle", "saga", inst.Type, "saga_id", inst.ID, "status", StatusFailed, "step", step, "reason", reason)
		}
		return
	}
	wait := e.postponed.next(inst.ID, e.cfg.SweepInterval)
	if _, err := e.cfg.DB.ExecContext(ctx, postponeSQL, inst.ID, wait.Seconds()); err != nil {
		e.log.Error("postponing a saga the sweeper cannot handle", "saga", inst.Type, "saga_id", inst.ID, "cause", cause, "err", err)
		return
	}
	e.log.Warn("sweeping a saga failed; trying it again later", "saga", inst.Type, "saga_id", inst.ID, "step", step, "again_in_ms", telemetry.Millis(wait), "err", cause)
}

// postponements counts, per instance, the sweeps in a row that failed on
// something that may pass (the database, a conflict): each postpones the
// instance twice as long as the one before, from a sweep interval up to a
// minute, so that one transient error costs a moment, not a minute.
type postponements struct {
	mu sync.Mutex
	n  map[uuid.UUID]int
}

// next counts a failed sweep of id and returns how long to postpone it.
func (p *postponements) next(id uuid.UUID, interval time.Duration) time.Duration {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.n == nil {
		p.n = map[uuid.UUID]int{}
	}
	if len(p.n) > 10_000 {
		clear(p.n) // bounded: at worst a backoff starts over
	}
	p.n[id]++
	return min(max(interval, 100*time.Millisecond)<<min(p.n[id]-1, 10), time.Minute)
}

// done forgets id's failures: it was swept.
func (p *postponements) done(id uuid.UUID) {
	p.mu.Lock()
	defer p.mu.Unlock()
	delete(p.n, id)
}

// RunSweeper sweeps every Config.SweepInterval until ctx is done, and reports
// instances of definition versions this process does not know.
func (e *engine) RunSweeper(ctx context.Context) error {
	t := time.NewTicker(e.cfg.SweepInterval)
	defer t.Stop()
	lastReport := time.Time{}
	for {
		if res, err := e.Sweep(ctx); err != nil && ctx.Err() == nil {
			e.log.Error("sweeping sagas", "err", err)
		} else if res != (sweepResult{}) {
			// Commands that only wait (an outage) are found again every
			// deadline: that alone is not news.
			level := slog.LevelInfo
			if res == (sweepResult{Waiting: res.Waiting}) {
				level = slog.LevelDebug
			}
			e.log.Log(ctx, level, "swept sagas", "resent", res.Resent, "gave_up", res.GaveUp, "parked", res.Parked,
				"waiting", res.Waiting, "departed", res.Departed, "awaiting", res.Awaiting, "timed_out", res.TimedOut, "set_aside", res.SetAside)
		}
		if time.Since(lastReport) > time.Minute {
			lastReport = time.Now()
			if unknown, err := e.UnknownDefinitions(ctx); err == nil && len(unknown) > 0 {
				for _, u := range unknown {
					what := "sagas of a definition version this process does not know; deploy it or they will not move"
					if u.OtherSteps {
						what = "sagas started with other steps under a definition version this process knows; deploy the definition they started with or they will not move"
					}
					e.log.Warn(what, "saga", u.Name, "version", u.Version, "instances", u.Instances)
				}
			}
		}
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
	}
}
