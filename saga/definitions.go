package saga

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"sort"
	"strings"
)

// RecordDefinitions records the step list of every registered definition
// version in saga_definitions the first time it runs on the database, and
// refuses (ErrDefinitionChanged) a version whose steps differ from those
// recorded while instances of it are unfinished. A version with no
// unfinished instance has its new steps recorded. Only the step list
// counts (the steps' names, in order, and which have an action and a
// compensation: Definition.Fingerprint); deadlines, attempts and topics
// may change freely. Client.Setup (so Start) calls it; safe in several
// processes at once.
func (e *engine) RecordDefinitions(ctx context.Context) error {
	e.mu.RLock()
	var defs []*Definition
	for _, vs := range e.defs {
		for _, d := range vs {
			defs = append(defs, d)
		}
	}
	e.mu.RUnlock()
	sort.Slice(defs, func(i, j int) bool {
		return defs[i].Name < defs[j].Name || defs[i].Name == defs[j].Name && defs[i].Version < defs[j].Version
	})
	var errs []error
	for _, d := range defs {
		if err := e.recordDefinition(ctx, d); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

func (e *engine) recordDefinition(ctx context.Context, d *Definition) error {
	shape, _ := json.Marshal(d.shape())
	fp := d.Fingerprint()
	tx, err := e.cfg.DB.BeginTx(ctx, &sql.TxOptions{Isolation: sql.LevelReadCommitted})
	if err != nil {
		return fmt.Errorf("saga %s version %d: recording its steps: %w", d.Name, d.Version, err)
	}
	defer tx.Rollback() //nolint:errcheck // no-op after Commit
	var (
		recordedFP string
		recorded   []byte
		unfinished int
	)
	if _, err = tx.ExecContext(ctx, insertDefinitionSQL, d.Name, d.Version, fp, string(shape)); err == nil {
		err = tx.QueryRowContext(ctx, recordedDefinitionSQL, d.Name, d.Version).Scan(&recordedFP, &recorded, &unfinished)
	}
	if err != nil {
		return fmt.Errorf("saga %s version %d: recording its steps: %w", d.Name, d.Version, err)
	}
	if recordedFP == fp {
		return tx.Commit()
	}
	var was []stepShape
	_ = json.Unmarshal(recorded, &was)
	if unfinished > 0 {
		return fmt.Errorf("%w: %s version %d was started with steps %s and is now defined with %s, and %d of its instances are unfinished; "+
			"give the new steps a new Version and keep registering version %d until they finish",
			ErrDefinitionChanged, d.Name, d.Version, describeSteps(was), describeSteps(d.shape()), unfinished, d.Version)
	}
	if _, err := tx.ExecContext(ctx, rerecordDefinitionSQL, d.Name, d.Version, fp, string(shape)); err != nil {
		return fmt.Errorf("saga %s version %d: recording its steps: %w", d.Name, d.Version, err)
	}
	if err := tx.Commit(); err != nil {
		return fmt.Errorf("saga %s version %d: recording its steps: %w", d.Name, d.Version, err)
	}
	e.log.Info("a saga definition's steps changed; none of its instances was unfinished, so the new steps are recorded",
		"saga", d.Name, "version", d.Version, "was", describeSteps(was), "now", describeSteps(d.shape()))
	return nil
}

// describeSteps writes a step list for people: "[order(-/c) charge(a/c)]".
func describeSteps(steps []stepShape) string {
	parts := make([]string, len(steps))
	for i, s := range steps {
		a, c := "-", "-"
		if s.Action {
			a = "a"
		}
		if s.Compensation {
			c = "c"
		}
		parts[i] = s.Name + "(" + a + "/" + c + ")"
	}
	return "[" + strings.Join(parts, " ") + "]"
}

const (
	// insertDefinitionSQL records the steps ($3 fingerprint, $4 list) of
	// saga $1 version $2 unless recorded.
	insertDefinitionSQL = `INSERT INTO saga_definitions (saga_type, version, fingerprint, steps) VALUES ($1, $2, $3, $4::jsonb)
ON CONFLICT (saga_type, version) DO NOTHING`

	// recordedDefinitionSQL returns the steps recorded for saga $1
	// version $2, locked, and the count of the version's unfinished
	// instances.
	recordedDefinitionSQL = `SELECT fingerprint, steps::text,
    (SELECT count(*) FROM saga_instances WHERE saga_type = $1 AND definition_version = $2
        AND status IN ('running', 'compensating', 'failed'))
FROM saga_definitions WHERE saga_type = $1 AND version = $2
FOR UPDATE`

	rerecordDefinitionSQL = `UPDATE saga_definitions SET fingerprint = $3, steps = $4::jsonb, recorded_at = clock_timestamp()
WHERE saga_type = $1 AND version = $2`
)
