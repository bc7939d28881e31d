package fakegateway_test

import (
	"context"
	"net/http"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/internal/testdb"
	"github.com/pgsaga/pgsaga/payments"
	"github.com/pgsaga/pgsaga/payments/fakegateway"
)

// A gateway started later on the same database (as by a later process, on
// another port) knows the charges an earlier one made: it refunds them, and
// refuses refunds of charges it never made, of another account's charge, or
// of more than was charged. A decline is kept by key across gateways too.
func TestLaterGatewayRefundsEarlierCharge(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.Fresh(t)
	client := func(g *fakegateway.Gateway) *payments.GatewayClient {
		return &payments.GatewayClient{BaseURL: g.URL(), HTTP: &http.Client{Timeout: 5 * time.Second}}
	}
	order := uuid.New()
	declineRefunds := func(c fakegateway.Call) fakegateway.Fault {
		if c.Op == "refund" {
			return fakegateway.Decline
		}
		return fakegateway.None
	}

	first, err := fakegateway.Start(ctx, fakegateway.Config{DB: db.SQL, Faults: declineRefunds})
	require.NoError(t, err)
	chargeID, err := client(first).Charge(ctx, "charge-1", "acct-1", order, 700)
	require.NoError(t, err)
	_, err = client(first).Refund(ctx, "refund-1", "acct-1", chargeID, 700)
	require.ErrorIs(t, err, payments.ErrDeclined)
	firstURL := first.URL()
	require.NoError(t, first.Close())

	later, err := fakegateway.Start(ctx, fakegateway.Config{DB: db.SQL})
	require.NoError(t, err)
	defer later.Close()
	require.NotEqual(t, firstURL, later.URL())
	_, err = client(later).Refund(ctx, "refund-1", "acct-1", chargeID, 700)
	assert.ErrorIs(t, err, payments.ErrDeclined, "a declined key stays declined")

	for name, c := range map[string]struct {
		account, charge string
		cents           int64
	}{
		"unknown charge":    {"acct-1", "ch_unknown", 700},
		"another account":   {"acct-2", chargeID, 700},
		"more than charged": {"acct-1", chargeID, 701},
	} {
		_, err := client(later).Refund(ctx, "bad-"+name, c.account, c.charge, c.cents)
		assert.ErrorIs(t, err, payments.ErrBadGatewayRequest, name)
	}

	refundID, err := client(later).Refund(ctx, "refund-2", "acct-1", chargeID, 700)
	require.NoError(t, err)
	assert.Regexp(t, `^re_`, refundID)
	op, ok, err := later.Operation(ctx, "refund-2")
	require.NoError(t, err)
	require.True(t, ok)
	assert.Equal(t, "succeeded", op.Outcome)

	st, err := later.Stats(ctx)
	require.NoError(t, err)
	assert.Equal(t, 1, st.Charges)
	assert.Equal(t, 1, st.Refunds)
	assert.Equal(t, int64(700), st.RefundedCents)
	assert.Equal(t, 1, st.Declines)
	assert.Equal(t, 4, st.Calls, "refused requests are no calls")
}
