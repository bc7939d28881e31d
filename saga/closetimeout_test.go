package saga_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/internal/testdb"
	"github.com/pgsaga/pgsaga/saga"
	"github.com/pgsaga/pgsaga/saga/delivery"
	"github.com/pgsaga/pgsaga/saga/sagatest/netfault"
	"github.com/pgsaga/pgsaga/steps"
)

// A worker stopped while the network to its database is cut cannot end
// its consumers' statements: Stop returns (once the drain and the
// consumers' statement timeout and 5 s have passed) an error matching
// delivery.ErrCloseTimeout, which the test kit's churn tells from a
// worker's failure.
func TestStopAcrossAPartitionIsACloseTimeout(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.Fresh(t)
	link, through := netfault.Through(t, db.URL)
	pool, err := pgxpool.New(ctx, through)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	client, err := saga.NewClient(pool, saga.ClientConfig{Logger: logger(), Transport: delivery.Config{
		DisableNotify: true, PollInterval: time.Millisecond, StatementTimeout: time.Second, CloseTimeout: time.Second}})
	require.NoError(t, err)
	idle := steps.Define("closetimeout.idle", "closetimeout.idle", func(context.Context, *steps.Tx, started) (steps.Message, error) { return nil, nil })
	require.NoError(t, client.AddSteps(idle)) // its consumer polls every millisecond
	require.NoError(t, client.Start(ctx))
	require.NoError(t, link.Partition(time.Minute))
	t.Cleanup(link.Heal)
	require.ErrorIs(t, client.Stop(ctx), delivery.ErrCloseTimeout)
}
