package orderpayment_test

import (
	"context"
	"encoding/json"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/internal/testdb"
	"github.com/pgsaga/pgsaga/internal/testout"
	"github.com/pgsaga/pgsaga/internal/testpg"
	"github.com/pgsaga/pgsaga/internal/testsample"
	"github.com/pgsaga/pgsaga/internal/transport"
	"github.com/pgsaga/pgsaga/orders"
	"github.com/pgsaga/pgsaga/payments"
	"github.com/pgsaga/pgsaga/payments/fakegateway"
	"github.com/pgsaga/pgsaga/saga"
	"github.com/pgsaga/pgsaga/saga/orderpayment"
)

// The sample's tests run many workers at once, each with its pools: on a
// server of their own (see testpg.MainOwnServer), as the run's server, its
// connections shared with the other packages tested meanwhile, ran out of
// them ("too many clients already").
func TestMain(m *testing.M) { testpg.MainOwnServer(m, testsample.Schemas()...) }

// logger is the tests' logger (PGSAGA_TEST_LOG shows it).
var logger = testout.Logger

type env struct {
	t   *testing.T
	db  *testdb.DB
	app *orderpayment.App
	cfg orderpayment.Config // the App's
	gw  *fakegateway.Gateway

	mu     sync.Mutex
	faults func(fakegateway.Call) fakegateway.Fault
}

// newEnv gives a test the whole sample on a database of its own (the
// invariants look at every row) with workers running.
func newEnv(t *testing.T, workers int, mutate func(*orderpayment.Config)) *env {
	t.Helper()
	db := testdb.Fresh(t)
	e := &env{t: t, db: db}
	gwPool := testdb.Open(t, db.URL, 4)
	gw, err := fakegateway.Start(context.Background(), fakegateway.Config{DB: gwPool.SQL, Logger: logger(), LostHang: 2 * time.Second,
		Faults: func(c fakegateway.Call) fakegateway.Fault {
			e.mu.Lock()
			defer e.mu.Unlock()
			if e.faults == nil {
				return fakegateway.None
			}
			return e.faults(c)
		}})
	require.NoError(t, err)
	t.Cleanup(func() { _ = gw.Close() })
	cfg := orderpayment.Config{
		DB:             db.SQL,
		GatewayURL:     gw.URL(),
		GatewayTimeout: 300 * time.Millisecond,
		GatewayLease:   time.Second,
		Transport: transport.Config{PollInterval: 20 * time.Millisecond, IdlePollInterval: testdb.NoSafetyPoll, RetryInterval: 20 * time.Millisecond,
			Retry: transport.RetryPolicy{MaxAttempts: 6, InitialBackoff: 10 * time.Millisecond, MaxBackoff: 100 * time.Millisecond}},
		Timeouts:      orderpayment.StepTimeouts{Deadline: 5 * time.Second},
		SweepInterval: 50 * time.Millisecond,
		Logger:        logger(),
	}
	if mutate != nil {
		mutate(&cfg)
	}
	app, err := orderpayment.New(cfg)
	require.NoError(t, err)
	require.NoError(t, app.Setup(context.Background()))
	e.app, e.cfg, e.gw = app, cfg, gw
	for range workers {
		e.startWorker()
	}
	return e
}

func (e *env) startWorker() {
	w, err := e.app.NewWorker()
	require.NoError(e.t, err)
	require.NoError(e.t, w.Start(context.Background()))
	e.t.Cleanup(func() { _ = w.Stop() })
}

func (e *env) customer(balance int64) string {
	e.t.Helper()
	ctx := context.Background()
	id := "c-" + uuid.NewString()[:8]
	require.NoError(e.t, e.app.Orders.AddCustomer(ctx, id, "Customer "+id))
	require.NoError(e.t, e.app.Payments.OpenAccount(ctx, id))
	if balance > 0 {
		require.NoError(e.t, e.app.Payments.Deposit(ctx, id, balance, "seed"))
	}
	return id
}

func (e *env) place(customer string, cents int64) (uuid.UUID, uuid.UUID) {
	e.t.Helper()
	res, err := e.app.Orders.Place(context.Background(), orders.PlaceRequest{Key: uuid.NewString(), CustomerID: customer, AmountCents: cents})
	require.NoError(e.t, err)
	return res.OrderID, saga.ID(orderpayment.Name, res.OrderID.String())
}

func (e *env) terminal(id uuid.UUID) saga.Instance {
	e.t.Helper()
	deadline := time.Now().Add(60 * time.Second)
	for {
		inst, err := e.app.Client.Get(context.Background(), id)
		if err == nil && inst.Status.Terminal() {
			return inst
		}
		if time.Now().After(deadline) {
			e.t.Fatalf("saga %s not terminal: %+v (%v)", id, inst, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func (e *env) checkInvariants(ids []uuid.UUID) orderpayment.Report {
	e.t.Helper()
	r, err := orderpayment.Check(context.Background(), e.db.SQL, ids)
	require.NoError(e.t, err)
	assert.True(e.t, r.OK(), "invariants: %v", r.Violations)
	return r
}

func (e *env) balance(account string) int64 {
	b, err := e.app.Payments.Balance(context.Background(), account)
	require.NoError(e.t, err)
	return b
}

func (e *env) order(id uuid.UUID) orders.Order {
	o, err := e.app.Orders.Order(context.Background(), id)
	require.NoError(e.t, err)
	return o
}

// viewIsCurrent checks the order's row of order_views against its stream,
// at once: the sample's projection is inline, so the view is current when
// the event commits.
func (e *env) viewIsCurrent(id uuid.UUID) {
	e.t.Helper()
	o := e.order(id)
	v, err := e.app.Orders.View(context.Background(), id)
	require.NoError(e.t, err, "the inline projection wrote the view with the event")
	assert.Equal(e.t, o.Version, v.Version)
	assert.Equal(e.t, o.Status, v.Status)
}

func TestHappyPath(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 1, nil)
	cust := e.customer(10_000)
	orderID, sagaID := e.place(cust, 2_500)
	inst := e.terminal(sagaID)
	assert.Equal(t, saga.StatusCompleted, inst.Status)
	assert.Equal(t, orders.StatusConfirmed, e.order(orderID).Status)
	assert.Equal(t, int64(7_500), e.balance(cust))
	var data orderpayment.Data
	require.NoError(t, json.Unmarshal(inst.Data, &data))
	assert.Regexp(t, `^ch_`, data.ChargeID, "the charge reply's id was kept in the saga's data")
	e.viewIsCurrent(orderID)
	e.checkInvariants([]uuid.UUID{sagaID})
	stats, err := e.gw.Stats(context.Background())
	require.NoError(t, err)
	assert.Equal(t, 1, stats.Charges)
	assert.Equal(t, int64(2_500), stats.ChargedCents)
}

// hopRecords is what a saga leaves behind, for comparing delivery modes:
// its timeline (kind, step, phase), the idempotency keys of its commands
// (scope, status, whether a reply is stored) and the topics its messages
// were queued on (from a trigger on pgsaga_queue).
type hopRecords struct {
	timeline, keys, queued []string
}

func (e *env) logQueued() {
	e.t.Helper()
	_, err := e.db.SQL.Exec(`
CREATE TABLE queued_log (topic text NOT NULL, correlation_id text);
CREATE FUNCTION log_queued() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO queued_log VALUES (NEW.topic, NEW.metadata->>'correlation_id');
    RETURN NEW;
END$$;
CREATE TRIGGER log_queued AFTER INSERT ON pgsaga_queue FOR EACH ROW EXECUTE FUNCTION log_queued()`)
	require.NoError(e.t, err)
}

func (e *env) records(orderID, sagaID uuid.UUID) hopRecords {
	e.t.Helper()
	var r hopRecords
	read := func(into *[]string, query string, arg uuid.UUID) {
		rows, err := e.db.SQL.Query(query, arg.String())
		require.NoError(e.t, err)
		defer rows.Close()
		for rows.Next() {
			var s string
			require.NoError(e.t, rows.Scan(&s))
			*into = append(*into, s)
		}
		require.NoError(e.t, rows.Err())
	}
	read(&r.timeline, `SELECT kind || ' ' || coalesce(step, '') || ' ' || coalesce(phase, '') FROM saga_history WHERE saga_id = $1 ORDER BY seq`, sagaID)
	read(&r.keys, `SELECT scope || ' ' || status || ' ' || (response IS NOT NULL)::text FROM idempotency_keys WHERE key LIKE $1 || ':%' ORDER BY scope`, sagaID)
	read(&r.queued, `SELECT topic FROM queued_log WHERE correlation_id = $1 ORDER BY topic`, orderID)
	return r
}

// The sample starts sagas in Place's transaction and delivers the orders
// steps and the engine's replies in process: the same saga, paid or
// refused, leaves the same timeline, keys and stored replies as with every
// hop queued, and only the payment command goes through the queue.
func TestInProcessHopsKeepTheSameRecords(t *testing.T) {
	t.Parallel()
	run := func(queueEveryHop bool, balance int64) hopRecords {
		e := newEnv(t, 1, func(c *orderpayment.Config) { c.QueueEveryHop = queueEveryHop })
		e.logQueued()
		orderID, sagaID := e.place(e.customer(balance), 2_500)
		e.terminal(sagaID)
		e.checkInvariants([]uuid.UUID{sagaID})
		return e.records(orderID, sagaID)
	}
	for _, tc := range []struct {
		name    string
		balance int64
		queued  []string // in process
		step    string   // the orders step it ends with
	}{
		{"paid", 10_000, []string{payments.ChargeTopic}, orders.ConfirmTopic},
		{"refused", 1_000, []string{payments.ChargeTopic}, orders.CancelTopic},
	} {
		t.Run(tc.name, func(t *testing.T) {
			inProcess, queued := run(false, tc.balance), run(true, tc.balance)
			assert.Equal(t, queued.timeline, inProcess.timeline)
			assert.Equal(t, queued.keys, inProcess.keys)
			assert.NotEmpty(t, inProcess.keys)
			assert.Equal(t, tc.queued, inProcess.queued, "in process, only the payment command is queued")
			assert.Contains(t, queued.queued, orders.CreatedTopic, "every hop queued")
			assert.Contains(t, queued.queued, tc.step, "every hop queued")
		})
	}
}

func TestInsufficientFundsCancelsTheOrder(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 1, nil)
	cust := e.customer(1_000)
	orderID, sagaID := e.place(cust, 5_000)
	inst := e.terminal(sagaID)
	assert.Equal(t, saga.StatusCompensated, inst.Status)
	assert.Equal(t, "charge: insufficient funds", inst.FailureReason)
	o := e.order(orderID)
	assert.Equal(t, orders.StatusCancelled, o.Status)
	assert.Equal(t, orders.BySaga, o.CancelledBy)
	assert.Equal(t, int64(1_000), e.balance(cust), "nothing charged")
	e.checkInvariants([]uuid.UUID{sagaID})
	stats, err := e.gw.Stats(context.Background())
	require.NoError(t, err)
	assert.Zero(t, stats.Calls, "the gateway was never called")
}

// The customer cancels before the saga confirms: confirmation fails, the
// charge is refunded, then the order is cancelled (already, by the
// customer).
func TestCustomerCancelBeatsConfirmation(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 0, nil)
	cust := e.customer(10_000)
	orderID, sagaID := e.place(cust, 3_000)
	require.NoError(t, e.app.Orders.CancelByCustomer(context.Background(), orderID, "changed my mind"))
	e.startWorker()
	inst := e.terminal(sagaID)
	assert.Equal(t, saga.StatusCompensated, inst.Status)
	assert.Equal(t, "confirm: order cancelled by customer", inst.FailureReason)
	var steps []string
	for _, h := range inst.History {
		if h.Kind == "sent" {
			steps = append(steps, h.Step+"/"+string(h.Phase))
		}
	}
	assert.Equal(t, []string{"charge/action", "confirm/action", "charge/compensation", "order/compensation"}, steps, "refund, then cancel")
	assert.Equal(t, int64(10_000), e.balance(cust), "refunded")
	assert.Equal(t, orders.ByCustomer, e.order(orderID).CancelledBy)
	e.viewIsCurrent(orderID)
	e.checkInvariants([]uuid.UUID{sagaID})
	stats, err := e.gw.Stats(context.Background())
	require.NoError(t, err)
	assert.Equal(t, 1, stats.Charges)
	assert.Equal(t, 1, stats.Refunds)
}

// Many orders, customers cancelling at random moments while two workers run
// the sagas: every saga ends consistently.
func TestCustomerCancelRaces(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 2, nil)
	ctx := context.Background()
	cust := e.customer(1_000_000)
	var (
		ids []uuid.UUID
		wg  sync.WaitGroup
	)
	for i := range 20 {
		orderID, sagaID := e.place(cust, 1_000)
		ids = append(ids, sagaID)
		wg.Go(func() {
			time.Sleep(time.Duration(i*43%800) * time.Millisecond) // the customer's hesitation
			err := e.app.Orders.CancelByCustomer(ctx, orderID, "race")
			if err != nil {
				assert.ErrorIs(t, err, orders.ErrAlreadyConfirmed)
			}
		})
	}
	wg.Wait()
	completed := 0
	for _, id := range ids {
		inst := e.terminal(id)
		switch inst.Status {
		case saga.StatusCompleted:
			completed++
		case saga.StatusCompensated:
		default:
			t.Errorf("saga %s ended %s: %s", id, inst.Status, inst.FailureReason)
		}
	}
	r := e.checkInvariants(ids)
	assert.Equal(t, int64(1_000_000-completed*1_000), e.balance(cust))
	t.Logf("%d completed, %d compensated; p50 %s", completed, len(ids)-completed, r.P50)
}

// Gateway faults on every charge (a lost answer, then a 503): retried with
// the same key, one charge each.
func TestGatewayFaultsChargeOnce(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 1, nil)
	e.mu.Lock()
	e.faults = func(c fakegateway.Call) fakegateway.Fault {
		switch {
		case c.Op == "charge" && c.Attempt == 1:
			return fakegateway.Lost
		case c.Op == "charge" && c.Attempt == 2:
			return fakegateway.Unavailable
		}
		return fakegateway.None
	}
	e.mu.Unlock()
	cust := e.customer(10_000)
	var ids []uuid.UUID
	for range 4 {
		_, id := e.place(cust, 1_000)
		ids = append(ids, id)
	}
	for _, id := range ids {
		assert.Equal(t, saga.StatusCompleted, e.terminal(id).Status)
	}
	e.checkInvariants(ids)
	stats, err := e.gw.Stats(context.Background())
	require.NoError(t, err)
	assert.Equal(t, 4, stats.Charges)
	assert.Equal(t, 12, stats.Calls, "three calls per charge, same key")
	assert.Equal(t, int64(6_000), e.balance(cust))
}

// A declined card: the reservation is voided, the order cancelled.
func TestDeclinedCard(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 1, nil)
	e.mu.Lock()
	e.faults = func(c fakegateway.Call) fakegateway.Fault { return fakegateway.Decline }
	e.mu.Unlock()
	cust := e.customer(10_000)
	orderID, sagaID := e.place(cust, 1_000)
	inst := e.terminal(sagaID)
	assert.Equal(t, saga.StatusCompensated, inst.Status)
	assert.Equal(t, "charge: card declined", inst.FailureReason)
	assert.Equal(t, orders.StatusCancelled, e.order(orderID).Status)
	assert.Equal(t, int64(10_000), e.balance(cust))
	e.checkInvariants([]uuid.UUID{sagaID})
}

// The saga gives up on a charge that is slower than its deadline and
// compensates it; the charge lands at the gateway afterwards. The refund
// waits for it, then returns the money: no compensated saga holds any.
func TestGiveUpOnSlowChargeRefundsIt(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 1, func(c *orderpayment.Config) {
		// The saga gives up on the charge a deadline after its not-after
		// (the saga's timeout: long enough for the command to arrive
		// before it on a loaded machine, where it would be refused).
		c.Timeouts = orderpayment.StepTimeouts{Deadline: 100 * time.Millisecond, MaxAttempts: 1, Saga: 2 * time.Second}
	})
	e.mu.Lock()
	e.faults = func(c fakegateway.Call) fakegateway.Fault {
		if c.Op == "charge" && c.Attempt == 1 {
			// The charge lands only once the saga has given up on it.
			deadline := time.Now().Add(30 * time.Second)
			for time.Now().Before(deadline) {
				var gaveUp bool
				if err := e.db.SQL.QueryRow(`SELECT EXISTS (SELECT FROM saga_instances WHERE status <> 'running')`).Scan(&gaveUp); err != nil || gaveUp {
					break
				}
				time.Sleep(10 * time.Millisecond)
			}
		}
		return fakegateway.None
	}
	e.mu.Unlock()
	cust := e.customer(10_000)
	orderID, sagaID := e.place(cust, 2_000)
	inst := e.terminal(sagaID)
	assert.Equal(t, saga.StatusCompensated, inst.Status)
	assert.Equal(t, "charge: no answer by its not-after, the saga's timeout (2s)", inst.FailureReason)
	assert.Equal(t, orders.StatusCancelled, e.order(orderID).Status)
	assert.Equal(t, int64(10_000), e.balance(cust), "the late charge was refunded")
	e.checkInvariants([]uuid.UUID{sagaID})
	stats, err := e.gw.Stats(context.Background())
	require.NoError(t, err)
	assert.EqualValues(t, 1, stats.Charges, "the charge given up on landed")
	assert.Equal(t, stats.Charges, stats.Refunds, "every charge at the gateway was refunded")
}

// With two workers of three consumers each and retention running, every
// saga completes and the queues end up empty: a handled message leaves
// nothing behind, and nothing was dead-lettered. Keys stay for their TTL.
func TestQueuesEmptyWhenSagasFinish(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 2, func(c *orderpayment.Config) { c.Transport.Consumers = 3 })
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- e.app.RunRetention(ctx) }()
	customer := e.customer(1_000_000)
	var ids []uuid.UUID
	for range 30 {
		_, id := e.place(customer, 1_000)
		ids = append(ids, id)
	}
	for _, id := range ids {
		assert.Equal(t, saga.StatusCompleted, e.terminal(id).Status)
	}
	left := func() int {
		var n int
		require.NoError(t, e.db.SQL.QueryRow(`SELECT count(*) FROM pgsaga_queue`).Scan(&n))
		return n
	}
	deadline := time.Now().Add(30 * time.Second)
	for left() > 0 {
		require.True(t, time.Now().Before(deadline), "%d messages left", left())
		time.Sleep(20 * time.Millisecond)
	}
	cancel()
	require.NoError(t, <-done)
	r := e.checkInvariants(ids)
	assert.Equal(t, 30, r.Sagas[saga.StatusCompleted])
	var keys, dead int
	require.NoError(t, e.db.SQL.QueryRow(`SELECT count(*) FROM idempotency_keys`).Scan(&keys))
	assert.Positive(t, keys, "keys are kept for their TTL")
	require.NoError(t, e.db.SQL.QueryRow(`SELECT count(*) FROM pgsaga_dead_letters`).Scan(&dead))
	assert.Zero(t, dead)
}

// Two processes with different settings share one database: one delivers
// hops in process, the other queues every hop. Orders placed through
// either finish, whichever worker takes each hop, and every invariant
// holds.
func TestProcessesWithDifferentHopSettingsShareTheWork(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 1, nil)
	e.logQueued()
	cfg := e.cfg
	cfg.DB = testdb.Open(t, e.db.URL, 10).SQL // a process of its own: its own pool
	cfg.QueueEveryHop = true
	other, err := orderpayment.New(cfg)
	require.NoError(t, err)
	w, err := other.NewWorker()
	require.NoError(t, err)
	require.NoError(t, w.Start(context.Background()))
	t.Cleanup(func() { _ = w.Stop() })

	rich, poor := e.customer(1_000_000), e.customer(500)
	var ids []uuid.UUID
	for i := range 20 {
		svc := e.app.Orders
		if i%2 == 1 {
			svc = other.Orders
		}
		cust := rich
		if i%5 == 0 {
			cust = poor
		}
		res, err := svc.Place(context.Background(), orders.PlaceRequest{Key: uuid.NewString(), CustomerID: cust, AmountCents: 1_000})
		require.NoError(t, err)
		ids = append(ids, saga.ID(orderpayment.Name, res.OrderID.String()))
	}
	for _, id := range ids {
		e.terminal(id)
	}
	e.checkInvariants(ids)
	var triggers int
	require.NoError(t, e.db.SQL.QueryRow(`SELECT count(*) FROM queued_log WHERE topic = $1`, orders.CreatedTopic).Scan(&triggers))
	assert.Equal(t, 10, triggers, "the queuing process queued its triggers; the other started its sagas in Place")
}
