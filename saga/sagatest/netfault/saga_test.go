package netfault_test

import (
	"context"
	"database/sql"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/saga"
	"github.com/pgsaga/pgsaga/saga/delivery"
	"github.com/pgsaga/pgsaga/saga/sagatest"
	"github.com/pgsaga/pgsaga/saga/sagatest/netfault"
	"github.com/pgsaga/pgsaga/steps"
)

type booking struct {
	Guest string `json:"guest"`
}

func (booking) MessageType() string { return "hotel.Booking" }

// docs/failure-testing.md's example, as a user writes it: the kit's run
// (duplicates and crashes in the deliveries, workers replaced at random)
// with the service's connections to PostgreSQL through a link that is
// slow, then cut for 30 s, then resets connections mid-stream; every saga
// ends and the invariant holds.
func TestASagaAcrossABadNetwork(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := sagatest.DB(t)
	_, err := db.SQL.Exec(`CREATE TABLE rooms (guest text NOT NULL)`)
	require.NoError(t, err)

	// The service reaches PostgreSQL through the link; the kit checks
	// the database directly.
	link, through := netfault.Through(t, db.URL)
	require.NoError(t, link.Latency(20*time.Millisecond, 10*time.Millisecond))
	pool, err := pgxpool.New(ctx, through)
	require.NoError(t, err)
	t.Cleanup(pool.Close)

	run := sagatest.New(t, db.SQL, sagatest.Faults{Seed: 7, DuplicateRate: 0.3, CrashBeforeCommitRate: 0.05, CrashAfterCommitRate: 0.05})
	client, err := saga.NewClient(pool, saga.ClientConfig{
		Transport: delivery.Config{Intercept: run.Intercept},
		Logger:    sagatest.Logger(t),
	})
	require.NoError(t, err)
	reserve := steps.Define("hotel.reserve", "hotel.reserve", func(ctx context.Context, tx *steps.Tx, b booking) (steps.Message, error) {
		_, err := tx.ExecContext(ctx, `INSERT INTO rooms VALUES ($1)`, b.Guest)
		return nil, err
	})
	def := saga.MustDefine(saga.Spec[booking]{Name: "stay",
		Trigger: saga.On("hotel.bookings", func(b booking) (string, booking, error) { return b.Guest, b, nil }),
		Steps:   []saga.Step[booking]{{Name: "reserve", Action: saga.Send(reserve, func(b booking) booking { return b })}},
	})
	require.NoError(t, client.Register(def))
	require.NoError(t, client.AddSteps(reserve))
	run.Start(client, 2)

	var ids []uuid.UUID
	book := func(n int) { // as the service would: a booking cut off by the network is tried again, same guest, same saga
		for range n {
			guest := uuid.NewString()
			var err error
			for try := 0; try == 0 || err != nil; try++ {
				require.Less(t, try, 20, "booking %s: %v", guest, err)
				err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
					_, err := client.StartTx(ctx, saga.PgxTx(tx), "stay", booking{Guest: guest})
					return err
				})
			}
			ids = append(ids, saga.ID("stay", guest))
		}
	}
	book(20)
	require.NoError(t, link.Partition(30*time.Second)) // nothing crosses for 30 s; then it heals
	cut := time.Now()
	require.Eventually(t, func() bool { return time.Since(cut) > 30*time.Second }, time.Minute, 100*time.Millisecond)
	book(20)
	require.NoError(t, link.Reset(0.2)) // a fifth of the connections reset mid-stream
	book(10)
	require.NoError(t, link.Reset(0))

	run.Finish(2*time.Minute, ids, []*saga.Definition{def}, sagatest.Invariant{
		Name: "one room per guest",
		Check: func(ctx context.Context, db *sql.DB) ([]string, error) {
			return sagatest.Rows(ctx, db, `SELECT guest FROM rooms GROUP BY guest HAVING count(*) <> 1`)
		},
	})
}
