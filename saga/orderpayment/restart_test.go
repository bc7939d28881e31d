package orderpayment_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/internal/pgdb"
	"github.com/pgsaga/pgsaga/internal/testdb"
	"github.com/pgsaga/pgsaga/internal/transport"
	"github.com/pgsaga/pgsaga/orders"
	"github.com/pgsaga/pgsaga/payments/fakegateway"
	"github.com/pgsaga/pgsaga/saga"
	"github.com/pgsaga/pgsaga/saga/orderpayment"
	"github.com/pgsaga/pgsaga/saga/sagatest"
)

// PostgreSQL itself goes down in the middle of a run (once stopped cleanly,
// once as after a crash) and comes back: the workers reconnect and finish
// every saga, and every invariant holds. This needs a server of the test's
// own (see testdb.StartPrivate); it never touches the shared one.
func TestDatabaseRestart(t *testing.T) {
	srv := testdb.StartPrivate(t)
	ctx := context.Background()
	open := func(conns int32) *pgdb.DB {
		db, err := pgdb.Open(ctx, pgdb.Config{URL: srv.URL, MaxConns: conns, ConnectTimeout: 30 * time.Second})
		require.NoError(t, err)
		t.Cleanup(db.Close)
		return db
	}
	db := open(40)
	_, err := orderpayment.Migrate(ctx, db.SQL)
	require.NoError(t, err)
	gw, err := fakegateway.Start(ctx, fakegateway.Config{DB: open(4).SQL, Logger: logger()})
	require.NoError(t, err)
	t.Cleanup(func() { _ = gw.Close() })
	app, err := orderpayment.New(orderpayment.Config{
		DB: db.SQL, GatewayURL: gw.URL(), GatewayTimeout: 500 * time.Millisecond, GatewayLease: 2 * time.Second,
		Transport:     transport.Config{PollInterval: 20 * time.Millisecond, IdlePollInterval: testdb.NoSafetyPoll, RetryInterval: 50 * time.Millisecond, MaxRetryInterval: time.Second},
		Timeouts:      orderpayment.StepTimeouts{Deadline: 5 * time.Second, CompensationDeadline: 10 * time.Second},
		SweepInterval: 200 * time.Millisecond,
		Logger:        logger(),
	})
	require.NoError(t, err)
	require.NoError(t, app.Setup(ctx))
	var workers []*saga.Worker
	for range 2 {
		w, err := app.NewWorker()
		require.NoError(t, err)
		require.NoError(t, w.Start(context.Background()))
		workers = append(workers, w)
		t.Cleanup(func() { _ = w.Stop() })
	}

	customers := make([]string, 10)
	for i := range customers {
		customers[i] = "restart-" + uuid.NewString()[:6]
		require.NoError(t, app.Orders.AddCustomer(ctx, customers[i], "R"))
		require.NoError(t, app.Payments.OpenAccount(ctx, customers[i]))
		require.NoError(t, app.Payments.Deposit(ctx, customers[i], 20_000, "seed"))
	}
	var ids []uuid.UUID
	var mu sync.Mutex
	place := func(n int) {
		for i := range n {
			res, err := app.Orders.Place(ctx, orders.PlaceRequest{Key: uuid.NewString(), CustomerID: customers[i%len(customers)], AmountCents: int64(1_000 + 137*i%5_000)})
			require.NoError(t, err)
			mu.Lock()
			ids = append(ids, saga.ID(orderpayment.Name, res.OrderID.String()))
			mu.Unlock()
		}
	}

	for _, mode := range []string{"fast", "immediate"} {
		place(60)
		// Stop the server while sagas are in flight.
		deadline := time.Now().Add(30 * time.Second)
		for {
			var finished, total int
			require.NoError(t, db.SQL.QueryRow(`SELECT count(*) FILTER (WHERE status IN ('completed', 'compensated')), count(*) FROM saga_instances`).Scan(&finished, &total))
			if finished >= 5 && finished < total {
				break
			}
			require.True(t, time.Now().Before(deadline), "no saga finished before the restart")
			time.Sleep(5 * time.Millisecond)
		}
		require.NoError(t, srv.Stop(mode))
		t.Logf("server stopped (%s)", mode)
		time.Sleep(time.Second) // the outage, a stimulus rather than a wait for a result
		require.NoError(t, srv.Start())
		t.Logf("server started again")
	}

	counts, err := sagatest.WaitTerminal(ctx, db.SQL, ids, 2*time.Minute)
	require.NoError(t, err)
	t.Logf("after two restarts: %v", counts)
	for _, w := range workers {
		require.NoError(t, w.Stop())
	}
	violations, err := sagatest.Checker{DB: db.SQL, Definitions: []*saga.Definition{app.Definition},
		Domain: domainInvariants()}.Check(ctx)
	require.NoError(t, err)
	for _, v := range violations {
		t.Error(v)
	}
}
