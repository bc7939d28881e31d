package orders_test

import (
	"context"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/idempotency"
	"github.com/pgsaga/pgsaga/internal/pgdb"
	"github.com/pgsaga/pgsaga/internal/stepsrt"
	"github.com/pgsaga/pgsaga/internal/testdb"
	"github.com/pgsaga/pgsaga/internal/transport"
	"github.com/pgsaga/pgsaga/orders"
	"github.com/pgsaga/pgsaga/saga/delivery"
	"github.com/pgsaga/pgsaga/steps"
	"github.com/pgsaga/pgsaga/steps/events"
)

// foldCounter counts the reads of an event stream.
type foldCounter struct{ n atomic.Int64 }

func (c *foldCounter) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	if strings.Contains(d.SQL, "FROM domain_events WHERE stream_id") && strings.Contains(d.SQL, "ORDER BY version") {
		c.n.Add(1)
	}
	return ctx
}

func (*foldCounter) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

// An inline projection applies an appended event to the state its
// appender read, instead of reading the stream again: placing an order
// reads no stream, confirming or cancelling one reads it once (the step's
// own load), and the views are what a rebuild from the streams makes.
func TestInlineProjectionAppliesTheAppendersState(t *testing.T) {
	t.Parallel()
	db := testdb.Fresh(t)
	ctx := context.Background()
	var folds foldCounter
	pool, err := pgdb.Open(ctx, pgdb.Config{URL: db.URL, MaxConns: 4, Tracer: &folds})
	require.NoError(t, err)
	defer pool.Close()
	tr, err := transport.New(transport.Config{DB: pool.SQL, Logger: logger(), IdlePollInterval: testdb.NoSafetyPoll})
	require.NoError(t, err)
	store, err := idempotency.NewStore(idempotency.Config{DB: pool.SQL})
	require.NoError(t, err)
	reg := events.NewRegistry()
	require.NoError(t, orders.RegisterEvents(reg))
	var svc *orders.Service
	es, err := events.NewStore(events.Config{Registry: reg, Topic: orders.StreamTopic,
		// What saga.Client does for an inline projection.
		Project: func(ctx context.Context, tx delivery.DBTX, _ string, msgs []*message.Message) error {
			for _, m := range msgs {
				if err := svc.Project(m.Context(), tx, m); err != nil {
					return err
				}
			}
			return nil
		}})
	require.NoError(t, err)
	rt, err := stepsrt.New(stepsrt.Config{Transport: tr, Store: store, Events: es, Logger: logger()})
	require.NoError(t, err)
	svc, err = orders.New(orders.Config{DB: pool.SQL, Publish: publish(tr), Idempotency: store, Events: es, Logger: logger()})
	require.NoError(t, err)
	replies := "replies_inline"
	require.NoError(t, tr.Subscribe(ctx, append([]transport.Subscription{{Topic: orders.EventsTopic, ConsumerGroup: orders.ProjectionName}}, transport.Subscription{Topic: replies, ConsumerGroup: "reader"})...))
	cust := "cust-inline"
	require.NoError(t, svc.AddCustomer(ctx, cust, "Inline"))

	step := func(s steps.AnyStep, cmd steps.Message, key string) {
		t.Helper()
		msg, err := steps.NewMessage(cmd, steps.Envelope{Key: key, ReplyTo: replies})
		require.NoError(t, err)
		require.NoError(t, rt.Execute(ctx, s, msg))
	}
	var ids []uuid.UUID
	for i := range 4 {
		res, err := svc.Place(ctx, orders.PlaceRequest{Key: "inline-" + string(rune('a'+i)), CustomerID: cust, AmountCents: int64(100 + i)})
		require.NoError(t, err)
		ids = append(ids, res.OrderID)
	}
	assert.Zero(t, folds.n.Load(), "placing reads no stream")
	before := folds.n.Load()
	o1, o2, o3 := ids[1], ids[2], ids[3]
	step(svc.ConfirmStep(), orders.ConfirmOrder{OrderID: o1}, "confirm-1")
	step(svc.ConfirmStep(), orders.ConfirmOrder{OrderID: o3}, "confirm-3")
	step(svc.CancelStep(), orders.CancelOrder{OrderID: o3, Reason: "inventory"}, "cancel-3")
	// A reason that is not UTF-8 is stored, and projected, as a fold
	// reads it back: with U+FFFD in its place.
	require.NoError(t, svc.CancelByCustomer(ctx, o2, "changed my mind \xff"))
	assert.Equal(t, int64(4), folds.n.Load()-before, "one read each: the step's or the cancellation's own load")

	// The views are what the streams say.
	e := &env{t: t, db: db}
	projected := views(t, e)
	n, err := svc.RebuildViews(ctx)
	require.NoError(t, err)
	require.Equal(t, 4, n)
	assert.Equal(t, views(t, e), projected)
	assert.Equal(t, 1, e.count(`SELECT count(*) FROM order_views WHERE status = 'confirmed'`))
	assert.Equal(t, 2, e.count(`SELECT count(*) FROM order_views WHERE status = 'cancelled'`))
}
