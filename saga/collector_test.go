package saga_test

import (
	"context"
	"io"
	"log/slog"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/saga"
)

// The collector reads a running saga, and every consumer group, from the
// database.
func TestCollectorReadsTheDatabase(t *testing.T) {
	t.Parallel()
	client, _, _ := newSignupClient(t) // not started: what it publishes waits
	require.NoError(t, client.Setup(context.Background()))
	reg := prometheus.NewRegistry()
	reg.MustRegister(client.Collector())
	n, err := testutil.GatherAndCount(reg, "pgsaga_consumer_depth")
	require.NoError(t, err)
	assert.Equal(t, len(client.Subscriptions()), n, "a depth for every consumer group")
	assert.Equal(t, 1.0, gauge(t, reg, "pgsaga_database_up"))
}

// With the database gone, a scrape still answers, at once, with
// pgsaga_database_up 0 and none of the values it could not read.
func TestCollectorWithoutADatabase(t *testing.T) {
	t.Parallel()
	cfg, err := pgx.ParseConfig("postgres://nobody@127.0.0.1:1/none?connect_timeout=1")
	require.NoError(t, err)
	db := stdlib.OpenDB(*cfg)
	t.Cleanup(func() { _ = db.Close() })
	client, err := saga.NewClientFromDB(db, saga.ClientConfig{Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	require.NoError(t, err)
	reg := prometheus.NewRegistry()
	reg.MustRegister(client.Collector())
	start := time.Now()
	fams, err := reg.Gather()
	require.NoError(t, err, "the scrape itself does not fail")
	assert.Less(t, time.Since(start), saga.CollectTimeout+time.Second)
	require.Len(t, fams, 1)
	assert.Equal(t, "pgsaga_database_up", fams[0].GetName())
	assert.Equal(t, 0.0, fams[0].GetMetric()[0].GetGauge().GetValue())
}

func gauge(t *testing.T, reg *prometheus.Registry, name string) float64 {
	t.Helper()
	fams, err := reg.Gather()
	require.NoError(t, err)
	for _, f := range fams {
		if f.GetName() == name {
			return f.GetMetric()[0].GetGauge().GetValue()
		}
	}
	t.Fatalf("no %s", name)
	return 0
}
