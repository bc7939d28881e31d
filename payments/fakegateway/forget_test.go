package fakegateway_test

import (
	"bytes"
	"context"
	"encoding/json"
	"net/http"
	"testing"

	"github.com/google/uuid"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/internal/testdb"
	"github.com/pgsaga/pgsaga/payments/fakegateway"
)

// chargeOrder posts a charge with the order id as metadata, as
// payments.GatewayClient does.
func chargeOrder(t *testing.T, url, key, order string, cents int64) (int, string) {
	t.Helper()
	body, err := json.Marshal(map[string]any{"account_id": "a1", "amount_cents": cents, "order_id": order})
	require.NoError(t, err)
	req, err := http.NewRequest(http.MethodPost, url+"/v1/charges", bytes.NewReader(body))
	require.NoError(t, err)
	req.Header.Set("Idempotency-Key", key)
	resp, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	var out struct{ ID string }
	require.NoError(t, json.NewDecoder(resp.Body).Decode(&out))
	return resp.StatusCode, out.ID
}

// A gateway that forgot a key charges again when the key comes back, and
// keeps the record of both charges: the money moved twice.
func TestForgottenKeyChargesAgain(t *testing.T) {
	t.Parallel()
	db := testdb.Shared(t)
	ctx := context.Background()
	g, err := fakegateway.Start(ctx, fakegateway.Config{DB: db.SQL})
	require.NoError(t, err)
	defer g.Close()
	key, order, other := uuid.NewString(), uuid.NewString(), uuid.NewString()

	code, first := chargeOrder(t, g.URL(), key, order, 700)
	require.Equal(t, http.StatusOK, code)
	op, ok, err := g.Operation(ctx, key)
	require.NoError(t, err)
	require.True(t, ok)
	assert.Equal(t, order, op.OrderID, "the order id sent as metadata is recorded")

	_, again := chargeOrder(t, g.URL(), key, order, 700)
	assert.Equal(t, first, again, "remembered: the same charge")

	// Another key is not forgotten with it.
	otherKey := uuid.NewString()
	_, kept := chargeOrder(t, g.URL(), otherKey, other, 100)

	n, err := g.ForgetKeys(ctx, key)
	require.NoError(t, err)
	assert.Equal(t, 1, n)
	_, ok, err = g.Operation(ctx, key)
	require.NoError(t, err)
	assert.False(t, ok, "the key no longer finds its operation")

	code, second := chargeOrder(t, g.URL(), key, order, 700)
	require.Equal(t, http.StatusOK, code)
	assert.NotEqual(t, first, second, "a forgotten key is a new charge")
	op, ok, err = g.Operation(ctx, key)
	require.NoError(t, err)
	require.True(t, ok)
	assert.Equal(t, second, op.ID)
	assert.Equal(t, 3, op.Calls, "the key's calls are all counted, before and after forgetting")

	var charges int
	var ids []byte
	require.NoError(t, db.SQL.QueryRow(`SELECT count(*), json_agg(id ORDER BY created_at) FROM fake_gateway_operations
		WHERE order_id = $1 AND op = 'charge' AND outcome = 'succeeded'`, order).Scan(&charges, &ids))
	assert.Equal(t, 2, charges, "both charges stay on record")
	assert.JSONEq(t, `["`+first+`", "`+second+`"]`, string(ids))

	_, still := chargeOrder(t, g.URL(), otherKey, other, 100)
	assert.Equal(t, kept, still, "other keys are remembered")
	n, err = g.ForgetKeys(ctx, key)
	require.NoError(t, err)
	assert.Equal(t, 1, n, "forgetting the key again forgets only its new operation")
}

// A gateway started on a database whose tables predate the order id gets
// the column, and keeps serving the operations it had.
func TestStartAddsOrderIDToExistingTables(t *testing.T) {
	t.Parallel()
	db := testdb.Empty(t)
	ctx := context.Background()
	_, err := db.SQL.Exec(`
CREATE TABLE fake_gateway_operations (
    key          text        PRIMARY KEY,
    op           text        NOT NULL,
    account_id   text        NOT NULL,
    amount_cents bigint      NOT NULL,
    charge_id    text,
    outcome      text        NOT NULL,
    id           text        NOT NULL,
    created_at   timestamptz NOT NULL DEFAULT now()
);
INSERT INTO fake_gateway_operations (key, op, account_id, amount_cents, outcome, id)
VALUES ('old-key', 'charge', 'a1', 100, 'succeeded', 'ch_old');`)
	require.NoError(t, err)
	g, err := fakegateway.Start(ctx, fakegateway.Config{DB: db.SQL})
	require.NoError(t, err)
	defer g.Close()

	op, ok, err := g.Operation(ctx, "old-key")
	require.NoError(t, err)
	require.True(t, ok)
	assert.Equal(t, "ch_old", op.ID)
	assert.Empty(t, op.OrderID)

	order := uuid.NewString()
	code, id := chargeOrder(t, g.URL(), "new-key", order, 200)
	require.Equal(t, http.StatusOK, code)
	op, _, err = g.Operation(ctx, "new-key")
	require.NoError(t, err)
	assert.Equal(t, id, op.ID)
	assert.Equal(t, order, op.OrderID)
}
