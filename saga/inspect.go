package saga

import (
	"context"
	"database/sql"
	"encoding/json"
	"fmt"
	"strings"
	"time"

	"github.com/google/uuid"
)

// Instance is a saga instance as operators see it.
type Instance struct {
	ID                uuid.UUID
	Type              string
	DefinitionVersion int
	Status            Status
	Data              json.RawMessage
	// Step is the step whose command is in flight (or was last), "" before
	// the first; Phase says whether its action or its compensation.
	Step          string
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
	// History is the timeline, oldest first (filled by Get).
	History []HistoryEntry
}

// HistoryEntry is one event of an instance's timeline.
type HistoryEntry struct {
	Seq       int
	At        time.Time
	Kind      string // started, sent, resent, deadline, reply_ok, reply_failed, gave_up, completed, compensated, failed, retried
	Step      string
	Phase     Phase
	Attempt   int
	MessageID string
	Detail    string
}

func (e *Engine) public(inst *instance) Instance {
	out := Instance{
		ID: inst.ID, Type: inst.Type, DefinitionVersion: inst.DefVersion, Status: inst.Status, Data: inst.Data,
		Phase: inst.Phase, Attempt: inst.Attempt, Generation: inst.Generation, Version: inst.Version,
		CorrelationID: inst.CorrelationID, FailureReason: inst.FailureReason, DeadlineAt: inst.DeadlineAt,
		CreatedAt: inst.CreatedAt, UpdatedAt: inst.UpdatedAt, FinishedAt: inst.FinishedAt,
	}
	if def, ok := e.definition(inst.Type, inst.DefVersion); ok && inst.Step >= 0 && inst.Step < len(def.steps) {
		out.Step = def.steps[inst.Step].name
	} else if inst.Step >= 0 {
		out.Step = fmt.Sprintf("#%d", inst.Step)
	}
	return out
}

// Get returns an instance with its timeline.
func (e *Engine) Get(ctx context.Context, id uuid.UUID) (Instance, error) {
	inst, err := loadInstance(ctx, e.cfg.DB, id, false)
	if err != nil {
		return Instance{}, err
	}
	out := e.public(inst)
	rows, err := e.cfg.DB.QueryContext(ctx, historySQL, id)
	if err != nil {
		return Instance{}, fmt.Errorf("saga %s: reading its timeline: %w", id, err)
	}
	defer rows.Close()
	for rows.Next() {
		var h HistoryEntry
		var phase string
		if err := rows.Scan(&h.Seq, &h.At, &h.Kind, &h.Step, &phase, &h.Attempt, &h.MessageID, &h.Detail); err != nil {
			return Instance{}, fmt.Errorf("saga %s: reading its timeline: %w", id, err)
		}
		h.Phase = Phase(phase)
		out.History = append(out.History, h)
	}
	return out, rows.Err()
}

// Filter selects instances for List.
type Filter struct {
	// Statuses to include; none means all.
	Statuses []Status
	// Type of saga; "" means all.
	Type string
	// OlderThan keeps instances not updated for at least this long.
	OlderThan time.Duration
	// Limit of instances returned. Default: 100.
	Limit int
}

// List returns instances by status and age, least recently updated first.
func (e *Engine) List(ctx context.Context, f Filter) ([]Instance, error) {
	if f.Limit <= 0 {
		f.Limit = 100
	}
	var statuses any
	if len(f.Statuses) > 0 {
		s := make([]string, len(f.Statuses))
		for i, st := range f.Statuses {
			s[i] = string(st)
		}
		statuses = s
	}
	rows, err := e.cfg.DB.QueryContext(ctx, listSQL, statuses, f.Type, time.Now().Add(-f.OlderThan), f.Limit)
	if err != nil {
		return nil, fmt.Errorf("saga: listing instances: %w", err)
	}
	defer rows.Close()
	var out []Instance
	for rows.Next() {
		inst, err := scanInstance(rows)
		if err != nil {
			return nil, fmt.Errorf("saga: listing instances: %w", err)
		}
		out = append(out, e.public(inst))
	}
	return out, rows.Err()
}

// Counts returns how many instances each saga type has in each status.
func (e *Engine) Counts(ctx context.Context) (map[string]map[Status]int, error) {
	rows, err := e.cfg.DB.QueryContext(ctx, countsSQL)
	if err != nil {
		return nil, fmt.Errorf("saga: counting instances: %w", err)
	}
	defer rows.Close()
	out := map[string]map[Status]int{}
	for rows.Next() {
		var typ, status string
		var n int
		if err := rows.Scan(&typ, &status, &n); err != nil {
			return nil, err
		}
		if out[typ] == nil {
			out[typ] = map[Status]int{}
		}
		out[typ][Status(status)] = n
	}
	return out, rows.Err()
}

// UnknownDefinition counts running instances of a definition version this
// process does not know.
type UnknownDefinition struct {
	Name      string
	Version   int
	Instances int
}

// UnknownDefinitions reports running instances whose definition version
// this process does not know: they are not driven (a reply for them is
// dead-lettered with the reason) until a process that knows it runs.
func (e *Engine) UnknownDefinitions(ctx context.Context) ([]UnknownDefinition, error) {
	rows, err := e.cfg.DB.QueryContext(ctx, activeDefinitionsSQL)
	if err != nil {
		return nil, fmt.Errorf("saga: reading definitions in use: %w", err)
	}
	defer rows.Close()
	var out []UnknownDefinition
	for rows.Next() {
		var u UnknownDefinition
		if err := rows.Scan(&u.Name, &u.Version, &u.Instances); err != nil {
			return nil, err
		}
		if _, ok := e.definition(u.Name, u.Version); !ok {
			out = append(out, u)
		}
	}
	return out, rows.Err()
}

// Retry gets a stuck or parked instance moving again:
//
//   - failed (a compensation could not be done): its compensation is sent
//     again under a fresh key (a new generation), so a participant that
//     stored a failure for the old key runs it anew; on success the saga
//     compensates on;
//   - running or compensating: the in-flight command is sent again now, with
//     its key, and its attempts start over.
//
// Completed and compensated instances are ErrNotRetryable.
func (e *Engine) Retry(ctx context.Context, id uuid.UUID) error {
	tx, err := e.cfg.DB.BeginTx(ctx, &sql.TxOptions{Isolation: sql.LevelReadCommitted})
	if err != nil {
		return fmt.Errorf("saga %s: retrying: %w", id, err)
	}
	defer tx.Rollback() //nolint:errcheck // no-op after Commit
	inst, err := loadInstance(ctx, tx, id, true)
	if err != nil {
		return err
	}
	def, ok := e.definition(inst.Type, inst.DefVersion)
	if !ok {
		return fmt.Errorf("%w: %s version %d", ErrUnknownDefinition, inst.Type, inst.DefVersion)
	}
	switch inst.Status {
	case StatusFailed:
		if inst.Phase != PhaseCompensation || inst.Step < 0 {
			return fmt.Errorf("%w: %s failed outside a compensation", ErrNotRetryable, id)
		}
		inst.Status, inst.FinishedAt = StatusCompensating, nil
		inst.Generation++
		inst.FailureReason, _, _ = strings.Cut(inst.FailureReason, parkSeparator)
	case StatusRunning, StatusCompensating:
	default:
		return fmt.Errorf("%w: %s is %s", ErrNotRetryable, id, inst.Status)
	}
	inst.Attempt = 0
	inst.note("retried", inst.Step, def, "", "operator retry")
	if err := e.send(inst, def, ""); err != nil {
		return err
	}
	if err := e.save(ctx, tx, inst); err != nil {
		return err
	}
	if err := tx.Commit(); err != nil {
		return fmt.Errorf("saga %s: retrying: %w", id, err)
	}
	return nil
}
