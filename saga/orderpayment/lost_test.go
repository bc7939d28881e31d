package orderpayment_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/internal/testdb"
	"github.com/pgsaga/pgsaga/internal/testlost"
	"github.com/pgsaga/pgsaga/saga/orderpayment"
)

// Setup rides out a connection lost under it: recording the subscriptions
// again is a no-op.
func TestSetupRetriesALostConnection(t *testing.T) {
	t.Parallel()
	db := testdb.Fresh(t)
	app, err := orderpayment.New(orderpayment.Config{DB: db.SQL, GatewayURL: "http://127.0.0.1:1", Logger: logger()})
	require.NoError(t, err)
	subs := app.Client.Subscriptions()
	err = testlost.Terminated(t, db, `INSERT INTO pgsaga_subscriptions (topic, consumer_group) VALUES ($1, $2)`,
		[]any{subs[0].Topic, subs[0].ConsumerGroup}, func() error { return app.Setup(context.Background()) })
	require.NoError(t, err)
	for _, s := range subs {
		var n int
		require.NoError(t, db.SQL.QueryRow(`SELECT count(*) FROM pgsaga_subscriptions WHERE topic = $1 AND consumer_group = $2`, s.Topic, s.ConsumerGroup).Scan(&n))
		assert.Equal(t, 1, n, "%s of %s", s.ConsumerGroup, s.Topic)
	}
}
