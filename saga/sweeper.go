package saga

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/pgsaga/pgsaga/steps/transport"
)

// SweepResult says what one sweep did.
type SweepResult struct {
	// Resent commands whose deadline passed, with the same key.
	Resent int
	// GaveUp on actions whose attempts ran out: their sagas compensate.
	GaveUp int
	// Parked sagas whose compensation got no answer: now failed.
	Parked int
}

// Sweep handles instances whose in-flight command is overdue, each in a
// transaction of its own: it sends the command again with the same key
// until the step's MaxAttempts, then gives up on it (an action: the saga
// compensates; a compensation: the saga is parked as failed). Instances
// locked by another sweeper or a reply are skipped (FOR UPDATE SKIP LOCKED),
// so any number of processes may sweep. Instances of definition versions
// this process does not know are left alone: a process that knows them
// sweeps them (see Register and ErrUnknownDefinition).
func (e *Engine) Sweep(ctx context.Context) (SweepResult, error) {
	var res SweepResult
	known := e.knownDefinitions()
	for range e.cfg.SweepBatch {
		did, err := e.sweepOne(ctx, known, &res)
		if err != nil || !did {
			return res, err
		}
	}
	return res, nil
}

func (e *Engine) knownDefinitions() []string {
	e.mu.RLock()
	defer e.mu.RUnlock()
	var out []string
	for name, vs := range e.defs {
		for v := range vs {
			out = append(out, name+":"+strconv.Itoa(v))
		}
	}
	return out
}

func (e *Engine) sweepOne(ctx context.Context, known []string, res *SweepResult) (bool, error) {
	tx, err := e.cfg.DB.BeginTx(ctx, &sql.TxOptions{Isolation: sql.LevelReadCommitted})
	if err != nil {
		return false, fmt.Errorf("saga: sweeping: %w", err)
	}
	defer tx.Rollback() //nolint:errcheck // no-op after Commit
	// Only instances of known definitions: the rest are reported, never
	// driven by a process that cannot read them.
	inst, err := scanInstance(tx.QueryRowContext(ctx, overdueSQL, known))
	if errors.Is(err, sql.ErrNoRows) {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("saga: sweeping: %w", err)
	}
	def, _ := e.definition(inst.Type, inst.DefVersion)
	step := def.steps[inst.Step]
	ctx, span := e.decide(ctx, "deadline", inst)
	defer func() { e.decided(span, inst, err) }()
	wait, attempts := step.limits(inst.Phase)
	var outcome *int
	switch {
	case inst.Attempt < attempts:
		inst.note("deadline", inst.Step, def, "", fmt.Sprintf("no reply after %s", wait))
		err, outcome = e.send(inst, def, ""), &res.Resent
	case inst.Phase == PhaseAction:
		// The action may or may not have happened: compensate this step too.
		reason := fmt.Sprintf("%s: no reply after %d attempts", step.name, inst.Attempt)
		inst.note("gave_up", inst.Step, def, "", reason)
		inst.FailureReason = reason
		err, outcome = e.compensate(inst, def, inst.Step+1, ""), &res.GaveUp
	default:
		e.park(inst, def, fmt.Sprintf("compensation of %s got no reply after %d attempts", step.name, inst.Attempt))
		outcome = &res.Parked
	}
	held := &heldTx{Tx: tx}
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
		e.setAside(ctx, inst, step.name, err)
		return true, nil
	}
	*outcome++
	e.log.Info("swept overdue saga command", "saga", inst.ID, "step", step.name, "phase", inst.Phase, "status", inst.Status, "attempt", inst.Attempt)
	return true, nil
}

// setAside deals with an instance the sweeper could not handle: one whose
// command cannot be built or sent at all is parked as failed with the cause;
// after any other error (the database, say) its deadline moves a minute on,
// so the sweeper moves on to the others.
func (e *Engine) setAside(ctx context.Context, inst *instance, step string, cause error) {
	if errors.Is(cause, errBadCommand) || errors.Is(cause, transport.ErrInvalidTopic) || transport.IsPermanent(cause) {
		reason := fmt.Sprintf("cannot send the %s of %s: %v", inst.Phase, step, cause)
		var parked int
		if err := e.cfg.DB.QueryRowContext(ctx, parkBrokenSQL, inst.ID, reason, e.cfg.FinishedChannel).Scan(&parked); err != nil {
			e.log.Error("parking a saga the sweeper cannot handle", "saga", inst.ID, "cause", cause, "err", err)
			return
		}
		if parked == 1 {
			e.metrics.SagaFinished(inst.Type, string(StatusFailed))
			e.log.Error("parked a saga whose command cannot be sent", "saga", inst.Type, "saga_id", inst.ID, "status", StatusFailed, "step", step, "cause", cause)
		}
		return
	}
	if _, err := e.cfg.DB.ExecContext(ctx, postponeSQL, inst.ID); err != nil {
		e.log.Error("postponing a saga the sweeper cannot handle", "saga", inst.ID, "cause", cause, "err", err)
		return
	}
	e.log.Error("sweeping a saga failed; trying it again in a minute", "saga", inst.ID, "step", step, "err", cause)
}

// RunSweeper sweeps every Config.SweepInterval until ctx is done, and reports
// instances of definition versions this process does not know.
func (e *Engine) RunSweeper(ctx context.Context) error {
	t := time.NewTicker(e.cfg.SweepInterval)
	defer t.Stop()
	lastReport := time.Time{}
	for {
		if res, err := e.Sweep(ctx); err != nil && ctx.Err() == nil {
			e.log.Error("sweeping sagas", "err", err)
		} else if res != (SweepResult{}) {
			e.log.Info("swept sagas", "resent", res.Resent, "gave_up", res.GaveUp, "parked", res.Parked)
		}
		if time.Since(lastReport) > time.Minute {
			lastReport = time.Now()
			if unknown, err := e.UnknownDefinitions(ctx); err == nil && len(unknown) > 0 {
				for _, u := range unknown {
					e.log.Warn("sagas of a definition version this process does not know; deploy it or they will not move",
						"saga", u.Name, "version", u.Version, "instances", u.Instances)
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
