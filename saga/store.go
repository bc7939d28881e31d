package saga

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/pgsaga/pgsaga/internal/dbtx"
	"github.com/pgsaga/pgsaga/internal/transport"
	"github.com/pgsaga/pgsaga/saga/delivery"
	"github.com/pgsaga/pgsaga/steps"
)

const instanceColumns = `id, saga_type, definition_version, status, data, current_step, phase, attempt,
generation, version, coalesce(correlation_id, ''), coalesce(failure_reason, ''), deadline_at,
created_at, updated_at, finished_at, coalesce(trace_parent, ''),
coalesce(command_topic, ''), coalesce(command_id, ''), command_waiting, expires_at, coalesce(definition_fingerprint, ''),
reply_secret, clock_timestamp()`

// preloadBytes bounds the data, as stored, that a batch preloads
// (loadInstancesForCommandsSQL): 4 MiB.
const preloadBytes = "4194304"

// listColumns are instanceColumns without the data, which listings do not
// read (see listSQL).
const listColumns = `id, saga_type, definition_version, status, NULL::jsonb, current_step, phase, attempt,
generation, version, coalesce(correlation_id, ''), coalesce(failure_reason, ''), deadline_at,
created_at, updated_at, finished_at, coalesce(trace_parent, ''),
coalesce(command_topic, ''), coalesce(command_id, ''), command_waiting, expires_at, coalesce(definition_fingerprint, ''),
reply_secret, clock_timestamp()`

const (
	// insertInstanceSQL starts an instance unless one with its id exists,
	// its times on the database's clock: its own deadline (expires_at) $18
	// seconds from now, its first command's $13 seconds from now, or a
	// deadline of the step ($20 seconds) after its own, whichever comes
	// first (see instance.deadline). It returns them, and the clock, for
	// the command's not-after; nothing if the instance existed.
	insertInstanceSQL = `WITH clock AS (SELECT clock_timestamp() AS now)
INSERT INTO saga_instances AS i (id, saga_type, definition_version, status, data,
    current_step, phase, attempt, generation, version, correlation_id, failure_reason, deadline_at, finished_at, trace_parent,
    command_topic, command_id, expires_at, definition_fingerprint, reply_secret, created_at, updated_at)
SELECT $1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, nullif($12, ''),
    least(clock.now + make_interval(secs => $13), clock.now + make_interval(secs => $18) + make_interval(secs => $20)),
    $14, nullif($15, ''), nullif($16, ''), nullif($17, ''), clock.now + make_interval(secs => $18), nullif($19, ''), $21,
    clock.now, clock.now
FROM clock
ON CONFLICT (id) DO NOTHING
RETURNING i.expires_at, i.deadline_at, i.created_at`

	// updateInstanceSQL writes an instance's new state if nobody changed it
	// since it was read.
	updateInstanceSQL = `UPDATE saga_instances SET status = $2, data = $3::jsonb, current_step = $4, phase = $5,
    attempt = $6, generation = $7, version = version + 1, failure_reason = nullif($8, ''),
    deadline_at = $9, finished_at = $10, updated_at = clock_timestamp(),
    command_topic = nullif($12, ''), command_id = nullif($13, ''), command_waiting = $14, expires_at = $15
WHERE id = $1::uuid AND version = $11`

	// saveInstancesSQL writes the instances of a batch (see instanceWrite):
	// each where its version is still the one its batch read, locking them
	// in id order. It fails unless it wrote every one, naming one it did
	// not (saga_instance_changed, a serialization failure). (The failing
	// branch reads the count: made of parameters alone, it would be
	// evaluated when the statement is planned, and fail every time.)
	saveInstancesSQL = `WITH u AS (
    SELECT * FROM unnest($1::uuid[], $2::text[], $3::jsonb[], $4::int[], $5::text[], $6::int[], $7::int[], $8::text[],
        $9::timestamptz[], $10::timestamptz[], $11::int[], $12::int[], $13::text[], $14::text[], $15::bool[], $16::timestamptz[])
        AS u(id, status, data, step, phase, attempt, generation, reason, deadline_at, finished_at, read, version, topic, command, waiting, expires_at)
), locked AS (
    SELECT i.id FROM saga_instances i JOIN u ON u.id = i.id AND u.read = i.version ORDER BY i.id FOR UPDATE OF i
), saved AS (
    UPDATE saga_instances AS i SET status = u.status, data = u.data, current_step = u.step, phase = u.phase,
        attempt = u.attempt, generation = u.generation, version = u.version, failure_reason = nullif(u.reason, ''),
        deadline_at = u.deadline_at, finished_at = u.finished_at, updated_at = clock_timestamp(),
        command_topic = nullif(u.topic, ''), command_id = nullif(u.command, ''), command_waiting = u.waiting, expires_at = u.expires_at
    FROM u JOIN locked ON locked.id = u.id
    WHERE i.id = u.id AND i.version = u.read
    RETURNING i.id
)
SELECT CASE WHEN (SELECT count(*) FROM saved) = (SELECT count(*) FROM u) THEN 1
    ELSE (SELECT saga_instance_changed(u.id, u.read) FROM u WHERE u.id NOT IN (SELECT id FROM saved) LIMIT 1) END`

	// loadInstancesForCommandsSQL loads, for a batch, each instance ($1)
	// whose command in flight is the message's ($2). It takes no lock: a
	// batch locking its instances up front, while its attempts lock the
	// ones it could not take one by one, deadlocked with another batch
	// holding copies of the same replies. The batch's save locks the rows
	// and fails should one have changed since (saveInstancesSQL).
	// Instances of large data are not all loaded at once: in id order, up
	// to preloadBytes of data as stored (its first one whatever its size);
	// a reply whose instance the batch did not load reads it itself.
	loadInstancesForCommandsSQL = `SELECT ` + instanceColumns + ` FROM (
    SELECT i.*, sum(pg_column_size(i.data)) OVER (ORDER BY i.id) - pg_column_size(i.data) AS data_before
    FROM saga_instances i
    WHERE (i.id, i.command_id) IN (SELECT u.id, u.command FROM unnest($1::uuid[], $2::text[]) AS u(id, command))
) AS saga_instances
WHERE data_before < ` + preloadBytes

	loadInstanceSQL       = `SELECT ` + instanceColumns + ` FROM saga_instances WHERE id = $1`
	loadInstanceLockedSQL = loadInstanceSQL + ` FOR UPDATE`
	// loadInstanceForCommandSQL loads and locks an instance only if its
	// command in flight is message $2.
	loadInstanceForCommandSQL = `SELECT ` + instanceColumns + ` FROM saga_instances WHERE id = $1 AND command_id = $2 FOR UPDATE`

	// appendHistorySQL appends timeline entries, of one instance or
	// several, numbered per instance after its last one, in the order
	// given; writers hold the instance's row lock.
	appendHistorySQL = `INSERT INTO saga_history (saga_id, seq, kind, step, phase, attempt, message_id, detail, command_key)
SELECT e.saga_id, coalesce(last.seq, 0) + row_number() OVER (PARTITION BY e.saga_id ORDER BY e.ord),
    e.kind, nullif(e.step, ''), nullif(e.phase, ''), nullif(e.attempt, 0),
    nullif(e.message_id, ''), nullif(e.detail, ''), nullif(e.command_key, '')
FROM unnest($1::uuid[], $2::text[], $3::text[], $4::text[], $5::int[], $6::text[], $7::text[], $8::text[])
        WITH ORDINALITY AS e(saga_id, kind, step, phase, attempt, message_id, detail, command_key, ord)
    LEFT JOIN LATERAL (SELECT max(seq) AS seq FROM saga_history h WHERE h.saga_id = e.saga_id) AS last ON true`

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
	notifyFinishedSQL = `SELECT pg_notify(n.channel, n.payload) FROM unnest($1::text[], $2::text[]) AS n(channel, payload)`

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

	// pruneRequestsSQL deletes up to $2 operators' requests carried out
	// more than $1 seconds ago; those never carried out stay, for an
	// operator to see.
	pruneRequestsSQL = `DELETE FROM saga_requests WHERE id IN (
    SELECT id FROM saga_requests
    WHERE done_at < clock_timestamp() - make_interval(secs => $1)
    LIMIT $2
    FOR UPDATE SKIP LOCKED)`

	// postponeSQL moves an instance's deadline $2 seconds on.
	postponeSQL = `UPDATE saga_instances SET deadline_at = clock_timestamp() + make_interval(secs => $2)
WHERE id = $1 AND status IN ('running', 'compensating')`

	historySQL = `SELECT seq, at, kind, coalesce(step, ''), coalesce(phase, ''), coalesce(attempt, 0),
    coalesce(message_id, ''), coalesce(detail, '')
FROM saga_history WHERE saga_id = $1 ORDER BY seq`

	// listSQL lists instances, each with the step its timeline named
	// last (for readers without the definitions).
	// Its data is not read: its size and first characters are.
	listSQL = `SELECT ` + listColumns + `,
    coalesce((SELECT h.step FROM saga_history h WHERE h.saga_id = saga_instances.id AND h.step IS NOT NULL ORDER BY h.seq DESC LIMIT 1), ''),
    octet_length(data::text), left(data::text, 200)
` + selectedSQL + `
  AND ($6::timestamptz IS NULL OR (updated_at, id) > ($6::timestamptz, $7::uuid))
ORDER BY updated_at, id
LIMIT $5`

	countsSQL = `SELECT saga_type, status, count(*) FROM saga_instances GROUP BY saga_type, status`

	activeDefinitionsSQL = `SELECT saga_type, definition_version, coalesce(definition_fingerprint, ''), count(*) FROM saga_instances
WHERE status IN ('running', 'compensating') GROUP BY 1, 2, 3`
)

// insertInstance starts inst (see insertInstanceSQL), the saga timing out
// after timeout and its first command waiting inst.startWait, at most a
// deadline (grace) after the saga's own. It reports false if an instance
// with its id exists; else inst holds the times the database set, and its
// clock.
func insertInstance(ctx context.Context, tx delivery.DBTX, inst *instance, timeout, grace time.Duration) (bool, error) {
	var expires, deadline, created time.Time
	err := tx.QueryRowContext(ctx, insertInstanceSQL, inst.ID, inst.Type, inst.DefVersion, string(inst.Status), []byte(inst.Data),
		inst.Step, string(inst.Phase), inst.Attempt, inst.Generation, inst.Version, inst.CorrelationID, inst.FailureReason,
		inst.startWait.Seconds(), inst.FinishedAt, inst.TraceParent, inst.CommandTopic, inst.CommandID, timeout.Seconds(), inst.Fingerprint,
		grace.Seconds(), inst.ReplySecret).Scan(&expires, &deadline, &created)
	if errors.Is(err, sql.ErrNoRows) {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("saga %s: starting: %w", inst.ID, err)
	}
	inst.ExpiresAt, inst.DeadlineAt, inst.CreatedAt, inst.UpdatedAt = &expires, &deadline, created, created
	inst.readDB, inst.readLocal = created, time.Now()
	return true, nil
}

// updateInstance writes inst's new state. Inside a delivery attempt it is
// a batched write (see instanceWrite): the instance's row is written once
// for the batch, when the batch ends, however many reactions of the batch
// changed it, and the reactions after this one in the same transaction
// take it from there (pendingInstance), not from the table. Elsewhere it
// runs at once and checks the version.
func updateInstance(ctx context.Context, tx delivery.DBTX, inst *instance) error {
	if q, ok := tx.(dbtx.BatchQueuer); ok {
		saved := *inst
		saved.Version++
		saved.history, saved.outbox, saved.finished, saved.told = nil, nil, false, saved.Status
		if err := q.QueueBatched(instanceWrite, inst.ID.String(), inst.Version, &saved); err != nil {
			return fmt.Errorf("saga %s: saving: %w", inst.ID, err)
		}
		inst.Version++
		return nil
	}
	args := []any{inst.ID.String(), string(inst.Status), string(inst.Data), inst.Step, string(inst.Phase),
		inst.Attempt, inst.Generation, inst.FailureReason, inst.DeadlineAt, inst.FinishedAt, inst.Version,
		inst.CommandTopic, inst.CommandID, inst.CommandWaiting, inst.ExpiresAt}
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

// instanceWrite saves the instances the reactions of a batch changed: a
// row is the instance's id, the version its reaction read and the state it
// saved (an *instance, version included). An instance saved by several
// reactions of the batch (a chain of in-process deliveries: a reply, the
// next step, its reply) is written once, with its last state, where its
// version is still the one the first read; one that changed since (another
// transaction saved it) fails the batch (saveInstancesSQL), which is then
// run again, one message a transaction, on what the table holds.
var instanceWrite = &dbtx.Batched{
	Name: "saving saga instances",
	Statement: func(rows [][]any) (string, []any) {
		type saved struct {
			read int
			last *instance
		}
		byID := map[string]*saved{}
		var ids []string
		for _, row := range rows {
			id, read, inst := row[0].(string), row[1].(int), row[2].(*instance)
			s, ok := byID[id]
			switch {
			case !ok:
				byID[id] = &saved{read: read, last: inst}
				ids = append(ids, id)
			case read != s.last.Version:
				panic(fmt.Sprintf("saga %s: saved from version %d after version %d", id, read, s.last.Version))
			default:
				s.last = inst
			}
		}
		slices.Sort(ids) // rows are locked in one order by every batch
		n := len(ids)
		var (
			status, data, phase, reason, topic, command = make([]string, n), make([]string, n), make([]string, n), make([]string, n), make([]string, n), make([]string, n)
			step, attempt, generation, read, version    = make([]int32, n), make([]int32, n), make([]int32, n), make([]int32, n), make([]int32, n)
			deadline, finished, expires                 = make([]*time.Time, n), make([]*time.Time, n), make([]*time.Time, n)
			waiting                                     = make([]bool, n)
		)
		for i, id := range ids {
			s := byID[id]
			in := s.last
			status[i], data[i], phase[i], reason[i], topic[i], command[i] = string(in.Status), string(in.Data), string(in.Phase), in.FailureReason, in.CommandTopic, in.CommandID
			step[i], attempt[i], generation[i], read[i], version[i] = int32(in.Step), int32(in.Attempt), int32(in.Generation), int32(s.read), int32(in.Version)
			deadline[i], finished[i], expires[i], waiting[i] = in.DeadlineAt, in.FinishedAt, in.ExpiresAt, in.CommandWaiting
		}
		return saveInstancesSQL, []any{ids, status, data, step, phase, attempt, generation, reason, deadline, finished,
			read, version, topic, command, waiting, expires}
	},
}

// pendingInstance is instance id as a reaction earlier in tx's batch saved
// it, not written yet (see instanceWrite): a copy, nil if none did.
func pendingInstance(tx delivery.DBTX, id uuid.UUID) *instance {
	key := id.String()
	row, ok := transport.PendingBatched(tx, instanceWrite, func(row []any) bool { return row[0] == key })
	if !ok {
		return nil
	}
	inst := *row[2].(*instance)
	return &inst
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
		&inst.CommandTopic, &inst.CommandID, &inst.CommandWaiting, &inst.ExpiresAt, &inst.Fingerprint,
		&inst.ReplySecret, &inst.readDB}, more...)...)
	if err != nil {
		return nil, err
	}
	inst.readLocal = time.Now()
	inst.Status, inst.Phase, inst.Data = Status(status), Phase(phase), data
	inst.told = inst.Status
	return &inst, nil
}

// loadInstanceForCommand loads and locks instance id if its command in
// flight is message command; ErrNoSuchSaga otherwise.
func loadInstanceForCommand(ctx context.Context, tx delivery.DBTX, id uuid.UUID, command string) (*instance, error) {
	if inst := pendingInstance(tx, id); inst != nil {
		if inst.CommandID != command {
			return nil, fmt.Errorf("%w: %s", ErrNoSuchSaga, id)
		}
		return inst, nil
	}
	inst, err := scanInstance(tx.QueryRowContext(ctx, loadInstanceForCommandSQL, id, command))
	if errors.Is(err, sql.ErrNoRows) {
		return nil, fmt.Errorf("%w: %s", ErrNoSuchSaga, id)
	}
	if err != nil {
		return nil, fmt.Errorf("saga %s: loading: %w", id, err)
	}
	return inst, nil
}

func loadInstance(ctx context.Context, tx delivery.DBTX, id uuid.UUID, lock bool) (*instance, error) {
	if inst := pendingInstance(tx, id); inst != nil {
		return inst, nil // saved earlier in the batch: what it writes is checked then
	}
	q := loadInstanceSQL
	if lock {
		q = loadInstanceLockedSQL
	}
	inst, err := scanInstance(tx.QueryRowContext(ctx, q, id))
	if errors.Is(err, sql.ErrNoRows) {
		return nil, fmt.Errorf("%w: %s", ErrNoSuchSaga, id)
	}
	if err != nil {
		return nil, fmt.Errorf("saga %s: loading: %w", id, err)
	}
	return inst, nil
}

// appendHistory appends entries to the instance's timeline: written with
// the batch's other timelines inside a delivery attempt, in one statement
// at once otherwise.
func appendHistory(ctx context.Context, tx delivery.DBTX, id uuid.UUID, entries []historyEntry) error {
	rows := make([][]any, len(entries))
	for i, h := range entries {
		rows[i] = []any{id.String(), h.Kind, h.Step, string(h.Phase), int32(h.Attempt), h.MessageID, h.Detail, h.CommandKey}
	}
	if err := dbtx.WriteBatched(ctx, tx, historyWrite, rows...); err != nil {
		return fmt.Errorf("saga %s: writing its timeline: %w", id, err)
	}
	return nil
}

// historyWrite appends timeline entries, of any instances: a row is the
// instance, kind, step, phase, attempt, message id, detail and command key.
var historyWrite = &dbtx.Batched{
	Name: "writing saga timelines",
	Statement: func(rows [][]any) (string, []any) {
		return appendHistorySQL, []any{dbtx.Column[string](rows, 0), dbtx.Column[string](rows, 1), dbtx.Column[string](rows, 2),
			dbtx.Column[string](rows, 3), dbtx.Column[int32](rows, 4), dbtx.Column[string](rows, 5), dbtx.Column[string](rows, 6),
			dbtx.Column[string](rows, 7)}
	},
}

// notifyWrite announces ends of sagas: a row is the channel and the
// saga's id.
var notifyWrite = &dbtx.Batched{
	Name: "announcing the end of sagas",
	Statement: func(rows [][]any) (string, []any) {
		return notifyFinishedSQL, []any{dbtx.Column[string](rows, 0), dbtx.Column[string](rows, 1)}
	},
}

// replyLoad loads, for a batch of replies, the instances whose command in
// flight they answer (see transport.LoadPerBatch): what
// loadInstanceForCommand reads for each, in one statement. A reply takes
// its instance with preloadedInstance.
var replyLoad = instanceLoad(func(env steps.Envelope) string { return env.CausationID })

// commandLoad loads, for a batch of saga commands whose replies the
// engine takes in process, in the same transaction, the instances that
// wait for them: what the replies would read one by one.
var commandLoad = instanceLoad(func(env steps.Envelope) string { return env.ID })

// instanceLoad loads the instances whose command in flight is the one
// commandOf names for each message of a batch.
func instanceLoad(commandOf func(steps.Envelope) string) transport.BatchLoad {
	return transport.BatchLoad{
		Key: func(msg *message.Message) (string, []any, bool) {
			env := steps.EnvelopeOf(msg)
			id, err := uuid.Parse(env.SagaID)
			command := commandOf(env)
			if err != nil || command == "" {
				return "", nil, false
			}
			return preloadKey(id, command), []any{id.String(), command}, true
		},
		Statement: func(rows [][]any) (string, []any) {
			return loadInstancesForCommandsSQL, []any{dbtx.Column[string](rows, 0), dbtx.Column[string](rows, 1)}
		},
		Scan: func(rows pgx.Rows) (string, any, error) {
			inst, err := scanInstance(rows)
			if err != nil {
				return "", nil, fmt.Errorf("saga: loading a batch's instances: %w", err)
			}
			return preloadKey(inst.ID, inst.CommandID), inst, nil
		},
	}
}

func preloadKey(id uuid.UUID, command string) string { return id.String() + " " + command }

// preloadedInstance is the instance id, loaded for tx's batch (not
// locked), if its command in flight was command when the batch began; nil
// if the batch did not load it. An instance a reaction earlier in the
// batch saved is taken as it saved it instead (pendingInstance). The
// batch's save locks it, and fails should it have changed since
// (saveInstancesSQL).
func preloadedInstance(tx delivery.DBTX, id uuid.UUID, command string) *instance {
	if inst := pendingInstance(tx, id); inst != nil {
		if inst.CommandID != command {
			return nil
		}
		return inst
	}
	v, ok := transport.Preloaded(tx, preloadKey(id, command))
	if !ok {
		return nil
	}
	return v.(*instance)
}
