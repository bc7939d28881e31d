package orderpayment_test

import (
	"context"
	"database/sql"
	"fmt"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/internal/testdb"
	"github.com/pgsaga/pgsaga/internal/testout"
	"github.com/pgsaga/pgsaga/internal/transport"
	"github.com/pgsaga/pgsaga/orders"
	"github.com/pgsaga/pgsaga/payments/fakegateway"
	"github.com/pgsaga/pgsaga/saga"
	"github.com/pgsaga/pgsaga/saga/orderpayment"
	"github.com/pgsaga/pgsaga/saga/sagatest"
)

// DomainInvariants adapts the sample's checker to the kit.
func domainInvariants() []sagatest.Invariant {
	return []sagatest.Invariant{{
		Name: "order-payment ledger, orders and gateway",
		Check: func(ctx context.Context, db *sql.DB) ([]string, error) {
			r, err := orderpayment.Check(ctx, db, nil)
			if err != nil {
				return nil, err
			}
			var rows []string
			for _, v := range r.Violations {
				rows = append(rows, v.String())
			}
			return rows, nil
		},
	}}
}

// Several hundred orders through the saga while messages are duplicated
// (30%), attempts crash before and after commit, connections are killed,
// handlers stall, the gateway fails in every way it can, and three workers
// are stopped and replaced at random. Afterwards every saga is terminal and
// every invariant holds.
// TestChaos runs the chaos schedule twice: with the sample's in-process
// deliveries (the orders steps and the engine's replies), and with every
// hop through the queue, as when each participant runs in a process of
// its own.
func TestChaos(t *testing.T) {
	for _, mode := range []struct {
		name  string
		queue bool
	}{{"in process", false}, {"every hop queued", true}} {
		t.Run(mode.name, func(t *testing.T) { runChaos(t, mode.queue) })
	}
}

func runChaos(t *testing.T, queueEveryHop bool) {
	seed := testout.ChaosSeed(t)
	const orderCount = 300
	ctx := context.Background()
	start := time.Now()
	db := testdb.Fresh(t)

	inj, err := sagatest.NewInjector(testdb.Open(t, db.URL, 4).SQL, sagatest.Faults{
		Seed:                  seed,
		DuplicateRate:         0.3,
		CrashBeforeCommitRate: 0.05,
		CrashAfterCommitRate:  0.05,
		KillConnectionRate:    0.02,
		DelayRate:             0.05,
		MaxDelay:              50 * time.Millisecond,
	}, logger())
	require.NoError(t, err)
	gwPool := testdb.Open(t, db.URL, 4)
	gw, err := fakegateway.Start(ctx, fakegateway.Config{DB: gwPool.SQL, Logger: logger(), SlowDelay: 100 * time.Millisecond, LostHang: time.Second,
		Faults: orderpayment.GatewayFaults(seed, 0.1)})
	require.NoError(t, err)
	t.Cleanup(func() { _ = gw.Close() })
	app, err := orderpayment.New(orderpayment.Config{
		DB:             db.SQL,
		GatewayURL:     gw.URL(),
		GatewayTimeout: 300 * time.Millisecond,
		GatewayLease:   time.Second,
		Transport: transport.Config{
			PollInterval: 20 * time.Millisecond, IdlePollInterval: testdb.NoSafetyPoll, RetryInterval: 20 * time.Millisecond,
			Retry:     transport.RetryPolicy{MaxAttempts: 8, InitialBackoff: 5 * time.Millisecond, MaxBackoff: 100 * time.Millisecond},
			Intercept: inj.Intercept,
		},
		// Patience for slowness, not for loss: an action never answered is
		// still given up on (after 3 attempts, 60 s) and a compensation never
		// answered still parks (after 5 attempts, 100 s), within
		// WaitTerminal's 3 min. The 300 orders arrive at once: on a loaded
		// 2-core machine the charge queue takes 15 to 40 s (median) to reach
		// a command, so a 5 s action deadline re-sent nearly every charge
		// twice and gave up on 90 to 100% of them. Every saga then needed a
		// refund, the costliest step (gateway calls inside its attempt), and
		// each re-send a replay and a reply: the refund queue backed up past
		// 100 s and parked 20 to 110 sagas in 300 ("charge: no reply after 3
		// attempts; then compensation of charge got no reply after 5
		// attempts"), with every refund still queued, none lost.
		Timeouts:      orderpayment.StepTimeouts{Deadline: 20 * time.Second, CompensationDeadline: 20 * time.Second},
		SweepInterval: 200 * time.Millisecond,
		QueueEveryHop: queueEveryHop,
		Logger:        logger(),
	})
	require.NoError(t, err)
	require.NoError(t, app.Setup(ctx))
	churn, err := sagatest.StartChurn(sagatest.ChurnConfig{Workers: 3, Seed: seed, Logger: logger(),
		New: func() (sagatest.Worker, error) { return app.NewWorker() }})
	require.NoError(t, err)
	defer churn.Stop() //nolint:errcheck // stopped and checked below

	// Customers and orders: some beyond their balance, some cancelled by
	// the customer a moment later.
	customers := make([]string, 25)
	for i := range customers {
		customers[i] = fmt.Sprintf("chaos-%02d", i)
		require.NoError(t, app.Orders.AddCustomer(ctx, customers[i], "Chaos "+customers[i]))
		require.NoError(t, app.Payments.OpenAccount(ctx, customers[i]))
		require.NoError(t, app.Payments.Deposit(ctx, customers[i], 30_000, "seed"))
	}
	var (
		mu      sync.Mutex
		ids     []uuid.UUID
		wg      sync.WaitGroup
		cancels sync.WaitGroup
	)
	for g := range 4 {
		wg.Go(func() {
			for i := g; i < orderCount; i += 4 {
				res, err := app.Orders.Place(ctx, orders.PlaceRequest{Key: "chaos-" + strconv.Itoa(i), CustomerID: customers[i%len(customers)],
					AmountCents: int64(1_000 + (i*7919)%8_000)})
				if !assertNoError(t, err) {
					return
				}
				mu.Lock()
				ids = append(ids, saga.ID(orderpayment.Name, res.OrderID.String()))
				mu.Unlock()
				if i%10 == 3 {
					cancels.Go(func() {
						time.Sleep(time.Duration(i%50) * 10 * time.Millisecond)
						_ = app.Orders.CancelByCustomer(ctx, res.OrderID, "chaos")
					})
				}
			}
		})
	}
	wg.Wait()
	cancels.Wait()
	require.Len(t, ids, orderCount)

	// Let the churn go on while the sagas run, then let the system settle.
	time.Sleep(3 * time.Second) // the chaos schedule's last stretch, not a wait for a result
	churn.Calm()
	counts, err := sagatest.WaitTerminal(ctx, db.SQL, ids, 3*time.Minute)
	require.NoError(t, err, "seed %d", seed)
	require.NoError(t, churn.Stop(), "seed %d", seed)
	require.Zero(t, churn.CloseTimeouts(), "seed %d: no network fault here, so no stop may hang", seed)
	require.NoError(t, inj.Close())

	violations, err := sagatest.Checker{DB: db.SQL, Definitions: []*saga.Definition{app.Definition},
		Domain: domainInvariants()}.Check(ctx)
	require.NoError(t, err)
	for _, v := range violations {
		t.Errorf("seed %d: %s", seed, v)
	}

	st := inj.Stats()
	gwStats, err := gw.Stats(ctx)
	require.NoError(t, err)
	var dead int
	require.NoError(t, db.SQL.QueryRow(`SELECT count(*) FROM pgsaga_dead_letters`).Scan(&dead))
	t.Logf("chaos: %d orders in %s: %d completed, %d compensated, %d failed; %d worker restarts",
		orderCount, time.Since(start).Round(time.Millisecond), counts[saga.StatusCompleted], counts[saga.StatusCompensated], counts[saga.StatusFailed], churn.Restarts())
	t.Logf("chaos faults: %d messages duplicated (%d copies), %d crashes before commit, %d redeliveries after commit, %d connections killed, %d delays; gateway faults %v over %d calls",
		st.Duplicated, st.Copies, st.CrashesBefore, st.CrashesAfter, st.ConnectionsKilled, st.Delays, gwStats.Faults, gwStats.Calls)
	t.Logf("chaos recovery: %d handler attempts, %d retried; %d duplicate commands answered from the store; %d dead letters; gateway %d charges, %d refunds",
		st.Attempts, st.Retries, st.Replayed, dead, gwStats.Charges, gwStats.Refunds)
}

func assertNoError(t *testing.T, err error) bool {
	t.Helper()
	if err != nil {
		t.Errorf("%v", err)
		return false
	}
	return true
}
