package orders_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/idempotency"
	"github.com/pgsaga/pgsaga/internal/stepsrt"
	"github.com/pgsaga/pgsaga/internal/testdb"
	"github.com/pgsaga/pgsaga/internal/testout"
	"github.com/pgsaga/pgsaga/internal/testpg"
	"github.com/pgsaga/pgsaga/internal/testsample"
	"github.com/pgsaga/pgsaga/internal/transport"
	"github.com/pgsaga/pgsaga/orders"
	"github.com/pgsaga/pgsaga/saga/delivery"
	"github.com/pgsaga/pgsaga/steps"
	"github.com/pgsaga/pgsaga/steps/events"
)

func TestMain(m *testing.M) { testpg.Main(m, testsample.Schemas()...) }

// logger is the tests' logger (PGSAGA_TEST_LOG shows it).
var logger = testout.Logger

type env struct {
	t       *testing.T
	db      *testdb.DB
	tr      *transport.Transport
	es      *events.Store
	rt      stepsrt.Runtime
	svc     *orders.Service
	replies string
}

func newEnv(t *testing.T, db *testdb.DB) *env {
	t.Helper()
	tr, err := transport.New(transport.Config{DB: db.SQL, Logger: logger(), PollInterval: 20 * time.Millisecond, IdlePollInterval: testdb.NoSafetyPoll,
		Retry: transport.RetryPolicy{MaxAttempts: 5, InitialBackoff: 5 * time.Millisecond}})
	require.NoError(t, err)
	store, err := idempotency.NewStore(idempotency.Config{DB: db.SQL})
	require.NoError(t, err)
	reg := events.NewRegistry()
	require.NoError(t, orders.RegisterEvents(reg))
	es, err := events.NewStore(events.Config{Registry: reg, Topic: orders.StreamTopic,
		Publisher: func(tx delivery.DBTX) message.Publisher { return tr.Publisher(tx) }})
	require.NoError(t, err)
	rt, err := stepsrt.New(stepsrt.Config{Transport: tr, Store: store, Events: es, Logger: logger()})
	require.NoError(t, err)
	svc, err := orders.New(orders.Config{DB: db.SQL, Publish: publish(tr), Idempotency: store, Events: es, Logger: logger()})
	require.NoError(t, err)
	e := &env{t: t, db: db, tr: tr, es: es, rt: rt, svc: svc, replies: "replies_" + uuid.NewString()[:8]}
	// "reader" keeps what the tests read queued; "archive" keeps a copy of
	// every order event for replays.
	require.NoError(t, tr.Subscribe(context.Background(), append([]transport.Subscription{{Topic: orders.EventsTopic, ConsumerGroup: orders.ProjectionName}},
		transport.Subscription{Topic: e.replies, ConsumerGroup: "reader"},
		transport.Subscription{Topic: orders.CreatedTopic, ConsumerGroup: "reader"},
		transport.Subscription{Topic: orders.EventsTopic, ConsumerGroup: "archive"})...))
	return e
}

func (e *env) customer() string {
	id := "cust-" + uuid.NewString()[:8]
	require.NoError(e.t, e.svc.AddCustomer(context.Background(), id, "Test Customer"))
	return id
}

func (e *env) place(customer string, cents int64) uuid.UUID {
	e.t.Helper()
	res, err := e.svc.Place(context.Background(), orders.PlaceRequest{Key: uuid.NewString(), CustomerID: customer, AmountCents: cents})
	require.NoError(e.t, err)
	return res.OrderID
}

func (e *env) count(query string, args ...any) int {
	e.t.Helper()
	var n int
	require.NoError(e.t, e.db.SQL.QueryRow(query, args...).Scan(&n))
	return n
}

// run executes a saga step for the order in a transaction of its own, and
// returns the reply published.
func (e *env) run(step steps.AnyStep, cmd steps.Message, key string) (steps.Envelope, string) {
	e.t.Helper()
	msg, err := steps.NewMessage(cmd, steps.Envelope{Key: key, ReplyTo: e.replies})
	require.NoError(e.t, err)
	require.NoError(e.t, e.rt.Execute(context.Background(), step, msg))
	var (
		id, meta, payload string
	)
	require.NoError(e.t, e.db.SQL.QueryRow(`SELECT uuid, metadata::text, convert_from(payload, 'UTF8') FROM pgsaga_queue
		WHERE topic = $1 AND consumer_group = 'reader' AND metadata->>'idempotency_key' = $2 ORDER BY id DESC LIMIT 1`, e.replies, key).Scan(&id, &meta, &payload))
	m := message.NewMessage(id, nil)
	require.NoError(e.t, jsonUnmarshal(meta, &m.Metadata))
	return steps.EnvelopeOf(m), payload
}

func TestPlaceIsIdempotentByClientKey(t *testing.T) {
	t.Parallel()
	e := newEnv(t, testdb.Shared(t))
	ctx := context.Background()
	cust := e.customer()
	req := orders.PlaceRequest{Key: "client-" + uuid.NewString(), CustomerID: cust, AmountCents: 1999, Note: "two books"}
	first, err := e.svc.Place(ctx, req)
	require.NoError(t, err)
	assert.False(t, first.Replayed)
	second, err := e.svc.Place(ctx, req)
	require.NoError(t, err)
	assert.True(t, second.Replayed)
	assert.Equal(t, first.OrderID, second.OrderID, "the same key returns the same order")

	o, err := e.svc.Order(ctx, first.OrderID)
	require.NoError(t, err)
	assert.Equal(t, orders.StatusPlaced, o.Status)
	assert.Equal(t, int64(1999), o.AmountCents)
	assert.Equal(t, 1, o.Version)
	assert.Equal(t, 1, e.count(`SELECT count(*) FROM pgsaga_queue WHERE topic = $1 AND consumer_group = 'reader' AND convert_from(payload, 'UTF8') LIKE '%' || $2 || '%'`, orders.CreatedTopic, first.OrderID.String()),
		"one OrderCreated, published with the order")
	var created orders.OrderCreated
	var raw string
	require.NoError(t, e.db.SQL.QueryRow(`SELECT convert_from(payload, 'UTF8') FROM pgsaga_queue WHERE topic = $1 AND consumer_group = 'reader' AND convert_from(payload, 'UTF8') LIKE '%' || $2 || '%'`, orders.CreatedTopic, first.OrderID.String()).Scan(&raw))
	require.NoError(t, jsonUnmarshal(raw, &created))
	assert.Equal(t, orders.OrderCreated{OrderID: first.OrderID, CustomerID: cust, AmountCents: 1999}, created)

	// The same key for another customer is another order.
	other := e.customer()
	third, err := e.svc.Place(ctx, orders.PlaceRequest{Key: req.Key, CustomerID: other, AmountCents: 1999, Note: "two books"})
	require.NoError(t, err)
	assert.NotEqual(t, first.OrderID, third.OrderID)
}

// Every bad input is refused with its own error and leaves nothing behind.
func TestPlaceRejectsBadInput(t *testing.T) {
	t.Parallel()
	e := newEnv(t, testdb.Fresh(t))
	ctx := context.Background()
	cust := e.customer()
	usedKey := "used-" + uuid.NewString()
	_, err := e.svc.Place(ctx, orders.PlaceRequest{Key: usedKey, CustomerID: cust, AmountCents: 100})
	require.NoError(t, err)
	before := snapshotCounts(t, e)

	cases := []struct {
		name string
		req  orders.PlaceRequest
		want error
	}{
		{"missing key", orders.PlaceRequest{CustomerID: cust, AmountCents: 100}, orders.ErrMissingKey},
		{"key too long", orders.PlaceRequest{Key: strings.Repeat("k", 256), CustomerID: cust, AmountCents: 100}, orders.ErrKeyTooLong},
		{"empty customer", orders.PlaceRequest{Key: "k1", AmountCents: 100}, orders.ErrInvalidCustomerID},
		{"malformed customer", orders.PlaceRequest{Key: "k2", CustomerID: "bob; DROP TABLE", AmountCents: 100}, orders.ErrInvalidCustomerID},
		{"unknown customer", orders.PlaceRequest{Key: "k3", CustomerID: "nobody-" + uuid.NewString()[:8], AmountCents: 100}, orders.ErrUnknownCustomer},
		{"zero amount", orders.PlaceRequest{Key: "k4", CustomerID: cust, AmountCents: 0}, orders.ErrInvalidAmount},
		{"negative amount", orders.PlaceRequest{Key: "k5", CustomerID: cust, AmountCents: -100}, orders.ErrInvalidAmount},
		{"amount too large", orders.PlaceRequest{Key: "k6", CustomerID: cust, AmountCents: orders.MaxAmountCents + 1}, orders.ErrAmountTooLarge},
		{"note too long", orders.PlaceRequest{Key: "k7", CustomerID: cust, AmountCents: 100, Note: strings.Repeat("n", orders.MaxNoteBytes+1)}, orders.ErrNoteTooLong},
		{"control characters", orders.PlaceRequest{Key: "k8", CustomerID: cust, AmountCents: 100, Note: "bell\a"}, orders.ErrMalformedRequest},
		{"invalid utf-8", orders.PlaceRequest{Key: "k9\xff", CustomerID: cust, AmountCents: 100}, orders.ErrMalformedRequest},
		{"key reused for another order", orders.PlaceRequest{Key: usedKey, CustomerID: cust, AmountCents: 200}, orders.ErrKeyReused},
	}
	for _, c := range cases {
		_, err := e.svc.Place(ctx, c.req)
		require.ErrorIs(t, err, c.want, c.name)
		for _, other := range cases {
			if other.want != c.want && !(c.want == orders.ErrKeyReused && other.want == idempotency.ErrKeyReused) {
				assert.NotErrorIs(t, err, other.want, "%s must not also be %v", c.name, other.want)
			}
		}
	}
	assert.Equal(t, before, snapshotCounts(t, e), "nothing was written")
}

func snapshotCounts(t *testing.T, e *env) string {
	return fmt.Sprint(
		e.count(`SELECT count(*) FROM domain_events`),
		e.count(`SELECT count(*) FROM idempotency_keys`),
		e.count(`SELECT count(*) FROM pgsaga_queue`),
	)
}

func TestDecodePlaceRequest(t *testing.T) {
	t.Parallel()
	req, err := orders.DecodePlaceRequest(strings.NewReader(`{"key":"k","customer_id":"c","amount_cents":5}`))
	require.NoError(t, err)
	assert.Equal(t, orders.PlaceRequest{Key: "k", CustomerID: "c", AmountCents: 5}, req)
	for body, want := range map[string]error{
		`{"key":`:                                      orders.ErrMalformedRequest,
		`{"key":"k","amount":5}`:                       orders.ErrMalformedRequest, // unknown field
		`{"key":"k"} {"key":"j"}`:                      orders.ErrMalformedRequest,
		`{"amount_cents":"ten"}`:                       orders.ErrMalformedRequest,
		`{"note":"` + strings.Repeat("x", 5000) + `"}`: orders.ErrRequestTooLarge,
	} {
		_, err := orders.DecodePlaceRequest(strings.NewReader(body))
		require.ErrorIs(t, err, want, truncate(body))
	}
}

func truncate(s string) string {
	if len(s) > 40 {
		return s[:40] + "…"
	}
	return s
}

func TestConfirmAndCancelSteps(t *testing.T) {
	t.Parallel()
	e := newEnv(t, testdb.Shared(t))
	ctx := context.Background()
	cust := e.customer()

	a := e.place(cust, 100)
	env, payload := e.run(e.svc.ConfirmStep(), orders.ConfirmOrder{OrderID: a}, "confirm-"+a.String())
	assert.Equal(t, steps.OutcomeOK, env.Outcome)
	assert.JSONEq(t, fmt.Sprintf(`{"order_id":%q}`, a), payload)
	o, err := e.svc.Order(ctx, a)
	require.NoError(t, err)
	assert.Equal(t, orders.StatusConfirmed, o.Status)

	// The saga's compensation cancels even a confirmed order; twice is a no-op.
	env, _ = e.run(e.svc.CancelStep(), orders.CancelOrder{OrderID: a, Reason: "inventory"}, "cancel-"+a.String())
	assert.Equal(t, steps.OutcomeOK, env.Outcome)
	env, payload = e.run(e.svc.CancelStep(), orders.CancelOrder{OrderID: a, Reason: "inventory"}, "cancel-again-"+a.String())
	assert.Equal(t, steps.OutcomeOK, env.Outcome)
	assert.Contains(t, payload, `"already_cancelled":true`)
	o, err = e.svc.Order(ctx, a)
	require.NoError(t, err)
	assert.Equal(t, orders.StatusCancelled, o.Status)
	assert.Equal(t, orders.BySaga, o.CancelledBy)
	assert.Equal(t, 3, o.Version)

	// Confirming a cancelled order is a business failure.
	b := e.place(cust, 100)
	require.NoError(t, e.svc.CancelByCustomer(ctx, b, "changed my mind"))
	env, payload = e.run(e.svc.ConfirmStep(), orders.ConfirmOrder{OrderID: b}, "confirm-"+b.String())
	assert.Equal(t, steps.OutcomeFailed, env.Outcome)
	assert.Equal(t, "order cancelled by customer", env.Reason)
	assert.Contains(t, payload, `"reason":"order cancelled by customer"`)

	// Unknown orders are refused, not retried.
	missing := uuid.New()
	env, _ = e.run(e.svc.ConfirmStep(), orders.ConfirmOrder{OrderID: missing}, "confirm-"+missing.String())
	assert.Equal(t, steps.OutcomeFailed, env.Outcome)
	env, _ = e.run(e.svc.CancelStep(), orders.CancelOrder{OrderID: missing}, "cancel-"+missing.String())
	assert.Equal(t, steps.OutcomeFailed, env.Outcome)
}

func TestCancelByCustomer(t *testing.T) {
	t.Parallel()
	e := newEnv(t, testdb.Shared(t))
	ctx := context.Background()
	cust := e.customer()
	id := e.place(cust, 100)
	require.NoError(t, e.svc.CancelByCustomer(ctx, id, "oops"))
	require.NoError(t, e.svc.CancelByCustomer(ctx, id, "oops"), "twice is a no-op")
	o, err := e.svc.Order(ctx, id)
	require.NoError(t, err)
	assert.Equal(t, 2, o.Version)
	assert.Equal(t, orders.ByCustomer, o.CancelledBy)

	confirmed := e.place(cust, 100)
	e.run(e.svc.ConfirmStep(), orders.ConfirmOrder{OrderID: confirmed}, "confirm-"+confirmed.String())
	require.ErrorIs(t, e.svc.CancelByCustomer(ctx, confirmed, "too late"), orders.ErrAlreadyConfirmed)
	require.ErrorIs(t, e.svc.CancelByCustomer(ctx, uuid.New(), ""), orders.ErrOrderNotFound)
}

// The customer's cancellation races the saga's confirmation on many orders
// at once: for each, exactly one wins, the loser gets a clear business
// outcome, and the stream stays valid.
func TestCustomerCancelRacesConfirm(t *testing.T) {
	t.Parallel()
	e := newEnv(t, testdb.Shared(t))
	ctx := context.Background()
	cust := e.customer()
	const n = 20
	ids := make([]uuid.UUID, n)
	for i := range ids {
		ids[i] = e.place(cust, 100)
	}
	var (
		wg        sync.WaitGroup
		cancelErr = make([]error, n)
		confirm   = make([]steps.Envelope, n)
	)
	for i, id := range ids {
		wg.Go(func() { cancelErr[i] = e.svc.CancelByCustomer(ctx, id, "race") })
		wg.Go(func() {
			confirm[i], _ = e.run(e.svc.ConfirmStep(), orders.ConfirmOrder{OrderID: id}, "confirm-"+id.String())
		})
	}
	wg.Wait()
	wins := map[orders.Status]int{}
	for i, id := range ids {
		o, err := e.svc.Order(ctx, id)
		require.NoError(t, err, "the stream folds cleanly")
		assert.Equal(t, 2, o.Version, "exactly one of the two events was appended")
		wins[o.Status]++
		switch o.Status {
		case orders.StatusConfirmed:
			require.ErrorIs(t, cancelErr[i], orders.ErrAlreadyConfirmed)
			assert.Equal(t, steps.OutcomeOK, confirm[i].Outcome)
		case orders.StatusCancelled:
			require.NoError(t, cancelErr[i])
			assert.Equal(t, steps.OutcomeFailed, confirm[i].Outcome)
			assert.Equal(t, "order cancelled by customer", confirm[i].Reason)
		default:
			t.Fatalf("order %s is %s", id, o.Status)
		}
	}
	t.Logf("confirmed %d, cancelled %d", wins[orders.StatusConfirmed], wins[orders.StatusCancelled])
}

func TestNewNeedsOrderEvents(t *testing.T) {
	t.Parallel()
	db := testdb.Shared(t)
	tr, err := transport.New(transport.Config{DB: db.SQL})
	require.NoError(t, err)
	store, err := idempotency.NewStore(idempotency.Config{DB: db.SQL})
	require.NoError(t, err)
	es, err := events.NewStore(events.Config{Registry: events.NewRegistry()})
	require.NoError(t, err)
	_, err = orders.New(orders.Config{DB: db.SQL, Publish: publish(tr), Idempotency: store, Events: es})
	require.ErrorContains(t, err, "RegisterEvents")
	_, err = orders.New(orders.Config{})
	require.Error(t, err)
	require.True(t, errors.Is(orders.ErrKeyReused, idempotency.ErrKeyReused))
}

// publish is what saga.Client.PublishTx does, over tr.
func publish(tr *transport.Transport) func(context.Context, delivery.DBTX, string, ...*message.Message) error {
	return func(_ context.Context, tx delivery.DBTX, topic string, msgs ...*message.Message) error {
		return tr.Publisher(tx).Publish(topic, msgs...)
	}
}

// Place sends what it can together (a dbtx.Pipe under its idempotency
// claim): BEGIN with the claim; the order's events, their publish and
// OrderCreated with the key's completion; then COMMIT. Five round trips:
// the claim, the customer's check, the append, the completion, the
// commit.
func TestPlaceIsFiveRoundTrips(t *testing.T) {
	t.Parallel()
	db, trips := testdb.RoundTrips(t, testdb.Shared(t))
	e := newEnv(t, db)
	e.place(e.customer(), 1500) // each statement is prepared once, a round trip of its own
	customer := e.customer()
	trips.Store(0)
	order := e.place(customer, 1500)
	assert.EqualValues(t, 5, trips.Load(), "round trips of one Place")
	assertPlacedOnce(t, e, customer, order)
}
