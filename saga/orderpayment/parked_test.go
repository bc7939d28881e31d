package orderpayment_test

import (
	"context"
	"fmt"
	"strings"
	"testing"

	"github.com/google/uuid"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/payments/fakegateway"
	"github.com/pgsaga/pgsaga/saga"
	"github.com/pgsaga/pgsaga/saga/orderpayment"
)

// A refund the gateway declines parks the saga with its charge held. The
// checker accepts that saga as explained (Report.Parked) and reports it as
// a violation as soon as anything else about it is off: another reason, a
// ledger that no longer holds the charge, a gateway that declined no refund
// of it or refunded it. An operator's retry, once the gateway refunds,
// compensates it, refunding once.
func TestDeclinedRefundParksTheSaga(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	e := newEnv(t, 0, nil)
	e.mu.Lock()
	e.faults = func(c fakegateway.Call) fakegateway.Fault {
		if c.Op == "refund" {
			return fakegateway.Decline
		}
		return fakegateway.None
	}
	e.mu.Unlock()
	cust := e.customer(10_000)
	orderID, sagaID := e.place(cust, 3_000)
	require.NoError(t, e.app.Orders.CancelByCustomer(ctx, orderID, "changed my mind"))
	e.startWorker()
	inst := e.terminal(sagaID)
	require.Equal(t, saga.StatusFailed, inst.Status)
	assert.Equal(t, "confirm: order cancelled by customer; then "+orderpayment.ParkedByDeclinedRefund, inst.FailureReason)
	assert.Equal(t, int64(7_000), e.balance(cust), "the charge stays held")
	r := e.checkInvariants([]uuid.UUID{sagaID})
	assert.Equal(t, []orderpayment.Parked{{ID: sagaID, Reason: inst.FailureReason}}, r.Parked)
	assert.Equal(t, 1, r.Sagas[saga.StatusFailed])
	e.checkInvariants(nil)

	var chargeID string
	require.NoError(t, e.db.SQL.QueryRow(`SELECT reference FROM account_postings WHERE order_id = $1 AND kind = 'charge'`, orderID).Scan(&chargeID))
	unexplained := func(why, breakIt, repair string, args ...any) {
		t.Helper()
		_, err := e.db.SQL.Exec(breakIt, args...)
		require.NoError(t, err, why)
		r, err := orderpayment.Check(ctx, e.db.SQL, []uuid.UUID{sagaID})
		require.NoError(t, err)
		found := false
		for _, v := range r.Violations {
			found = found || strings.Contains(v.Invariant, "parked as failed") && strings.Contains(fmt.Sprint(v.Rows), why)
		}
		assert.True(t, found, "%s: not reported; got %v", why, r.Violations)
		assert.Empty(t, r.Parked, why)
		_, err = e.db.SQL.Exec(repair, args...)
		require.NoError(t, err, why)
	}
	unexplained("not parked by a declined refund",
		`UPDATE saga_instances SET failure_reason = failure_reason || '!' WHERE id = $1`,
		`UPDATE saga_instances SET failure_reason = rtrim(failure_reason, '!') WHERE id = $1`, sagaID)
	unexplained("the ledger does not hold its charge",
		`INSERT INTO account_postings (account_id, event_id, delta_cents, order_id, kind) VALUES ($1, gen_random_uuid(), 3000, $2, 'refund')`,
		`DELETE FROM account_postings WHERE account_id = $1 AND order_id = $2 AND kind = 'refund'`, cust, orderID)
	unexplained("the gateway declined no refund of its charge",
		`UPDATE fake_gateway_operations SET charge_id = charge_id || '-elsewhere' WHERE op = 'refund' AND charge_id = $1`,
		`UPDATE fake_gateway_operations SET charge_id = $1 WHERE op = 'refund' AND charge_id = $1 || '-elsewhere'`, chargeID)
	unexplained("the gateway refunded its charge",
		`INSERT INTO fake_gateway_operations (key, op, account_id, amount_cents, charge_id, outcome, id) VALUES ('stray', 'refund', 'x', 1, $1, 'succeeded', 're_stray')`,
		`DELETE FROM fake_gateway_operations WHERE key = 'stray' AND charge_id = $1`, chargeID)
	e.checkInvariants([]uuid.UUID{sagaID})

	// The cause fixed, an operator retries: refunded once, compensated.
	e.mu.Lock()
	e.faults = nil
	e.mu.Unlock()
	require.NoError(t, e.app.Client.Retry(ctx, sagaID))
	inst = e.terminal(sagaID)
	require.Equal(t, saga.StatusCompensated, inst.Status)
	assert.Equal(t, int64(10_000), e.balance(cust), "refunded")
	r = e.checkInvariants(nil)
	assert.Empty(t, r.Parked)
	stats, err := e.gw.Stats(ctx)
	require.NoError(t, err)
	assert.Equal(t, []int{1, 1, 1}, []int{stats.Charges, stats.Refunds, stats.Declines}, "charges, refunds, declines")
}
