package saga

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"

	"github.com/pgsaga/pgsaga/internal/transport"
)

// RequestTopic is the topic that carries operators' requests (Ask) for
// instances of saga name to the engines that know it.
func RequestTopic(name string) string { return "saga." + name + ".requests" }

func requestHandler(name string) string { return "saga." + name + ".requests" }

// RequestKind is what an operator asks of a saga.
type RequestKind string

// Kinds of request.
const (
	RequestRetry  RequestKind = "retry"  // Client.Retry
	RequestCancel RequestKind = "cancel" // Client.Cancel
)

// Outcomes of a request carried out.
const (
	RequestDone    = "done"
	RequestRefused = "refused" // the saga was in no state for it; Detail says why
)

// Request is an operator's request and, once a worker carried it out, its
// outcome.
type Request struct {
	ID          uuid.UUID
	SagaID      uuid.UUID
	Kind        RequestKind
	Reason      string
	RequestedAt time.Time
	// DoneAt is nil until a worker carried it out.
	DoneAt  *time.Time
	Outcome string // RequestDone or RequestRefused, once done
	Detail  string
	// Queued reports, until a worker carried it out, whether its message
	// waits for one; false if it was dead-lettered (a worker that knows
	// the saga failed to carry it out in every attempt; one that does not
	// know it hands it back instead): asking again publishes it again.
	Queued bool
}

// Lost reports whether r can no longer be carried out as it is: not
// carried out, and its message no longer queued. Asking again publishes
// it again.
func (r Request) Lost() bool { return r.DoneAt == nil && !r.Queued }

// ask is Client.Ask.
func ask(ctx context.Context, tr *transport.Transport, db *sql.DB, id uuid.UUID, kind RequestKind, reason string) (Request, error) {
	if kind != RequestRetry && kind != RequestCancel {
		return Request{}, fmt.Errorf("%w: kind %q (retry or cancel)", ErrUnknownRequest, kind)
	}
	tx, err := db.BeginTx(ctx, &sql.TxOptions{Isolation: sql.LevelReadCommitted})
	if err != nil {
		return Request{}, fmt.Errorf("saga %s: asking for a %s: %w", id, kind, err)
	}
	defer tx.Rollback() //nolint:errcheck // no-op after Commit
	var (
		name    string
		version int
	)
	if err := tx.QueryRowContext(ctx, `SELECT saga_type, version FROM saga_instances WHERE id = $1`, id).Scan(&name, &version); errors.Is(err, sql.ErrNoRows) {
		return Request{}, fmt.Errorf("%w: %s", ErrNoSuchSaga, id)
	} else if err != nil {
		return Request{}, fmt.Errorf("saga %s: asking for a %s: %w", id, kind, err)
	}
	// The same request for the saga as it is now: one id.
	reqID := uuid.NewSHA1(requestSpace, fmt.Appendf(nil, "%s\x00%s\x00%d", id, kind, version))
	var publish bool
	if err := tx.QueryRowContext(ctx, askSQL, reqID, id, string(kind), reason).Scan(&publish); err != nil {
		return Request{}, fmt.Errorf("saga %s: asking for a %s: %w", id, kind, err)
	}
	if !publish {
		// Asked before: locked (its worker waits), published again if it was
		// neither carried out nor is still queued.
		if err := tx.QueryRowContext(ctx, lostRequestSQL, reqID).Scan(&publish); err != nil {
			return Request{}, fmt.Errorf("saga %s: asking for a %s: %w", id, kind, err)
		}
	}
	if publish {
		payload, _ := json.Marshal(requestMessage{RequestID: reqID})
		if err := tr.Publisher(tx).Publish(RequestTopic(name), message.NewMessage(reqID.String(), payload)); err != nil {
			return Request{}, fmt.Errorf("saga %s: asking for a %s: %w", id, kind, err)
		}
	}
	if err := tx.Commit(); err != nil {
		return Request{}, fmt.Errorf("saga %s: asking for a %s: %w", id, kind, err)
	}
	return requestStatus(ctx, db, reqID)
}

var requestSpace = uuid.MustParse("0b6c1e9e-8a55-4c8e-a7c2-7067736167a2")

type requestMessage struct {
	RequestID uuid.UUID `json:"request_id"`
}

// RequestStatus reads a request and its outcome.
func requestStatus(ctx context.Context, db *sql.DB, id uuid.UUID) (Request, error) {
	got, err := requestStatuses(ctx, db, []uuid.UUID{id})
	if err != nil {
		return Request{}, err
	}
	r, ok := got[id]
	if !ok {
		return Request{}, fmt.Errorf("%w: request %s", ErrNoSuchSaga, id)
	}
	return r, nil
}

// requestStatuses is Client.RequestStatuses.
func requestStatuses(ctx context.Context, db *sql.DB, ids []uuid.UUID) (map[uuid.UUID]Request, error) {
	s := make([]string, len(ids))
	for i, id := range ids {
		s[i] = id.String()
	}
	rows, err := db.QueryContext(ctx, requestsSQL, s)
	if err != nil {
		return nil, fmt.Errorf("saga: reading %d requests: %w", len(ids), err)
	}
	defer rows.Close()
	out := make(map[uuid.UUID]Request, len(ids))
	for rows.Next() {
		var (
			r    Request
			kind string
		)
		if err := rows.Scan(&r.ID, &r.SagaID, &kind, &r.Reason, &r.RequestedAt, &r.DoneAt, &r.Outcome, &r.Detail, &r.Queued); err != nil {
			return nil, fmt.Errorf("saga: reading requests: %w", err)
		}
		r.Kind = RequestKind(kind)
		out[r.ID] = r
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("saga: reading requests: %w", err)
	}
	return out, nil
}

// fixFilter is Client.FixFilter.
func fixFilter(ctx context.Context, db *sql.DB, f Filter) (Filter, error) {
	var cutoff time.Time
	if err := db.QueryRowContext(ctx, fixCutoffSQL, f.OlderThan.Seconds()).Scan(&cutoff); err != nil {
		return Filter{}, fmt.Errorf("saga: fixing a selection's cutoff: %w", err)
	}
	if f.UpdatedBefore.IsZero() || cutoff.Before(f.UpdatedBefore) {
		f.UpdatedBefore = cutoff
	}
	f.OlderThan = 0
	return f, nil
}

// countSelected is Client.CountSelected.
func countSelected(ctx context.Context, db *sql.DB, f Filter) (int, error) {
	var n int
	if err := db.QueryRowContext(ctx, countSelectedSQL, selectArgs(f)...).Scan(&n); err != nil {
		return 0, fmt.Errorf("saga: counting instances: %w", err)
	}
	return n, nil
}

// selectedIDs is Client.SelectedIDs.
func selectedIDs(ctx context.Context, db *sql.DB, f Filter, after uuid.UUID) ([]uuid.UUID, error) {
	if f.Limit <= 0 {
		f.Limit = 100
	}
	rows, err := db.QueryContext(ctx, selectedIDsSQL, append(selectArgs(f), after, f.Limit)...)
	if err != nil {
		return nil, fmt.Errorf("saga: selecting instances: %w", err)
	}
	defer rows.Close()
	var out []uuid.UUID
	for rows.Next() {
		var id uuid.UUID
		if err := rows.Scan(&id); err != nil {
			return nil, fmt.Errorf("saga: selecting instances: %w", err)
		}
		out = append(out, id)
	}
	return out, rows.Err()
}

// selectArgs are the arguments of selectedSQL for f (List's too).
func selectArgs(f Filter) []any {
	var statuses any // NULL: every status
	if len(f.Statuses) > 0 {
		s := make([]string, len(f.Statuses))
		for i, st := range f.Statuses {
			s[i] = string(st)
		}
		statuses = s
	}
	var before any // NULL: no fixed cutoff
	if !f.UpdatedBefore.IsZero() {
		before = f.UpdatedBefore
	}
	return []any{statuses, f.Type, f.OlderThan.Seconds(), before}
}

// handleRequest carries out an operator's request (see Ask) in the
// message's transaction, once, and records its outcome there: done, or
// refused when the saga was in no state for it. A request for a
// definition this process does not know is handed back untouched
// (transport.HandBack): a worker that knows it takes it.
func (e *engine) handleRequest(msg *message.Message) error {
	ctx := msg.Context()
	tx, ok := transport.TxFromContext(ctx)
	if !ok {
		return errors.New("saga: request needs a transaction in the message context")
	}
	var m requestMessage
	if err := json.Unmarshal(msg.Payload, &m); err != nil {
		return transport.Permanent(fmt.Errorf("saga: request message %s: %w", msg.UUID, err))
	}
	var (
		sagaID uuid.UUID
		kind   string
		reason string
		done   bool
	)
	err := tx.QueryRowContext(ctx, lockRequestSQL, m.RequestID).Scan(&sagaID, &kind, &reason, &done)
	if errors.Is(err, sql.ErrNoRows) {
		return transport.Permanent(fmt.Errorf("saga: request %s is not recorded", m.RequestID))
	}
	if err != nil {
		return err
	}
	if done {
		return nil
	}
	switch RequestKind(kind) {
	case RequestRetry:
		err = e.RetryTx(ctx, tx, sagaID)
	case RequestCancel:
		err = e.CancelTx(ctx, tx, sagaID, reason)
	default:
		return transport.Permanent(fmt.Errorf("%w: request %s asks for %q", ErrUnknownRequest, m.RequestID, kind))
	}
	outcome, detail := RequestDone, ""
	switch {
	case err == nil:
	case errors.Is(err, ErrNotRetryable), errors.Is(err, ErrNotCancellable), errors.Is(err, ErrNoSuchSaga):
		outcome, detail = RequestRefused, err.Error()
	case errors.Is(err, ErrUnknownDefinition):
		// Another release's, during a rolling deploy: handed back, no
		// attempt spent, for a worker that knows it.
		return transport.HandBack(err)
	default:
		return err
	}
	if _, err := tx.ExecContext(ctx, finishRequestSQL, m.RequestID, outcome, detail); err != nil {
		return fmt.Errorf("saga: recording request %s: %w", m.RequestID, err)
	}
	e.log.Info("operator request carried out", "saga", sagaID, "request", m.RequestID, "kind", kind, "outcome", outcome, "detail", detail)
	return nil
}

const (
	askSQL = `WITH ins AS (
    INSERT INTO saga_requests (id, saga_id, kind, reason) VALUES ($1, $2, $3, $4)
    ON CONFLICT (id) DO NOTHING RETURNING 1
)
SELECT EXISTS (SELECT FROM ins)`
	// requestQueuedSQL: the message of request r waits in the queue of
	// its saga's requests (the topic and group RequestTopic and
	// requestHandler name).
	requestQueuedSQL = `EXISTS (SELECT FROM saga_instances i
    JOIN pgsaga_queue q ON q.topic = 'saga.' || i.saga_type || '.requests' AND q.consumer_group = q.topic
    WHERE i.id = r.saga_id AND q.uuid = r.id::text)`
	// lostRequestSQL locks request $1 and reports whether it must be
	// published again: not carried out, and its message no longer queued.
	lostRequestSQL = `SELECT r.done_at IS NULL AND NOT ` + requestQueuedSQL + `
FROM saga_requests r WHERE r.id = $1
FOR UPDATE OF r`
	requestsSQL = `SELECT r.id, r.saga_id, r.kind, r.reason, r.requested_at, r.done_at, coalesce(r.outcome, ''), r.detail,
    r.done_at IS NULL AND ` + requestQueuedSQL + `
FROM saga_requests r WHERE r.id = ANY ($1::uuid[])`
	lockRequestSQL   = `SELECT saga_id, kind, reason, done_at IS NOT NULL FROM saga_requests WHERE id = $1 FOR UPDATE`
	finishRequestSQL = `UPDATE saga_requests SET done_at = clock_timestamp(), outcome = $2, detail = $3 WHERE id = $1`

	// selectedSQL selects instances as List does ($1 statuses, NULL for
	// all; $2 saga type, '' for all; $3 not updated for that many seconds
	// by the database's clock; $4 updated at or before, NULL for any).
	selectedSQL = `FROM saga_instances
WHERE ($1::text[] IS NULL OR status = ANY ($1::text[]))
  AND ($2::text = '' OR saga_type = $2)
  AND updated_at <= clock_timestamp() - make_interval(secs => $3)
  AND ($4::timestamptz IS NULL OR updated_at <= $4)`
	countSelectedSQL = `SELECT count(*) ` + selectedSQL
	// selectedIDsSQL: the next $6 of them by id, after $5.
	selectedIDsSQL = `SELECT id ` + selectedSQL + ` AND id > $5 ORDER BY id LIMIT $6`

	// fixCutoffSQL is the database's time $1 seconds ago.
	fixCutoffSQL = `SELECT clock_timestamp() - make_interval(secs => $1)`
)
