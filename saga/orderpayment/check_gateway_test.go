package orderpayment_test

import (
	"context"
	"strings"
	"testing"

	"github.com/google/uuid"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/payments"
	"github.com/pgsaga/pgsaga/saga"
	"github.com/pgsaga/pgsaga/saga/orderpayment"
)

// The checks of the gateway against the ledger, by name.
const (
	orphanedCharges = "gateway charges and captured postings that do not match"
	doubleCharges   = "orders charged more than once at the gateway"
)

// violation returns the rows of the violation of invariant, and whether
// it was reported.
func violation(r orderpayment.Report, invariant string) ([]string, bool) {
	for _, v := range r.Violations {
		if strings.HasPrefix(v.Invariant, invariant) {
			return v.Rows, true
		}
	}
	return nil, false
}

func anyContains(rows []string, s string) bool {
	for _, r := range rows {
		if strings.Contains(r, s) {
			return true
		}
	}
	return false
}

// A gateway that forgot the key of a saga's charge charges the order again
// when the key comes back (the case a late redelivery used to hit). The
// checker reports the charge the ledger has no posting for, and the order
// charged twice at the gateway; and if the ledger's reference had been
// overwritten with the second charge (as it used to be), the first one,
// made under the forgotten key, is the orphan: the gateway keeps it on
// record and the checker still sees it.
func TestCheckCatchesOrphanedAndDoubleGatewayCharges(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 1, nil)
	ctx := context.Background()
	cust := e.customer(10_000)
	orderID, sagaID := e.place(cust, 1_000)
	require.Equal(t, saga.StatusCompleted, e.terminal(sagaID).Status)
	e.checkInvariants(nil)

	var key, first string
	require.NoError(t, e.db.SQL.QueryRow(`SELECT request_key, reference FROM account_postings WHERE order_id = $1 AND kind = 'charge'`, orderID).
		Scan(&key, &first))
	forgotten, err := e.gw.ForgetKeys(ctx, key)
	require.NoError(t, err)
	require.Equal(t, 1, forgotten)
	client := &payments.GatewayClient{BaseURL: e.gw.URL()}
	second, err := client.Charge(ctx, key, cust, orderID, 1_000)
	require.NoError(t, err)
	require.NotEqual(t, first, second, "the gateway charged again")

	check := func() orderpayment.Report {
		t.Helper()
		r, err := orderpayment.Check(ctx, e.db.SQL, nil)
		require.NoError(t, err)
		return r
	}
	r := check()
	rows, ok := violation(r, orphanedCharges)
	require.True(t, ok, "the orphaned charge is reported; got %v", r.Violations)
	assert.True(t, anyContains(rows, second), "%v", rows)
	assert.False(t, anyContains(rows, first), "the ledger's charge matches: %v", rows)
	rows, ok = violation(r, doubleCharges)
	require.True(t, ok, "the double charge is reported; got %v", r.Violations)
	assert.True(t, anyContains(rows, orderID.String()), "%v", rows)

	// The ledger overwritten with the second charge: the first, under the
	// forgotten key, is the orphan.
	_, err = e.db.SQL.Exec(`UPDATE account_postings SET reference = $2 WHERE order_id = $1 AND kind = 'charge'`, orderID, second)
	require.NoError(t, err)
	r = check()
	rows, ok = violation(r, orphanedCharges)
	require.True(t, ok, "the forgotten charge is reported; got %v", r.Violations)
	assert.True(t, anyContains(rows, first), "%v", rows)
	assert.False(t, anyContains(rows, second), "%v", rows)
	_, ok = violation(r, doubleCharges)
	assert.True(t, ok, "still charged twice; got %v", r.Violations)

	// A charge of an order the ledger never heard of is an orphan, charged
	// once.
	lone := uuid.New()
	third, err := client.Charge(ctx, "lone-"+lone.String(), cust, lone, 500)
	require.NoError(t, err)
	r = check()
	rows, _ = violation(r, orphanedCharges)
	assert.True(t, anyContains(rows, third), "%v", rows)
	rows, _ = violation(r, doubleCharges)
	assert.False(t, anyContains(rows, lone.String()), "%v", rows)
}
