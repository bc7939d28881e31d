package saga

import (
	"context"
	"database/sql"
	"errors"
	"fmt"

	"github.com/google/uuid"

	"github.com/pgsaga/pgsaga/steps/transport"
)

const instanceColumns = `id, saga_type, definition_version, status, data, current_step, phase, attempt,
generation, version, coalesce(correlation_id, ''), coalesce(failure_reason, ''), deadline_at,
created_at, updated_at, finished_at, coalesce(trace_parent, ''),
coalesce(command_topic, ''), coalesce(command_id, ''), command_waiting, expires_at, coalesce(definition_fingerprint, '')`

const (
	// insertInstanceSQL starts an instance unless one with its id exists.
	insertInstanceSQL = `INSERT INTO saga_instances (id, saga_type, definition_version, status, data,
    current_step, phase, attempt, generation, version, correlation_id, failure_reason, deadline_at, finished_at, trace_parent,
    command_topic, command_id, expires_at, definition_fingerprint)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, nullif($12, ''), $13, $14, nullif($15, ''),
    nullif($16, ''), nullif($17, ''), $18, nullif($19, ''))
ON CONFLICT (id) DO NOTHING`

	// updateInstanceSQL writes an instance's new state if nobody changed it
	// since it was read.
	updateInstanceSQL = `UPDATE saga_instances SET status = $2, data = $3::jsonb, current_step = $4, phase = $5,
    attempt = $6, generation = $7, version = version + 1, failure_reason = nullif($8, ''),
    deadline_at = $9, finished_at = $10, updated_at = clock_timestamp(),
    command_topic = nullif($12, ''), command_id = nullif($13, ''), command_waiting = $14, expires_at = $15
WHERE id = $1::uuid AND version = $11`

	loadInstanceSQL       = `SELECT ` + instanceColumns + ` FROM saga_instances WHERE id = $1`
	loadInstanceLockedSQL = loadInstanceSQL + ` FOR UPDATE`

	// appendHistorySQL appends timeline entries, numbered per instance
	// after the last one; writers hold the instance's row lock.
	appendHistorySQL = `INSERT INTO saga_history (saga_id, seq, kind, step, phase, attempt, message_id, detail, command_key)
SELECT $1::uuid, last.seq + e.ord, e.kind, nullif(e.step, ''), nullif(e.phase, ''), nullif(e.attempt, 0),
    nullif(e.message_id, ''), nullif(e.detail, ''), nullif(e.command_key, '')
FROM (SELECT coalesce(max(seq), 0) AS seq FROM saga_history WHERE saga_id = $1::uuid) AS last,
    unnest($2::text[], $3::text[], $4::text[], $5::int[], $6::text[], $7::text[], $8::text[])
        WITH ORDINALITY AS e(kind, step, phase, attempt, message_id, detail, command_key, ord)`

	// overdueSQL picks one instance whose command is overdue, skipping
	// instances another sweeper or a reply handler holds.
	overdueSQL = `SELECT ` + instanceColumns + ` FROM saga_instances
WHERE status IN ('running', 'compensating') AND deadline_at < clock_timestamp()
  AND saga_type || ':' || definition_version::text = ANY ($1::text[])
  AND (definition_fingerprint IS NULL OR saga_type || ':' || definition_version::text || ':' || definition_fingerprint = ANY ($2::text[]))
ORDER BY deadline_at
LIMIT 1
FOR UPDATE SKIP LOCKED`

	// parkBrokenSQL parks an instance whose command cannot be sent, tells
	// the finished channel ($3) if there is one, and returns 1 if it parked
	// it (0 if it was no longer running or compensating).
	parkBrokenSQL = `WITH parked AS (
    UPDATE saga_instances SET status = 'failed', failure_reason = $2, deadline_at = NULL,
        finished_at = clock_timestamp(), updated_at = clock_timestamp(), version = version + 1
    WHERE id = $1 AND status IN ('running', 'compensating')
    RETURNING id),
timeline AS (
    INSERT INTO saga_history (saga_id, seq, kind, detail)
    SELECT id, coalesce((SELECT max(seq) FROM saga_history WHERE saga_id = $1), 0) + 1, 'failed', $2 FROM parked)
SELECT count(*) FROM parked
    LEFT JOIN LATERAL (SELECT pg_notify($3, parked.id::text) WHERE $3 <> '') AS notified ON true`

	// notifyFinishedSQL tells Config.FinishedChannel's listeners that an
	// instance finished; delivered on commit.
	notifyFinishedSQL = `SELECT pg_notify($1, $2)`

	// pruneHistorySQL deletes up to $2 timeline entries of sagas that
	// completed or compensated more than $1 seconds ago.
	pruneHistorySQL = `DELETE FROM saga_history WHERE (saga_id, seq) IN (
    SELECT h.saga_id, h.seq FROM saga_instances s JOIN saga_history h ON h.saga_id = s.id
    WHERE s.status IN ('completed', 'compensated')
      AND s.finished_at < clock_timestamp() - make_interval(secs => $1)
    LIMIT $2
    FOR UPDATE OF h SKIP LOCKED)`

	// pruneInstancesSQL deletes up to $2 sagas (their timelines cascade)
	// that completed or compensated more than $1 seconds ago.
	pruneInstancesSQL = `DELETE FROM saga_instances WHERE id IN (
    SELECT id FROM saga_instances
    WHERE status IN ('completed', 'compensated')
      AND finished_at < clock_timestamp() - make_interval(secs => $1)
    LIMIT $2
    FOR UPDATE SKIP LOCKED)`

	// postponeSQL moves an instance's deadline a minute on.
	postponeSQL = `UPDATE saga_instances SET deadline_at = clock_timestamp() + interval '1 minute'
WHERE id = $1 AND status IN ('running', 'compensating')`

	historySQL = `SELECT seq, at, kind, coalesce(step, ''), coalesce(phase, ''), coalesce(attempt, 0),
    coalesce(message_id, ''), coalesce(detail, '')
FROM saga_history WHERE saga_id = $1 ORDER BY seq`

	// listSQL lists instances, each with the step its timeline named
	// last (for readers without the definitions).
	listSQL = `SELECT ` + instanceColumns + `,
    coalesce((SELECT h.step FROM saga_history h WHERE h.saga_id = saga_instances.id AND h.step IS NOT NULL ORDER BY h.seq DESC LIMIT 1), '')
` + selectedSQL + `
ORDER BY updated_at, id
LIMIT $4`

	countsSQL = `SELECT saga_type, status, count(*) FROM saga_instances GROUP BY saga_type, status`

	activeDefinitionsSQL = `SELECT saga_type, definition_version, coalesce(definition_fingerprint, ''), count(*) FROM saga_instances
WHERE status IN ('running', 'compensating') GROUP BY 1, 2, 3`
)

func insertInstance(ctx context.Context, tx transport.Tx, inst *instance) (bool, error) {
	res, err := tx.ExecContext(ctx, insertInstanceSQL, inst.ID, inst.Type, inst.DefVersion, string(inst.Status), []byte(inst.Data),
		inst.Step, string(inst.Phase), inst.Attempt, inst.Generation, inst.Version, inst.CorrelationID, inst.FailureReason,
		inst.DeadlineAt, inst.FinishedAt, inst.TraceParent, inst.CommandTopic, inst.CommandID, inst.ExpiresAt, inst.Fingerprint)
	if err != nil {
		return false, fmt.Errorf("saga %s: starting: %w", inst.ID, err)
	}
	n, _ := res.RowsAffected()
	return n == 1, nil
}

// updateInstance writes inst's new state. Every caller holds the
// instance's row lock (it loaded it FOR UPDATE in tx), so inside a delivery
// attempt the statement is queued with the attempt's other writes (see
// transport.Queuer); elsewhere it runs at once and checks the version.
func updateInstance(ctx context.Context, tx transport.Tx, inst *instance) error {
	args := []any{inst.ID.String(), string(inst.Status), string(inst.Data), inst.Step, string(inst.Phase),
		inst.Attempt, inst.Generation, inst.FailureReason, inst.DeadlineAt, inst.FinishedAt, inst.Version,
		inst.CommandTopic, inst.CommandID, inst.CommandWaiting, inst.ExpiresAt}
	if q, ok := tx.(transport.Queuer); ok {
		if err := q.QueueExec("saving saga "+inst.ID.String(), updateInstanceSQL, args...); err != nil {
			return fmt.Errorf("saga %s: saving: %w", inst.ID, err)
		}
		inst.Version++
		return nil
	}
	res, err := tx.ExecContext(ctx, updateInstanceSQL, args...)
	if err != nil {
		return fmt.Errorf("saga %s: saving: %w", inst.ID, err)
	}
	if n, _ := res.RowsAffected(); n != 1 {
		return fmt.Errorf("%w: %s", ErrConcurrentChange, inst.ID)
	}
	inst.Version++
	return nil
}

type scanner interface{ Scan(dest ...any) error }

// scanInstance scans the instanceColumns of row, and more into more.
func scanInstance(row scanner, more ...any) (*instance, error) {
	var (
		inst   instance
		status string
		phase  string
		data   []byte
	)
	err := row.Scan(append([]any{&inst.ID, &inst.Type, &inst.DefVersion, &status, &data, &inst.Step, &phase, &inst.Attempt,
		&inst.Generation, &inst.Version, &inst.CorrelationID, &inst.FailureReason, &inst.DeadlineAt,
		&inst.CreatedAt, &inst.UpdatedAt, &inst.FinishedAt, &inst.TraceParent,
		&inst.CommandTopic, &inst.CommandID, &inst.CommandWaiting, &inst.ExpiresAt, &inst.Fingerprint}, more...)...)
	if err != nil {
		return nil, err
	}
	inst.Status, inst.Phase, inst.Data = Status(status), Phase(phase), data
	inst.told = inst.Status
	return &inst, nil
}

func loadInstance(ctx context.Context, tx transport.Tx, id uuid.UUID, lock bool) (*instance, error) {
	q := loadInstanceSQL
	if lock {
		q = loadInstanceLockedSQL
	}
	inst, err := scanInstance(tx.QueryRowContext(ctx, q, id))
	if errors.Is(err, sql.ErrNoRows) {
		return nil, fmt.Errorf("%w: %s", ErrNotFound, id)
	}
	if err != nil {
		return nil, fmt.Errorf("saga %s: loading: %w", id, err)
	}
	return inst, nil
}

// appendHistory appends entries to the instance's timeline in one
// statement, queued inside a delivery attempt.
func appendHistory(ctx context.Context, tx transport.Tx, id uuid.UUID, entries []historyEntry) error {
	if len(entries) == 0 {
		return nil
	}
	n := len(entries)
	kinds, steps, phases, messages, details, keys := make([]string, n), make([]string, n), make([]string, n), make([]string, n), make([]string, n), make([]string, n)
	attempts := make([]int32, n)
	for i, h := range entries {
		kinds[i], steps[i], phases[i], attempts[i], messages[i], details[i], keys[i] = h.Kind, h.Step, string(h.Phase), int32(h.Attempt), h.MessageID, h.Detail, h.CommandKey
	}
	if err := transport.Queue(ctx, tx, "writing the timeline of saga "+id.String(), appendHistorySQL, id.String(), kinds, steps, phases, attempts, messages, details, keys); err != nil {
		return fmt.Errorf("saga %s: writing its timeline: %w", id, err)
	}
	return nil
}
