package orders_test

import (
	"context"
	"testing"

	"github.com/google/uuid"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/internal/testdb"
	"github.com/pgsaga/pgsaga/internal/testlost"
	"github.com/pgsaga/pgsaga/orders"
)

// The orders' writes ride out a connection lost under them, and happen
// once: killed in their transaction (nothing of it commits; the retry does
// the work), or cut off once their COMMIT is sent (the server commits, the
// answer never comes; the retry finds the work done).
func TestWritesRetryALostConnection(t *testing.T) {
	t.Parallel()
	ctx := context.Background()

	t.Run("Place, terminated in its transaction", func(t *testing.T) {
		t.Parallel()
		e := newEnv(t, testdb.Shared(t))
		req := orders.PlaceRequest{Key: "k-" + uuid.NewString(), CustomerID: e.customer(), AmountCents: 1500}
		var res orders.PlaceResult
		err := testlost.Terminated(t, e.db, `INSERT INTO idempotency_keys (scope, key, request_hash) VALUES ($1, $2, '\x00')`,
			[]any{"orders.place:" + req.CustomerID, req.Key}, func() (err error) {
				res, err = e.svc.Place(ctx, req)
				return err
			})
		require.NoError(t, err)
		assert.False(t, res.Replayed, "the first attempt left nothing")
		assertPlacedOnce(t, e, req.CustomerID, res.OrderID)
	})

	t.Run("Place, cut once its COMMIT is sent", func(t *testing.T) {
		t.Parallel()
		db := testlost.OpenCuttable(t, testdb.Shared(t), 4)
		e := newEnv(t, db.DB)
		req := orders.PlaceRequest{Key: "k-" + uuid.NewString(), CustomerID: e.customer(), AmountCents: 1500}
		db.CutAfter(testlost.Commits...)
		res, err := e.svc.Place(ctx, req)
		require.NoError(t, err)
		assert.True(t, db.Cut(), "a COMMIT was cut off")
		assert.True(t, res.Replayed, "the order the lost COMMIT placed")
		assertPlacedOnce(t, e, req.CustomerID, res.OrderID)
	})

	t.Run("AddCustomer, terminated", func(t *testing.T) {
		t.Parallel()
		e := newEnv(t, testdb.Shared(t))
		id := "cust-" + uuid.NewString()[:8]
		err := testlost.Terminated(t, e.db, `INSERT INTO customers (customer_id, name) VALUES ($1, 'held')`, []any{id}, func() error {
			return e.svc.AddCustomer(ctx, id, "Lost Connection")
		})
		require.NoError(t, err)
		assert.Equal(t, 1, e.count(`SELECT count(*) FROM customers WHERE customer_id = $1 AND name = 'Lost Connection'`, id))
	})

	t.Run("CancelByCustomer, terminated", func(t *testing.T) {
		t.Parallel()
		e := newEnv(t, testdb.Shared(t))
		order := e.place(e.customer(), 1500)
		err := testlost.Terminated(t, e.db, `INSERT INTO domain_events (event_id, stream_id, version, event_type, payload) VALUES (gen_random_uuid(), $1, 2, 'test.held', '{}')`,
			[]any{orders.Stream(order)}, func() error {
				return e.svc.CancelByCustomer(ctx, order, "changed their mind")
			})
		require.NoError(t, err)
		assertCancelledOnce(t, e, order)
	})

	t.Run("CancelByCustomer, cut once its COMMIT is sent", func(t *testing.T) {
		t.Parallel()
		db := testlost.OpenCuttable(t, testdb.Shared(t), 4)
		e := newEnv(t, db.DB)
		order := e.place(e.customer(), 1500)
		db.CutAfter(testlost.Commits...)
		require.NoError(t, e.svc.CancelByCustomer(ctx, order, "changed their mind"))
		assert.True(t, db.Cut(), "a COMMIT was cut off")
		assertCancelledOnce(t, e, order)
	})
}

// assertPlacedOnce checks that customer has one order, id, with one
// OrderCreated.
func assertPlacedOnce(t *testing.T, e *env, customer string, id uuid.UUID) {
	t.Helper()
	assert.Equal(t, 1, e.count(`SELECT count(*) FROM domain_events WHERE event_type = 'orders.placed' AND payload->>'customer_id' = $1`, customer), "one order")
	assert.Equal(t, 1, e.count(`SELECT count(*) FROM domain_events WHERE event_type = 'orders.placed' AND payload->>'order_id' = $1`, id.String()), "it is the one returned")
	assert.Equal(t, 1, e.count(`SELECT count(*) FROM pgsaga_queue WHERE topic = $1 AND consumer_group = 'reader' AND convert_from(payload, 'UTF8') LIKE '%' || $2 || '%'`,
		orders.CreatedTopic, customer), "one OrderCreated")
}

// assertCancelledOnce checks that order was cancelled, once.
func assertCancelledOnce(t *testing.T, e *env, order uuid.UUID) {
	t.Helper()
	o, err := e.svc.Order(context.Background(), order)
	require.NoError(t, err)
	assert.Equal(t, orders.StatusCancelled, o.Status)
	assert.Equal(t, 2, o.Version, "placed, then cancelled once")
}
