package orderpayment_test

import (
	"context"
	"strings"
	"testing"

	"github.com/google/uuid"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/saga"
	"github.com/pgsaga/pgsaga/saga/orderpayment"
)

// The checker notices each kind of broken state, with the offending rows.
func TestCheckCatchesBrokenStates(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 1, nil)
	ctx := context.Background()
	cust := e.customer(10_000)
	_, paid := e.place(cust, 1_000)
	require.Equal(t, saga.StatusCompleted, e.terminal(paid).Status)
	r := e.checkInvariants(nil)
	require.True(t, r.OK())

	violated := func(what string, breakIt, repair string) {
		t.Helper()
		_, err := e.db.SQL.Exec(breakIt)
		require.NoError(t, err, what)
		r, err := orderpayment.Check(ctx, e.db.SQL, nil)
		require.NoError(t, err)
		found := false
		for _, v := range r.Violations {
			found = found || strings.Contains(v.Invariant, what)
		}
		assert.True(t, found, "%s not reported; got %v", what, r.Violations)
		_, err = e.db.SQL.Exec(repair)
		require.NoError(t, err, what)
	}
	violated("parked as failed",
		`UPDATE saga_instances SET status = 'failed' WHERE id = '`+paid.String()+`'`,
		`UPDATE saga_instances SET status = 'completed' WHERE id = '`+paid.String()+`'`)
	violated("does not match",
		`UPDATE saga_instances SET status = 'compensated' WHERE id = '`+paid.String()+`'`,
		`UPDATE saga_instances SET status = 'completed' WHERE id = '`+paid.String()+`'`)
	violated("left pending",
		`INSERT INTO idempotency_keys (scope, key, request_hash) VALUES ('x', 'y', '\x01')`,
		`DELETE FROM idempotency_keys WHERE scope = 'x'`)
	violated("exactly one net charge",
		`UPDATE account_postings SET delta_cents = delta_cents - 1 WHERE kind = 'charge'`,
		`UPDATE account_postings SET delta_cents = delta_cents + 1 WHERE kind = 'charge'`)
	violated("gateway charges and captured postings",
		`UPDATE fake_gateway_operations SET amount_cents = amount_cents + 1 WHERE op = 'charge'`,
		`UPDATE fake_gateway_operations SET amount_cents = amount_cents - 1 WHERE op = 'charge'`)
	violated("below zero",
		`INSERT INTO account_postings (account_id, event_id, delta_cents, order_id, kind) VALUES ('`+cust+`', '`+uuid.NewString()+`', -100000, '`+uuid.NewString()+`', 'charge')`,
		`DELETE FROM account_postings WHERE delta_cents = -100000`)
	violated("without a saga",
		`INSERT INTO domain_events (event_id, stream_id, version, event_type, payload) VALUES ('`+uuid.NewString()+`', 'order-x', 1, 'orders.placed', '{"order_id": "`+uuid.NewString()+`"}')`,
		`DELETE FROM domain_events WHERE stream_id = 'order-x'`)
	violated("order views ahead",
		`UPDATE order_views SET version = version + 1`,
		`UPDATE order_views SET version = version - 1`)
	violated("order views ahead",
		`UPDATE order_views SET status = 'placed'`,
		`UPDATE order_views SET status = 'confirmed'`)
	e.checkInvariants(nil)
}

// A saga never started is reported with where its trigger is: queued (and
// how often it failed), dead-lettered (and why), or nowhere.
func TestCheckSaysWhereTheTriggerOfAnUnstartedSagaIs(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 0, func(c *orderpayment.Config) { c.QueueEveryHop = true }) // the trigger is queued, and no worker runs
	orderID, sagaID := e.place(e.customer(10_000), 1_000)
	where := func() []string {
		t.Helper()
		r, err := orderpayment.Check(context.Background(), e.db.SQL, []uuid.UUID{sagaID})
		require.NoError(t, err)
		for _, v := range r.Violations {
			if strings.Contains(v.Invariant, "never started") {
				return v.Rows
			}
		}
		t.Fatalf("no saga reported as never started: %v", r.Violations)
		return nil
	}
	prefix := "order " + orderID.String() + ": "
	assert.Equal(t, []string{prefix + "trigger queued for saga.order-payment.trigger after 0 failed attempts"}, where())
	_, err := e.db.SQL.Exec(`WITH q AS (DELETE FROM pgsaga_queue WHERE topic = 'orders.created' RETURNING *)
INSERT INTO pgsaga_dead_letters (uuid, topic, consumer_group, handler, payload, metadata, reason, attempts, created_at)
SELECT uuid, topic, consumer_group, consumer_group, payload, metadata, 'it broke', 1, created_at FROM q`)
	require.NoError(t, err)
	var trigger string
	require.NoError(t, e.db.SQL.QueryRow(`SELECT uuid FROM pgsaga_dead_letters WHERE topic = 'orders.created'`).Scan(&trigger))
	assert.Equal(t, []string{prefix + "trigger " + trigger + " dead-lettered after 1 attempts: it broke"}, where())
	_, err = e.db.SQL.Exec(`DELETE FROM pgsaga_dead_letters WHERE topic = 'orders.created'`)
	require.NoError(t, err)
	assert.Equal(t, []string{prefix + "no trigger queued or dead-lettered"}, where())
}
