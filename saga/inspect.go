package saga

import (
	"context"
	"database/sql"
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/google/uuid"
	"github.com/pgsaga/pgsaga/saga/delivery"
)

// Instance is a saga instance as operators see it.
type Instance struct {
	ID                uuid.UUID
	Type              string
	DefinitionVersion int
	Status            Status
	// Data is the saga's data, filled by Get; List leaves it nil and
	// says how large it is (DataBytes) and how it begins (DataPreview),
	// so that listing sagas of large data stays cheap.
	Data json.RawMessage
	// DataBytes is the size of Data as JSON text; DataPreview its first
	// DataPreviewChars characters (List only).
	DataBytes   int
	DataPreview string
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
	// ReadAt is the database's clock when the instance was read: ages
	// of its times are ReadAt.Sub(CreatedAt) and the like, on the one
	// clock they were set by, whatever the reader's clock says.
	ReadAt time.Time
}

// DataPreviewChars is how many characters of a saga's data List returns
// (Instance.DataPreview).
const DataPreviewChars = 200 // listSQL's left(data::text, 200)

// HistoryEntry is one event of an instance's timeline.
type HistoryEntry struct {
	Seq       int
	At        time.Time
	Kind      string // started, sent, resent, deadline, waiting, reply_ok, reply_failed, gave_up, timed_out, cancelled, completed, compensated, failed, retried
	Step      string
	Phase     Phase
	Attempt   int
	MessageID string
	Detail    string
}

func (e *engine) public(inst *instance) Instance {
	return publicInstance(inst, func(step int) (string, bool) {
		def, ok := e.definitionOf(inst)
		if !ok || step >= len(def.steps) {
			return inst.lastStep, inst.lastStep != ""
		}
		return def.steps[step].name, true
	})
}

// publicInstance is inst as operators see it; name names its current step
// if it can.
func publicInstance(inst *instance, name func(step int) (string, bool)) Instance {
	out := Instance{
		ID: inst.ID, Type: inst.Type, DefinitionVersion: inst.DefVersion, Status: inst.Status, Data: inst.Data, DataBytes: len(inst.Data),
		Phase: inst.Phase, Attempt: inst.Attempt, Generation: inst.Generation, Version: inst.Version,
		CorrelationID: inst.CorrelationID, FailureReason: inst.FailureReason, DeadlineAt: inst.DeadlineAt,
		CreatedAt: inst.CreatedAt, UpdatedAt: inst.UpdatedAt, FinishedAt: inst.FinishedAt, ReadAt: inst.readDB,
	}
	if inst.Step >= 0 {
		if n, ok := name(inst.Step); ok {
			out.Step = n
		} else {
			out.Step = fmt.Sprintf("#%d", inst.Step)
		}
	}
	return out
}

// Get returns an instance with its timeline (Client.Get).
func (e *engine) Get(ctx context.Context, id uuid.UUID) (Instance, error) {
	inst, err := loadInstance(ctx, e.cfg.DB, id, false)
	if err != nil {
		return Instance{}, err
	}
	timeline, err := withHistory(ctx, e.cfg.DB, Instance{ID: id})
	if err != nil {
		return Instance{}, err
	}
	for _, h := range slices.Backward(timeline.History) {
		if h.Step != "" {
			inst.lastStep = h.Step // its name, if the definition is not known here
			break
		}
	}
	out := e.public(inst)
	out.History = timeline.History
	return out, nil
}

// withHistory adds its timeline to out.
func withHistory(ctx context.Context, db delivery.DBTX, out Instance) (Instance, error) {
	id := out.ID
	rows, err := db.QueryContext(ctx, historySQL, id)
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
	// OlderThan keeps instances not updated for at least this long, by the
	// database's clock.
	OlderThan time.Duration
	// UpdatedBefore, if set, keeps instances last updated at or before it
	// (a time on the database's clock): a cutoff that stays where it is
	// while a tool pages through a selection (see Client.FixFilter).
	UpdatedBefore time.Time
	// Limit of instances returned. Default: 100.
	Limit int
	// After, if set, lists (List only) the instances that come after it
	// in List's order, least recently updated first, then by id: give the
	// last instance of the previous page to read the next.
	After *Instance
}

// List is Client.List.
func (e *engine) List(ctx context.Context, f Filter) ([]Instance, error) {
	return list(ctx, e.cfg.DB, f, e.public)
}

// list lists instances, made public by public (which may use the step the
// timeline named last, lastStep).
func list(ctx context.Context, db *sql.DB, f Filter, public func(*instance) Instance) ([]Instance, error) {
	if f.Limit <= 0 {
		f.Limit = 100
	}
	var afterAt, afterID any // NULL: from the first
	if f.After != nil {
		afterAt, afterID = f.After.UpdatedAt, f.After.ID
	}
	rows, err := db.QueryContext(ctx, listSQL, append(selectArgs(f), f.Limit, afterAt, afterID)...)
	if err != nil {
		return nil, fmt.Errorf("saga: listing instances: %w", err)
	}
	defer rows.Close()
	var out []Instance
	for rows.Next() {
		var (
			lastStep string
			size     int
			preview  string
		)
		inst, err := scanInstance(rows, &lastStep, &size, &preview)
		if err != nil {
			return nil, fmt.Errorf("saga: listing instances: %w", err)
		}
		inst.lastStep = lastStep
		pub := public(inst)
		pub.DataBytes, pub.DataPreview = size, preview
		out = append(out, pub)
	}
	return out, rows.Err()
}

// Counts is Client.Counts.
func (e *engine) Counts(ctx context.Context) (map[string]map[Status]int, error) {
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

// unknownDefinition counts running instances of a definition version this
// process does not know, or knows with other steps than they started
// with (OtherSteps: a definition changed without a new version, in
// another process).
type unknownDefinition struct {
	Name       string
	Version    int
	Instances  int
	OtherSteps bool
}

// UnknownDefinitions reports running instances whose definition version
// this process does not know, or knows with other steps: they are not
// driven (a reply for them is dead-lettered with the reason) until a
// process that knows it runs.
func (e *engine) UnknownDefinitions(ctx context.Context) ([]unknownDefinition, error) {
	rows, err := e.cfg.DB.QueryContext(ctx, activeDefinitionsSQL)
	if err != nil {
		return nil, fmt.Errorf("saga: reading definitions in use: %w", err)
	}
	defer rows.Close()
	var out []unknownDefinition
	for rows.Next() {
		var (
			u  unknownDefinition
			fp string
		)
		if err := rows.Scan(&u.Name, &u.Version, &fp, &u.Instances); err != nil {
			return nil, err
		}
		d, ok := e.definition(u.Name, u.Version)
		if ok && fp != "" && fp != d.fingerprint {
			ok, u.OtherSteps = false, true
		}
		if !ok {
			out = append(out, u)
		}
	}
	return out, rows.Err()
}

// Retry is Client.Retry.
func (e *engine) Retry(ctx context.Context, id uuid.UUID) error {
	return e.inTx(ctx, "retrying "+id.String(), func(tx delivery.DBTX) error { return e.RetryTx(ctx, tx, id) })
}

// inTx runs fn in a READ COMMITTED transaction of its own.
func (e *engine) inTx(ctx context.Context, what string, fn func(tx delivery.DBTX) error) error {
	tx, err := e.cfg.DB.BeginTx(ctx, &sql.TxOptions{Isolation: sql.LevelReadCommitted})
	if err != nil {
		return fmt.Errorf("saga: %s: %w", what, err)
	}
	defer tx.Rollback() //nolint:errcheck // no-op after Commit
	held := &heldTx{DBTX: tx}
	if err := fn(held); err != nil {
		return err
	}
	if err := held.commit(tx); err != nil {
		return fmt.Errorf("saga: %s: %w", what, err)
	}
	return nil
}

// RetryTx is Client.RetryTx.
func (e *engine) RetryTx(ctx context.Context, tx delivery.DBTX, id uuid.UUID) (err error) {
	inst, err := loadInstance(ctx, tx, id, true)
	if err != nil {
		return err
	}
	def, ok := e.definitionOf(inst)
	if !ok {
		return e.unknown(inst)
	}
	if m := inst.mismatch(def); m != nil {
		return fmt.Errorf("%w: %s: %w", ErrNotRetryable, id, m)
	}
	ctx, span := e.decide(ctx, "retry", inst)
	defer func() { e.decided(span, inst, err) }()
	switch inst.Status {
	case StatusFailed:
		if inst.Phase != PhaseCompensation || inst.Step < 0 {
			return fmt.Errorf("%w: %s failed outside a compensation", ErrNotRetryable, id)
		}
		inst.Status, inst.FinishedAt = StatusCompensating, nil
		inst.Generation++
		inst.FailureReason, _, _ = strings.Cut(inst.FailureReason, parkSeparator)
	case StatusRunning, StatusCompensating:
		waiting, err := e.commandWaiting(ctx, tx, inst)
		if err != nil {
			return err
		}
		if waiting {
			// Its command has not left this database: a copy would only
			// queue behind it. Its attempts start over from that send; a
			// running saga's own deadline stays, since the queued copy
			// carries it as its not-after.
			step := def.steps[inst.Step]
			inst.Attempt = 1
			inst.DeadlineAt = inst.deadline(step, step.wait(inst.Phase, inst.Attempt))
			inst.note("retried", inst.Step, def, inst.CommandID, "operator retry; its command has not left this database yet: not sent again")
			return e.save(ctx, tx, inst)
		}
		if inst.Status == StatusRunning {
			// Started afresh: its own deadline too.
			expires := inst.now().Add(def.Timeout)
			inst.ExpiresAt = &expires
		}
	default:
		return fmt.Errorf("%w: %s is %s", ErrNotRetryable, id, inst.Status)
	}
	inst.Attempt = 0
	inst.note("retried", inst.Step, def, "", "operator retry")
	if err := e.send(inst, def, ""); err != nil {
		return err
	}
	return e.save(ctx, tx, inst)
}

// commandWaiting reports whether the command in flight of inst has not
// left this database yet (see transport.Departed).
func (e *engine) commandWaiting(ctx context.Context, tx delivery.DBTX, inst *instance) (bool, error) {
	if inst.CommandID == "" {
		return false, nil
	}
	departed, err := e.cfg.Transport.Departed(ctx, tx, inst.CommandTopic, inst.CommandID)
	if err != nil {
		return false, fmt.Errorf("saga %s: retrying: %w", inst.ID, err)
	}
	return !departed, nil
}

// Cancel is Client.Cancel.
func (e *engine) Cancel(ctx context.Context, id uuid.UUID, reason string) error {
	return e.inTx(ctx, "cancelling "+id.String(), func(tx delivery.DBTX) error { return e.CancelTx(ctx, tx, id, reason) })
}

// CancelTx is Client.CancelTx.
func (e *engine) CancelTx(ctx context.Context, tx delivery.DBTX, id uuid.UUID, reason string) (err error) {
	inst, err := loadInstance(ctx, tx, id, true)
	if err != nil {
		return err
	}
	def, ok := e.definitionOf(inst)
	if !ok {
		return e.unknown(inst)
	}
	if m := inst.mismatch(def); m != nil {
		return fmt.Errorf("%w: %s: %w", ErrNotCancellable, id, m)
	}
	ctx, span := e.decide(ctx, "cancel", inst)
	defer func() { e.decided(span, inst, err) }()
	switch inst.Status {
	case StatusCompensating, StatusCompensated:
		return nil
	case StatusRunning:
	default:
		return fmt.Errorf("%w: %s is %s", ErrNotCancellable, id, inst.Status)
	}
	why := "cancelled by an operator"
	if reason != "" {
		why += ": " + reason
	}
	inst.note("cancelled", inst.Step, def, "", why)
	inst.FailureReason = why
	if err := e.compensate(inst, def, inst.Step+1, ""); err != nil {
		return err
	}
	return e.save(ctx, tx, inst)
}
