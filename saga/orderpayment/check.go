package orderpayment

import (
	"context"
	"database/sql"
	"fmt"
	"sort"
	"time"

	"github.com/google/uuid"

	"github.com/pgsaga/pgsaga/internal/sqlcheck"
	"github.com/pgsaga/pgsaga/orders"
	"github.com/pgsaga/pgsaga/payments"
	"github.com/pgsaga/pgsaga/saga"
)

// Violation is a broken invariant, with the offending rows: the failure
// kit's.
type Violation struct {
	Invariant string
	Rows      []string
}

// String implements fmt.Stringer: the invariant, then its rows.
func (v Violation) String() string { return sqlcheck.Violation(v).String() }

// Report is the state of the sample's sagas and whether the invariants hold.
type Report struct {
	// Sagas counts the checked sagas by status.
	Sagas map[saga.Status]int
	Total int
	// Latency of the finished sagas, from start to terminal state.
	P50, P99, Max time.Duration
	// Violations lists every broken invariant; empty means all hold.
	Violations []Violation
	// Parked lists the checked sagas parked as failed that a declined
	// refund explains (see Check), oldest first. They break no invariant;
	// they wait for an operator (pgsaga retry).
	Parked []Parked
}

// Parked is a saga parked as failed, waiting for an operator.
type Parked struct {
	ID     uuid.UUID
	Reason string // the saga's failure reason
}

// ParkedByDeclinedRefund ends the failure reason of a saga parked because
// the gateway declined the refund its charge's compensation asked for.
const ParkedByDeclinedRefund = "compensation of charge failed: " + payments.ReasonRefundDeclined

// OK reports whether every invariant holds.
func (r Report) OK() bool { return len(r.Violations) == 0 }

// Check checks the invariants of the sample over the sagas ids (all sagas
// of the type when ids is nil):
//
//   - every saga is terminal, and none is parked as failed (an operator
//     must look at those), unless a declined refund explains it: its
//     failure reason ends with ParkedByDeclinedRefund, the ledger still
//     holds its order's charge (one captured charge of the saga's amount,
//     no refund, no void) and, when the fake gateway's tables exist, the
//     gateway declined a refund of that charge and made none. Such a saga
//     is listed in Report.Parked instead: the gateway refused, nothing was
//     charged twice, and the charge stays held until an operator retries;
//   - every placed order has a saga (when all sagas are checked);
//   - a completed saga's order is confirmed, a compensated one's cancelled;
//   - no idempotency key is left pending;
//   - no account is below zero (a balance is the sum of its postings);
//   - per order at most one charge, one void and one refund posting;
//   - a completed saga's order holds exactly one net charge of its amount,
//     a compensated one none;
//   - the gateway (when the fake gateway's tables exist) charged and
//     refunded exactly what the ledger records: same ids, accounts, amounts.
//     A charge the gateway made again after forgetting a key (it keeps the
//     operation on record) has no posting, so it is reported too;
//   - the gateway charged no order twice (by the order id the charges carry
//     as metadata): the ledger allows one charge per order, so a second one
//     is money taken that no posting accounts for.
func Check(ctx context.Context, db *sql.DB, ids []uuid.UUID) (Report, error) {
	return check(ctx, db, ids)
}

// querier is a *sql.DB or a *sql.Tx.
type querier interface {
	sqlcheck.Querier
	QueryRowContext(ctx context.Context, query string, args ...any) *sql.Row
}

func check(ctx context.Context, db querier, ids []uuid.UUID) (Report, error) {
	r := Report{Sagas: map[saga.Status]int{}}
	var idArg any
	if ids != nil {
		s := make([]string, len(ids))
		for i, id := range ids {
			s[i] = id.String()
		}
		idArg = s
	}
	rows, err := db.QueryContext(ctx, sagaStatusSQL, Name, idArg)
	if err != nil {
		return r, fmt.Errorf("orderpayment: checking sagas: %w", err)
	}
	var latencies []time.Duration
	var notTerminal []string
	for rows.Next() {
		var (
			id      string
			status  string
			latency sql.NullFloat64
		)
		if err := rows.Scan(&id, &status, &latency); err != nil {
			rows.Close()
			return r, err
		}
		st := saga.Status(status)
		r.Sagas[st]++
		r.Total++
		if !st.Terminal() {
			notTerminal = append(notTerminal, id+" "+status)
		}
		if latency.Valid {
			latencies = append(latencies, time.Duration(latency.Float64*float64(time.Second)))
		}
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return r, err
	}
	if ids != nil && r.Total < len(ids) {
		where, err := sqlcheck.Rows(ctx, db, unstartedSQL, Name, orders.CreatedTopic)
		if err != nil {
			return r, fmt.Errorf("orderpayment: finding the triggers of sagas never started: %w", err)
		}
		r.Violations = append(r.Violations, Violation{Invariant: fmt.Sprintf("%d of %d sagas were never started", len(ids)-r.Total, len(ids)), Rows: firstN(where)})
	}
	if len(notTerminal) > 0 {
		r.Violations = append(r.Violations, Violation{Invariant: "sagas not terminal", Rows: firstN(notTerminal)})
	}
	sort.Slice(latencies, func(i, j int) bool { return latencies[i] < latencies[j] })
	if n := len(latencies); n > 0 {
		r.P50, r.P99, r.Max = latencies[n*50/100], latencies[min(n-1, n*99/100)], latencies[n-1]
	}

	type check struct {
		name  string
		query string
		args  []any
	}
	var gateway, orderIDs bool
	if err := db.QueryRowContext(ctx, gatewayTablesSQL).Scan(&gateway, &orderIDs); err != nil {
		return r, fmt.Errorf("orderpayment: looking for the gateway's tables: %w", err)
	}
	unexplained, err := r.parked(ctx, db, idArg, gateway)
	if err != nil {
		return r, err
	}
	if len(unexplained) > 0 {
		r.Violations = append(r.Violations, Violation{Invariant: "sagas parked as failed (an operator must look)", Rows: firstN(unexplained)})
	}
	checks := []check{
		{"sagas whose order does not match (completed: confirmed; compensated: cancelled)", orderStateSQL, []any{Name, idArg}},
		{"idempotency keys left pending", pendingKeysSQL, nil},
		{"accounts below zero", negativeAccountsSQL, nil},
		{"orders with more than one charge, void or refund posting", duplicatePostingsSQL, nil},
		{"completed sagas without exactly one net charge of their amount", completedNetSQL, []any{Name, idArg}},
		{"compensated sagas still holding money", compensatedNetSQL, []any{Name, idArg}},
		{"order views ahead of their order's events, or at its version with another status", viewsSQL, nil},
	}
	if ids == nil {
		checks = append(checks, check{"placed orders without a saga", ordersWithoutSagaSQL, []any{Name}})
	}
	if gateway {
		checks = append(checks,
			check{"gateway charges and captured postings that do not match (id, account, amount)", gatewayChargesSQL, nil},
			check{"gateway refunds and refund postings that do not match (id, account, amount)", gatewayRefundsSQL, nil},
		)
	}
	if orderIDs {
		// Tables of a gateway that predates the order id have no column to
		// group by; its next start adds it.
		checks = append(checks, check{"orders charged more than once at the gateway", gatewayDoubleChargesSQL, nil})
	}
	for _, c := range checks {
		bad, err := sqlcheck.Rows(ctx, db, c.query, c.args...)
		if err != nil {
			return r, fmt.Errorf("orderpayment: checking %s: %w", c.name, err)
		}
		if len(bad) > 0 {
			r.Violations = append(r.Violations, Violation{Invariant: c.name, Rows: firstN(bad)})
		}
	}
	return r, nil
}

// parked fills r.Parked with the failed sagas among idArg that a declined
// refund explains, and returns the others, each with its reason and why no
// declined refund explains it.
func (r *Report) parked(ctx context.Context, db querier, idArg any, gateway bool) ([]string, error) {
	query := fmt.Sprintf(failedSagasSQL, "")
	if gateway {
		query = fmt.Sprintf(failedSagasSQL, failedSagasGatewaySQL)
	}
	rows, err := db.QueryContext(ctx, query, Name, idArg, ParkedByDeclinedRefund)
	if err != nil {
		return nil, fmt.Errorf("orderpayment: checking parked sagas: %w", err)
	}
	defer rows.Close()
	var unexplained []string
	for rows.Next() {
		var (
			id, reason string
			why        sql.NullString
		)
		if err := rows.Scan(&id, &reason, &why); err != nil {
			return nil, err
		}
		if why.Valid {
			unexplained = append(unexplained, fmt.Sprintf("%s %s (%s)", id, reason, why.String))
			continue
		}
		r.Parked = append(r.Parked, Parked{ID: uuid.MustParse(id), Reason: reason})
	}
	return unexplained, rows.Err()
}

func firstN(rows []string) []string {
	if len(rows) > 20 {
		return append(rows[:20:20], fmt.Sprintf("… and %d more", len(rows)-20))
	}
	return rows
}

// unstartedSQL says, for each placed order without a saga, where its
// trigger is: queued (with its attempts and last error), dead-lettered
// (with the reason), or nowhere. A trigger is found by its order id in the
// payload's bytes, so malformed payloads cannot fail the check.
const unstartedSQL = `SELECT 'order ' || (e.payload->>'order_id') || ': ' || coalesce(
    (SELECT 'trigger queued for ' || q.consumer_group || ' after ' || q.attempts || ' failed attempts' || coalesce(' (last: ' || q.last_error || ')', '')
        FROM pgsaga_queue q WHERE q.topic = $2 AND position(convert_to(e.payload->>'order_id', 'UTF8') IN q.payload) > 0 LIMIT 1),
    (SELECT 'trigger ' || d.uuid || ' dead-lettered after ' || d.attempts || ' attempts: ' || d.reason
        FROM pgsaga_dead_letters d WHERE d.topic = $2 AND position(convert_to(e.payload->>'order_id', 'UTF8') IN d.payload) > 0 LIMIT 1),
    'no trigger queued or dead-lettered')
FROM domain_events e
WHERE e.event_type = 'orders.placed'
  AND NOT EXISTS (SELECT FROM saga_instances s WHERE s.saga_type = $1 AND s.data->>'order_id' = e.payload->>'order_id')
ORDER BY e.position
LIMIT 21`

const (
	sagaStatusSQL = `SELECT id::text, status, extract(epoch FROM finished_at - created_at)
FROM saga_instances WHERE saga_type = $1 AND ($2::text[] IS NULL OR id::text = ANY ($2::text[]))`

	pendingKeysSQL = `SELECT scope || '/' || key FROM idempotency_keys WHERE status = 'pending' ORDER BY created_at`

	negativeAccountsSQL = `SELECT account_id || ' ' || sum(delta_cents) FROM account_postings
GROUP BY account_id HAVING sum(delta_cents) < 0`

	duplicatePostingsSQL = `SELECT order_id::text || ' ' || kind || ' x' || count(*) FROM account_postings
WHERE order_id IS NOT NULL GROUP BY order_id, kind HAVING count(*) > 1`

	// The saga data carries the order and amount.
	completedNetSQL = `SELECT s.id::text || ' order ' || (s.data->>'order_id') || ' net ' || coalesce(sum(p.delta_cents), 0)
    || ' charged ' || count(*) FILTER (WHERE p.kind = 'charge' AND p.reference IS NOT NULL)
FROM saga_instances s
LEFT JOIN account_postings p ON p.order_id = (s.data->>'order_id')::uuid
WHERE s.saga_type = $1 AND s.status = 'completed' AND ($2::text[] IS NULL OR s.id::text = ANY ($2::text[]))
GROUP BY s.id, s.data
HAVING coalesce(sum(p.delta_cents), 0) <> -(s.data->>'amount_cents')::bigint
    OR count(*) FILTER (WHERE p.kind = 'charge' AND p.reference IS NOT NULL) <> 1`

	compensatedNetSQL = `SELECT s.id::text || ' order ' || (s.data->>'order_id') || ' net ' || sum(p.delta_cents)
FROM saga_instances s
JOIN account_postings p ON p.order_id = (s.data->>'order_id')::uuid
WHERE s.saga_type = $1 AND s.status = 'compensated' AND ($2::text[] IS NULL OR s.id::text = ANY ($2::text[]))
GROUP BY s.id, s.data
HAVING sum(p.delta_cents) <> 0`

	// failedSagasSQL lists the failed sagas with their reason and, unless
	// a declined refund explains the saga, why not. %s: further WHEN
	// clauses (failedSagasGatewaySQL when the gateway's tables exist).
	failedSagasSQL = `SELECT s.id::text, coalesce(s.failure_reason, ''),
    CASE
    WHEN right(coalesce(s.failure_reason, ''), length($3)) <> $3 THEN 'not parked by a declined refund'
    WHEN l.captured <> 1 OR l.refunds > 0 OR l.voids > 0 OR l.net <> -(s.data->>'amount_cents')::bigint
        THEN format('the ledger does not hold its charge: net %%s, %%s captured charges, %%s refunds, %%s voids', l.net, l.captured, l.refunds, l.voids)
    %s
    END
FROM saga_instances s
CROSS JOIN LATERAL (
    SELECT coalesce(sum(p.delta_cents), 0) AS net,
        count(*) FILTER (WHERE p.kind = 'charge' AND p.reference IS NOT NULL) AS captured,
        count(*) FILTER (WHERE p.kind = 'refund') AS refunds,
        count(*) FILTER (WHERE p.kind = 'void') AS voids,
        max(p.reference) FILTER (WHERE p.kind = 'charge') AS charge_id
    FROM account_postings p WHERE p.order_id = (s.data->>'order_id')::uuid) l
WHERE s.saga_type = $1 AND s.status = 'failed' AND ($2::text[] IS NULL OR s.id::text = ANY ($2::text[]))
ORDER BY s.finished_at, s.id`

	// failedSagasGatewaySQL: the gateway declined a refund of the charge
	// the ledger holds, and refunded none.
	failedSagasGatewaySQL = `WHEN NOT EXISTS (SELECT FROM fake_gateway_operations g WHERE g.op = 'refund' AND g.outcome = 'declined' AND g.charge_id = l.charge_id)
        THEN 'the gateway declined no refund of its charge ' || coalesce(l.charge_id, 'none')
    WHEN EXISTS (SELECT FROM fake_gateway_operations g WHERE g.op = 'refund' AND g.outcome = 'succeeded' AND g.charge_id = l.charge_id)
        THEN 'the gateway refunded its charge ' || coalesce(l.charge_id, 'none')`

	orderStateSQL = `SELECT s.id::text || ' ' || s.status || ', order ' || coalesce(last.event_type, 'missing')
FROM saga_instances s
LEFT JOIN LATERAL (
    SELECT event_type FROM domain_events
    WHERE stream_id = 'order-' || (s.data->>'order_id') ORDER BY version DESC LIMIT 1) last ON true
WHERE s.saga_type = $1 AND ($2::text[] IS NULL OR s.id::text = ANY ($2::text[]))
  AND ((s.status = 'completed' AND last.event_type IS DISTINCT FROM 'orders.confirmed')
    OR (s.status = 'compensated' AND last.event_type IS DISTINCT FROM 'orders.cancelled'))`

	ordersWithoutSagaSQL = `SELECT e.payload->>'order_id' FROM domain_events e
WHERE e.event_type = 'orders.placed'
  AND NOT EXISTS (SELECT FROM saga_instances s WHERE s.saga_type = $1 AND s.data->>'order_id' = e.payload->>'order_id')`

	// viewsSQL: order_views rows that no projection could have written: a
	// version beyond the order's last event, or the last event's version
	// with a status other than the one that event leaves. (A view behind
	// its stream is allowed: an asynchronous projection may lag.)
	viewsSQL = `SELECT v.order_id::text FROM order_views v
JOIN LATERAL (SELECT e.version, e.event_type FROM domain_events e
    WHERE e.stream_id = 'order-' || v.order_id::text ORDER BY e.version DESC LIMIT 1) last ON true
WHERE v.version > last.version
   OR (v.version = last.version AND v.status IS DISTINCT FROM CASE last.event_type
        WHEN 'orders.placed' THEN 'placed' WHEN 'orders.confirmed' THEN 'confirmed' WHEN 'orders.cancelled' THEN 'cancelled' END)`

	// gatewayTablesSQL: whether the fake gateway's operations exist, and
	// carry the order id.
	gatewayTablesSQL = `SELECT to_regclass('fake_gateway_operations') IS NOT NULL,
    EXISTS (SELECT FROM pg_attribute WHERE attrelid = to_regclass('fake_gateway_operations') AND attname = 'order_id' AND NOT attisdropped)`

	// gatewayChargesSQL matches every successful charge the gateway has on
	// record, under a key it still remembers or not, with a captured posting.
	gatewayChargesSQL = `SELECT coalesce(g.id, p.reference) || ' gateway ' || coalesce(g.account_id || ' ' || g.amount_cents, 'none')
    || ' ledger ' || coalesce(p.account_id || ' ' || p.amount, 'none')
FROM (SELECT id, account_id, amount_cents FROM fake_gateway_operations WHERE op = 'charge' AND outcome = 'succeeded') g
FULL JOIN (SELECT reference, account_id, -delta_cents AS amount FROM account_postings WHERE kind = 'charge' AND reference IS NOT NULL) p
    ON p.reference = g.id AND p.account_id = g.account_id AND p.amount = g.amount_cents
WHERE g.id IS NULL OR p.reference IS NULL`

	gatewayDoubleChargesSQL = `SELECT order_id || ' charged ' || count(*) || ' times: ' || string_agg(id, ', ' ORDER BY created_at, id)
FROM fake_gateway_operations
WHERE op = 'charge' AND outcome = 'succeeded' AND order_id IS NOT NULL
GROUP BY order_id HAVING count(*) > 1`

	gatewayRefundsSQL = `SELECT coalesce(g.id, p.reference) || ' gateway ' || coalesce(g.account_id || ' ' || g.amount_cents, 'none')
    || ' ledger ' || coalesce(p.account_id || ' ' || p.amount, 'none')
FROM (SELECT id, account_id, amount_cents FROM fake_gateway_operations WHERE op = 'refund' AND outcome = 'succeeded') g
FULL JOIN (SELECT reference, account_id, delta_cents AS amount FROM account_postings WHERE kind = 'refund') p
    ON p.reference = g.id AND p.account_id = g.account_id AND p.amount = g.amount_cents
WHERE g.id IS NULL OR p.reference IS NULL`
)

// CheckSplit checks the invariants of the split sample (Config.PaymentsBroker,
// NewPaymentService) over its two databases: the sagas, orders and views in
// ordersDB; the ledger, the gateway and the payment steps' keys in
// paymentsDB. So every invariant of Check holds across them, those that
// join a saga to its money included: a completed saga's order holds
// exactly one captured charge of its amount in the payments database, a
// compensated one's nothing, and no order is charged twice.
//
// It copies the ledger (account_postings) and the fake gateway's
// operations from paymentsDB into temporary tables of a transaction on
// ordersDB, where they stand in for that database's own (unused) tables,
// runs Check's queries there and rolls the transaction back; the idempotency
// keys left pending are looked for in both databases. Nothing may move in
// either database while it runs (stop the workers first): the tables are
// read one after the other, not in one snapshot.
func CheckSplit(ctx context.Context, ordersDB, paymentsDB *sql.DB, ids []uuid.UUID) (Report, error) {
	tx, err := ordersDB.BeginTx(ctx, nil)
	if err != nil {
		return Report{}, fmt.Errorf("orderpayment: checking across databases: %w", err)
	}
	defer tx.Rollback() //nolint:errcheck // nothing of it is kept
	// The copies stand in for the tables of the same names only if the
	// search path looks in pg_temp first: a path that names it later (a
	// common hardening) would have the checks read this database's own.
	if _, err := tx.ExecContext(ctx, `SELECT set_config('search_path', 'pg_temp, ' || current_setting('search_path'), true)`); err != nil {
		return Report{}, fmt.Errorf("orderpayment: checking across databases: %w", err)
	}
	for _, table := range []string{"account_postings", "fake_gateway_operations"} {
		if err := copyTable(ctx, paymentsDB, tx, table); err != nil {
			return Report{}, fmt.Errorf("orderpayment: copying the payment service's %s: %w", table, err)
		}
	}
	r, err := check(ctx, tx, ids)
	if err != nil {
		return r, err
	}
	pending, err := sqlcheck.Rows(ctx, paymentsDB, pendingKeysSQL)
	if err != nil {
		return r, fmt.Errorf("orderpayment: checking the payment service's idempotency keys: %w", err)
	}
	if len(pending) > 0 {
		r.Violations = append(r.Violations, Violation{Invariant: "idempotency keys left pending in the payment service", Rows: firstN(pending)})
	}
	return r, nil
}

// copyTable copies table from src into a temporary table of the same name
// and columns in tx, dropped when tx ends; a table src lacks is not
// copied.
func copyTable(ctx context.Context, src *sql.DB, tx *sql.Tx, table string) error {
	var columns sql.NullString
	if err := src.QueryRowContext(ctx, tableColumnsSQL, table).Scan(&columns); err != nil {
		return err
	}
	if !columns.Valid {
		return nil
	}
	var rows string
	if err := src.QueryRowContext(ctx, `SELECT coalesce(json_agg(t), '[]')::text FROM `+table+` t`).Scan(&rows); err != nil {
		return err
	}
	if _, err := tx.ExecContext(ctx, `CREATE TEMPORARY TABLE `+table+` (`+columns.String+`) ON COMMIT DROP`); err != nil {
		return err
	}
	_, err := tx.ExecContext(ctx, `INSERT INTO pg_temp.`+table+` SELECT * FROM json_populate_recordset(NULL::pg_temp.`+table+`, $1::json)`, rows)
	return err
}

// tableColumnsSQL is the column list of table $1 as CREATE TABLE takes it,
// or NULL if there is no such table.
const tableColumnsSQL = `SELECT string_agg(quote_ident(attname) || ' ' || format_type(atttypid, atttypmod), ', ' ORDER BY attnum)
FROM pg_attribute WHERE attrelid = to_regclass($1) AND attnum > 0 AND NOT attisdropped`
