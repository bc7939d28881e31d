package orderpayment_test

import (
	"context"
	"fmt"
	"strconv"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/internal/testdb"
	"github.com/pgsaga/pgsaga/internal/testout"
	"github.com/pgsaga/pgsaga/internal/transport"
	"github.com/pgsaga/pgsaga/orders"
	"github.com/pgsaga/pgsaga/payments/fakegateway"
	"github.com/pgsaga/pgsaga/saga"
	"github.com/pgsaga/pgsaga/saga/orderpayment"
	"github.com/pgsaga/pgsaga/saga/sagatest"
	"github.com/pgsaga/pgsaga/saga/sagatest/netfault"
)

// The sample with its workers across a bad network from PostgreSQL: every
// packet 20 ms ± 10 ms late each way, then a 30 s partition (nothing
// crosses, connections hang), then connections reset mid-stream in bursts
// while the charges' batches run; the same two workers throughout, so
// that they must mend what the network broke themselves. Every saga ends, and every invariant holds: nothing
// charged twice, nothing held for a compensated order.
func TestChaosOverABadNetwork(t *testing.T) {
	t.Parallel()
	seed := testout.ChaosSeed(t)
	const orderCount = 150
	ctx := context.Background()
	start := time.Now()
	db := testdb.Fresh(t)
	link, through := netfault.Through(t, db.URL)
	require.NoError(t, link.Latency(20*time.Millisecond, 10*time.Millisecond))

	// The gateway is another company's, on its own network: not behind the link.
	gw, err := fakegateway.Start(ctx, fakegateway.Config{DB: testdb.Open(t, db.URL, 4).SQL, Logger: logger(), LostHang: time.Second})
	require.NoError(t, err)
	t.Cleanup(func() { _ = gw.Close() })
	app, err := orderpayment.New(orderpayment.Config{
		DB:             testdb.Open(t, through, 16).SQL,
		GatewayURL:     gw.URL(),
		GatewayTimeout: 300 * time.Millisecond,
		GatewayLease:   time.Second,
		Transport: transport.Config{PollInterval: 20 * time.Millisecond, IdlePollInterval: testdb.NoSafetyPoll, RetryInterval: 20 * time.Millisecond,
			Retry: transport.RetryPolicy{MaxAttempts: 8, InitialBackoff: 5 * time.Millisecond, MaxBackoff: 100 * time.Millisecond}},
		// Patience for the partition: a command whose reply is 30 s late
		// is sent again, not given up on.
		Timeouts:      orderpayment.StepTimeouts{Deadline: 20 * time.Second, CompensationDeadline: 20 * time.Second},
		SweepInterval: 200 * time.Millisecond,
		Logger:        logger(),
	})
	require.NoError(t, err)
	require.NoError(t, app.Setup(ctx))
	// Two workers that run throughout: what the network breaks, they mend
	// themselves (no restart hides a stall).
	for range 2 {
		w, err := app.NewWorker()
		require.NoError(t, err)
		require.NoError(t, w.Start(ctx))
		defer func() { assert.NoError(t, w.Stop()) }()
	}

	customers := make([]string, 10)
	for i := range customers {
		customers[i] = fmt.Sprintf("net-%02d", i)
		require.NoError(t, app.Orders.AddCustomer(ctx, customers[i], "Net "+customers[i]))
		require.NoError(t, app.Payments.OpenAccount(ctx, customers[i]))
		require.NoError(t, app.Payments.Deposit(ctx, customers[i], 40_000, "seed"))
	}
	place := func(from, to int) (ids []uuid.UUID) {
		for i := from; i < to; i++ {
			res, err := app.Orders.Place(ctx, orders.PlaceRequest{Key: "net-" + strconv.Itoa(i), CustomerID: customers[i%len(customers)],
				AmountCents: int64(1_000 + (i*7919)%8_000)})
			require.NoError(t, err)
			ids = append(ids, saga.ID(orderpayment.Name, res.OrderID.String()))
		}
		return ids
	}
	ids := place(0, orderCount/2)

	// The partition, while those sagas run.
	require.NoError(t, link.Partition(30*time.Second))
	partitioned := time.Now()
	require.Eventually(t, func() bool { return time.Since(partitioned) > 30*time.Second }, time.Minute, 100*time.Millisecond) // the partition's length is the scenario
	// Healed: the rest of the orders, and resets in bursts while the
	// charges run (a fifth of the connections each burst).
	ids = append(ids, place(orderCount/2, orderCount)...)
	abandonedBefore := sessionsAbandoned(t, db) // the heal closed the connections open across the partition
	for range 5 {
		require.NoError(t, link.Reset(0.2))
		time.Sleep(200 * time.Millisecond) // the burst's length: the scenario, not a wait for a result
		require.NoError(t, link.Reset(0))
		time.Sleep(800 * time.Millisecond)
	}
	counts, err := sagatest.WaitTerminal(ctx, db.SQL, ids, 3*time.Minute)
	require.NoError(t, err, "seed %d", seed)

	violations, err := sagatest.Checker{DB: db.SQL, Definitions: []*saga.Definition{app.Definition}, Domain: domainInvariants()}.Check(ctx)
	require.NoError(t, err)
	for _, v := range violations {
		t.Errorf("seed %d: %s", seed, v)
	}
	assert.Equal(t, orderCount, counts[saga.StatusCompleted]+counts[saga.StatusCompensated], "every saga ended, none parked: %v", counts)
	// Compensated for want of funds, never because the network made a
	// step give up.
	reasons, err := sagatest.Rows(ctx, db.SQL, `SELECT failure_reason || ': ' || count(*) FROM saga_instances WHERE status = 'compensated' GROUP BY failure_reason ORDER BY 1`)
	require.NoError(t, err)
	for _, r := range reasons {
		assert.NotContains(t, r, "no reply", "a step given up on")
	}
	t.Logf("network chaos: compensated for %v", reasons)
	// The resets reached the server: sessions ended by a lost client
	// connection after the heal's, as PostgreSQL counts them.
	var abandoned int64
	require.Eventually(t, func() bool {
		abandoned = sessionsAbandoned(t, db) - abandonedBefore
		return abandoned > 0
	}, 10*time.Second, 100*time.Millisecond, "no session was cut off by a reset")
	t.Logf("network chaos: %d sessions cut off by the resets", abandoned)
	t.Logf("network chaos: %d orders in %s (%s after the partition healed): %d completed, %d compensated, %d failed",
		orderCount, time.Since(start).Round(time.Millisecond), time.Since(partitioned.Add(30*time.Second)).Round(time.Millisecond),
		counts[saga.StatusCompleted], counts[saga.StatusCompensated], counts[saga.StatusFailed])
}

// sessionsAbandoned is how many sessions of db's database PostgreSQL saw
// end by a lost client connection.
func sessionsAbandoned(t *testing.T, db *testdb.DB) int64 {
	t.Helper()
	var n int64
	require.NoError(t, db.SQL.QueryRow(`SELECT pg_stat_clear_snapshot() IS NULL OR true, sessions_abandoned FROM pg_stat_database WHERE datname = current_database()`).Scan(new(bool), &n))
	return n
}
