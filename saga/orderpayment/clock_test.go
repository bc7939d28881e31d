package orderpayment_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/assert"
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

// One clock: every deadline, timeout and finished_at is the database's,
// whatever the worker's clock says. The sample runs against a server whose
// clock is a minute ahead of the worker's, then a minute behind
// (libfaketime): no command is overdue before its deadline by the
// database's clock (nothing re-sent, given up on or timed out), each
// command's deadline is its step's Deadline after its send, the saga's
// own deadline is its Timeout after its start, and the latency (finished
// minus created) is what it took. With the worker's clock in the mix, the
// database a minute ahead re-sent every command at once and reported a
// latency of -55 s.
func TestTheDatabasesClockIsTheOnlyClock(t *testing.T) {
	for _, skew := range []time.Duration{time.Minute, -time.Minute} {
		t.Run(fmt.Sprintf("database %+.0fs", skew.Seconds()), func(t *testing.T) {
			t.Parallel()
			srv := testdb.StartPrivateSkewed(t, skew)
			ctx := context.Background()
			open := func(conns int32) *pgdb.DB {
				db, err := pgdb.Open(ctx, pgdb.Config{URL: srv.URL, MaxConns: conns, ConnectTimeout: 30 * time.Second})
				require.NoError(t, err)
				t.Cleanup(db.Close)
				return db
			}
			db := open(20)
			var serverNow time.Time
			require.NoError(t, db.SQL.QueryRow(`SELECT clock_timestamp()`).Scan(&serverNow))
			require.InDelta(t, skew.Seconds(), serverNow.Sub(time.Now()).Seconds(), 5, "the server's clock is off by the skew")
			_, err := orderpayment.Migrate(ctx, db.SQL)
			require.NoError(t, err)
			slow := make(chan struct{})
			gw, err := fakegateway.Start(ctx, fakegateway.Config{DB: open(4).SQL, Logger: logger(), SlowDelay: 2 * time.Second,
				Faults: func(c fakegateway.Call) fakegateway.Fault {
					select {
					case <-slow:
						return fakegateway.None
					default:
						return fakegateway.Slow
					}
				}})
			require.NoError(t, err)
			t.Cleanup(func() { _ = gw.Close() })
			// Well under the skew (a clock mixed in shows by a minute), and
			// long enough for a reply on a loaded machine (4 s was not).
			const deadline = 15 * time.Second
			app, err := orderpayment.New(orderpayment.Config{
				DB: db.SQL, GatewayURL: gw.URL(), GatewayTimeout: 3 * time.Second, GatewayLease: 5 * time.Second,
				Transport:     transport.Config{PollInterval: 20 * time.Millisecond, IdlePollInterval: testdb.NoSafetyPoll, RetryInterval: 50 * time.Millisecond},
				Timeouts:      orderpayment.StepTimeouts{Deadline: deadline, CompensationDeadline: deadline},
				SweepInterval: 50 * time.Millisecond,
				Logger:        logger(),
			})
			require.NoError(t, err)
			require.NoError(t, app.Setup(ctx))
			w, err := app.NewWorker()
			require.NoError(t, err)
			require.NoError(t, w.Start(ctx))
			t.Cleanup(func() { _ = w.Stop() })
			customer := "clock-" + uuid.NewString()[:6]
			require.NoError(t, app.Orders.AddCustomer(ctx, customer, "C"))
			require.NoError(t, app.Payments.OpenAccount(ctx, customer))
			require.NoError(t, app.Payments.Deposit(ctx, customer, 10_000_000, "seed"))
			place := func() uuid.UUID {
				res, err := app.Orders.Place(ctx, orders.PlaceRequest{Key: uuid.NewString(), CustomerID: customer, AmountCents: 1_000})
				require.NoError(t, err)
				return saga.ID(orderpayment.Name, res.OrderID.String())
			}

			// The first charge is slow at the gateway: its deadline, by the
			// database's clock, is a Deadline after its send.
			first := place()
			var sentAt, deadlineAt, createdAt, expiresAt time.Time
			require.Eventually(t, func() bool {
				err := db.SQL.QueryRow(`SELECT h.at, i.deadline_at, i.created_at, i.expires_at FROM saga_instances i
					JOIN saga_history h ON h.saga_id = i.id AND h.kind = 'sent' AND h.step = 'charge'
					WHERE i.id = $1 AND i.deadline_at IS NOT NULL`, first).Scan(&sentAt, &deadlineAt, &createdAt, &expiresAt)
				return err == nil
			}, 30*time.Second, 10*time.Millisecond, "the charge sent")
			assert.InDelta(t, deadline.Seconds(), deadlineAt.Sub(sentAt).Seconds(), 1, "the charge's deadline is its step's after its send")
			assert.InDelta(t, saga.TimeoutDefault.Seconds(), expiresAt.Sub(createdAt).Seconds(), 1, "the saga's deadline is its timeout after its start")
			close(slow)

			ids := []uuid.UUID{first}
			for range 60 {
				ids = append(ids, place())
			}
			counts, err := sagatest.WaitTerminal(ctx, db.SQL, ids, time.Minute)
			require.NoError(t, err)
			assert.Equal(t, len(ids), counts[saga.StatusCompleted], "%v", counts)
			var needless int
			var kinds string
			require.NoError(t, db.SQL.QueryRow(`SELECT count(*), coalesce(string_agg(kind || ' ' || coalesce(step, '') || ' +' || (h.at - i.created_at)::text, ', '), '')
				FROM saga_history h JOIN saga_instances i ON i.id = h.saga_id
				WHERE kind IN ('deadline', 'resent', 'awaiting_reply', 'timed_out', 'gave_up')`).Scan(&needless, &kinds))
			assert.Zero(t, needless, "nothing overdue by the database's clock was treated as overdue: %s", kinds)
			var shortest, longest float64
			require.NoError(t, db.SQL.QueryRow(`SELECT extract(epoch FROM min(finished_at - created_at)), extract(epoch FROM max(finished_at - created_at))
				FROM saga_instances`).Scan(&shortest, &longest))
			assert.GreaterOrEqual(t, shortest, 0.0, "no saga finished before it started")
			assert.Less(t, longest, 30.0, "latency is what it took")
			r, err := orderpayment.Check(ctx, db.SQL, ids)
			require.NoError(t, err)
			assert.True(t, r.OK(), "invariants: %v", r.Violations)
			assert.GreaterOrEqual(t, r.P50, time.Duration(0))
		})
	}
}
