package orders_test

import (
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/internal/testdb"
	"github.com/pgsaga/pgsaga/internal/transport"
	"github.com/pgsaga/pgsaga/orders"
)

func jsonUnmarshal(s string, v any) error { return json.Unmarshal([]byte(s), v) }

// views renders order_views, for comparison.
func views(t *testing.T, e *env) string {
	t.Helper()
	rows, err := e.db.SQL.Query(`SELECT order_id, customer_id, amount_cents, status, version, placed_at, confirmed_at,
		cancelled_at, cancelled_by, cancel_reason, updated_at FROM order_views ORDER BY order_id`)
	require.NoError(t, err)
	defer rows.Close()
	var b strings.Builder
	for rows.Next() {
		vals := make([]any, 11)
		ptrs := make([]any, 11)
		for i := range vals {
			ptrs[i] = &vals[i]
		}
		require.NoError(t, rows.Scan(ptrs...))
		fmt.Fprintln(&b, vals...)
	}
	require.NoError(t, rows.Err())
	return b.String()
}

// consume runs the projection on topic until its queue is empty.
func consume(t *testing.T, e *env, topic string) {
	t.Helper()
	r, err := e.tr.NewRouter()
	require.NoError(t, err)
	require.NoError(t, r.AddHandler("projection-"+topic, topic, orders.ProjectionName, func(msg *message.Message) error {
		tx, _ := transport.TxFromContext(msg.Context())
		return e.svc.Project(msg.Context(), tx, msg)
	}))
	require.NoError(t, r.Start(context.Background()))
	deadline := time.Now().Add(30 * time.Second)
	for {
		n := e.count(`SELECT count(*) FROM pgsaga_queue WHERE topic = $1 AND consumer_group = $2`, topic, orders.ProjectionName)
		if n == 0 {
			break
		}
		require.True(t, time.Now().Before(deadline), "projection did not catch up (%d left)", n)
		time.Sleep(10 * time.Millisecond)
	}
	require.NoError(t, r.Stop())
	require.Zero(t, e.count(`SELECT count(*) FROM pgsaga_dead_letters WHERE topic = $1`, topic), "nothing dead-lettered")
}

// The projection converges to the same order_views whether events arrive
// once and in order, or duplicated, reordered and replayed; and a rebuild
// from the event store from scratch gives the same table.
func TestProjectionToleratesDuplicatesAndReordering(t *testing.T) {
	t.Parallel()
	e := newEnv(t, testdb.Fresh(t))
	ctx := context.Background()
	cust := e.customer()
	seed := uint64(time.Now().UnixNano())
	t.Logf("seed %d", seed)
	rng := rand.New(rand.NewPCG(seed, 1))

	// A mix of histories: placed; confirmed; cancelled by customer;
	// confirmed then cancelled by the saga.
	for i := range 16 {
		id := e.place(cust, int64(100+i))
		switch i % 4 {
		case 1:
			e.run(e.svc.ConfirmStep(), orders.ConfirmOrder{OrderID: id}, "confirm-"+id.String())
		case 2:
			require.NoError(t, e.svc.CancelByCustomer(ctx, id, "changed my mind"))
		case 3:
			e.run(e.svc.ConfirmStep(), orders.ConfirmOrder{OrderID: id}, "confirm-"+id.String())
			e.run(e.svc.CancelStep(), orders.CancelOrder{OrderID: id, Reason: "inventory"}, "cancel-"+id.String())
		}
	}

	// A clean run: every event once, in order.
	consume(t, e, orders.EventsTopic)
	clean := views(t, e)
	require.Equal(t, 16, e.count(`SELECT count(*) FROM order_views`))
	require.Equal(t, 4, e.count(`SELECT count(*) FROM order_views WHERE status = 'confirmed'`))
	require.Equal(t, 8, e.count(`SELECT count(*) FROM order_views WHERE status = 'cancelled'`))

	// A chaotic run: the same events shuffled, about half duplicated, then
	// everything replayed once more.
	rows, err := e.db.SQL.Query(`SELECT uuid, payload, metadata::text FROM pgsaga_queue WHERE topic = $1 AND consumer_group = 'archive' ORDER BY id`, orders.EventsTopic)
	require.NoError(t, err)
	var msgs []*message.Message
	for rows.Next() {
		var id, meta string
		var payload []byte
		require.NoError(t, rows.Scan(&id, &payload, &meta))
		m := message.NewMessage(id, payload)
		require.NoError(t, jsonUnmarshal(meta, &m.Metadata))
		msgs = append(msgs, m)
		if rng.IntN(2) == 0 {
			msgs = append(msgs, m.Copy())
		}
	}
	require.NoError(t, rows.Close())
	rng.Shuffle(len(msgs), func(i, j int) { msgs[i], msgs[j] = msgs[j], msgs[i] })
	replay := make([]*message.Message, 0, len(msgs))
	for _, m := range msgs {
		replay = append(replay, m.Copy())
	}
	msgs = append(msgs, replay...)

	chaos := "orders.events.chaos"
	require.NoError(t, e.tr.Subscribe(ctx, transport.Subscription{Topic: chaos, ConsumerGroup: orders.ProjectionName}))
	_, err = e.db.SQL.Exec(`DELETE FROM order_views`)
	require.NoError(t, err)
	for start := 0; start < len(msgs); start += 7 { // several transactions, several batches
		require.NoError(t, e.tr.Publisher(e.db.SQL).Publish(chaos, msgs[start:min(start+7, len(msgs))]...))
	}
	consume(t, e, chaos)
	assert.Equal(t, clean, views(t, e), "duplicated, reordered and replayed events give the same views")

	n, err := e.svc.RebuildViews(ctx)
	require.NoError(t, err)
	assert.Equal(t, 16, n)
	assert.Equal(t, clean, views(t, e), "a rebuild from scratch gives the same views")

	v, err := e.svc.View(ctx, mustFirstOrder(t, e))
	require.NoError(t, err)
	assert.NotEmpty(t, v.CustomerID)
}

func mustFirstOrder(t *testing.T, e *env) (id uuid.UUID) {
	require.NoError(t, e.db.SQL.QueryRow(`SELECT order_id FROM order_views ORDER BY order_id LIMIT 1`).Scan(&id))
	return id
}

// A message that is not an order event is refused permanently.
func TestProjectionRefusesForeignMessages(t *testing.T) {
	t.Parallel()
	e := newEnv(t, testdb.Shared(t))
	m := message.NewMessage("x", []byte(`{}`))
	err := e.svc.Project(context.Background(), e.db.SQL, m)
	require.True(t, transport.IsPermanent(err), "%v", err)
}
