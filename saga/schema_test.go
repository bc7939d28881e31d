package saga_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/internal/testdb"
	"github.com/pgsaga/pgsaga/saga"
	"github.com/pgsaga/pgsaga/steps"
)

// schemaPool is a pool on url whose connections resolve names in
// searchPath ("" for the server's default).
func schemaPool(t *testing.T, url, searchPath string) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(url)
	require.NoError(t, err)
	if searchPath != "" {
		cfg.ConnConfig.RuntimeParams["search_path"] = searchPath
	}
	cfg.MaxConns = 8
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	return pool
}

// tablesIn counts the tables of schema.
func tablesIn(t *testing.T, pool *pgxpool.Pool, schema string) int {
	t.Helper()
	var n int
	require.NoError(t, pool.QueryRow(context.Background(), `SELECT count(*) FROM pg_tables WHERE schemaname = $1`, schema).Scan(&n))
	return n
}

// runOneSaga migrates pool's database through a client of schema, and
// runs one saga of one step on it to its end.
func runOneSaga(t *testing.T, pool *pgxpool.Pool, schema, key string) {
	t.Helper()
	ctx := context.Background()
	client, err := saga.NewClient(pool, saga.ClientConfig{Schema: schema, Logger: logger(), FinishedChannel: "schema_" + schema})
	require.NoError(t, err)
	_, err = client.Migrate(ctx)
	require.NoError(t, err)
	book := steps.Define("schema.book", "schema.book", func(ctx context.Context, tx *steps.Tx, s started) (steps.Message, error) {
		_, err := tx.ExecContext(ctx, `SELECT 1`)
		return nil, err
	})
	require.NoError(t, client.Register(saga.MustDefine(saga.Spec[started]{Name: "schema.trip",
		Trigger: saga.On("schema.trips", func(s started) (string, started, error) { return s.Trip, s, nil }),
		Steps:   []saga.Step[started]{{Name: "book", Action: saga.Send(book, func(s started) started { return s })}},
	})))
	require.NoError(t, client.AddSteps(book))
	require.NoError(t, client.Start(ctx))
	t.Cleanup(func() { assert.NoError(t, client.Stop(context.Background())) })
	tx, err := pool.Begin(ctx)
	require.NoError(t, err)
	id, err := client.StartTx(ctx, saga.PgxTx(tx), "schema.trip", started{Trip: key})
	require.NoError(t, err)
	require.NoError(t, tx.Commit(ctx))
	wctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	inst, err := client.WaitFinished(wctx, id)
	require.NoError(t, err)
	require.Equal(t, saga.StatusCompleted, inst.Status)
}

// Two pgsaga installations in two schemas of one database: each migrates
// and runs its sagas in its own schema, and nothing lands in public.
func TestASchemaHoldsEveryTableOfItsClient(t *testing.T) {
	t.Parallel()
	db := testdb.Empty(t)
	a := schemaPool(t, db.URL, "tenant_a, public")
	b := schemaPool(t, db.URL, "tenant_b, public")
	runOneSaga(t, a, "tenant_a", "trip-a")
	runOneSaga(t, b, "tenant_b", "trip-b")

	assert.Zero(t, tablesIn(t, a, "public"), "no pgsaga table in public")
	assert.Equal(t, tablesIn(t, a, "tenant_a"), tablesIn(t, a, "tenant_b"), "each schema holds every table")
	for _, table := range []string{"saga_instances", "idempotency_keys", "pgsaga_queue", "domain_events", "pgsaga_dead_letters"} {
		assert.Positive(t, tablesNamed(t, a, "tenant_a", table), table)
	}
	rows, err := a.Query(context.Background(), `SELECT data->>'trip' FROM tenant_a.saga_instances`)
	require.NoError(t, err)
	keys, err := pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	assert.Equal(t, []string{"trip-a"}, keys, "tenant_b's saga is in tenant_b alone")
}

func tablesNamed(t *testing.T, pool *pgxpool.Pool, schema, table string) int {
	t.Helper()
	var n int
	require.NoError(t, pool.QueryRow(context.Background(), `SELECT count(*) FROM pg_tables WHERE schemaname = $1 AND tablename = $2`, schema, table).Scan(&n))
	return n
}

// A Schema the pool does not resolve names in first is refused by
// Migrate before it writes a table, and by Start before it reads one; a
// Schema that is not a plain lowercase identifier, by NewClient.
func TestASchemaOffThePoolsPathIsRefused(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.Empty(t)
	pool := schemaPool(t, db.URL, "")

	client, err := saga.NewClient(pool, saga.ClientConfig{Schema: "tenant_c", Logger: logger()})
	require.NoError(t, err)
	_, err = client.Migrate(ctx)
	require.ErrorIs(t, err, saga.ErrSchemaNotOnPath)
	assert.Contains(t, err.Error(), `search_path`, "the error says what to set")
	assert.Zero(t, tablesIn(t, pool, "public"), "Migrate wrote nothing")
	assert.Zero(t, tablesIn(t, pool, "tenant_c"), "Migrate wrote nothing")
	require.ErrorIs(t, client.Start(ctx), saga.ErrSchemaNotOnPath)
	require.ErrorIs(t, client.Setup(ctx), saga.ErrSchemaNotOnPath)

	for _, bad := range []string{"Tenant", "pg_x", "9a", "a-b", "a;DROP TABLE x", string(make([]byte, 64))} {
		_, err := saga.NewClient(pool, saga.ClientConfig{Schema: bad})
		assert.ErrorContains(t, err, "Schema", "%q", bad)
	}
}

// Beside an installation in public, a schema created but not migrated is
// refused by Setup and Start (the search path would fall through to
// public's tables), and Migrate installs pgsaga in it, apart.
func TestASchemaNotMigratedDoesNotFallThroughToPublic(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.Fresh(t) // pgsaga in public
	pool := schemaPool(t, db.URL, "tenant_e, public")
	_, err := pool.Exec(ctx, `CREATE SCHEMA tenant_e`)
	require.NoError(t, err)
	client, err := saga.NewClient(pool, saga.ClientConfig{Schema: "tenant_e", Logger: logger()})
	require.NoError(t, err)
	err = client.Setup(ctx)
	require.ErrorIs(t, err, saga.ErrSchemaNotOnPath)
	assert.Contains(t, err.Error(), "public.pgsaga_queue")
	require.ErrorIs(t, client.Start(ctx), saga.ErrSchemaNotOnPath)

	_, err = client.Migrate(ctx)
	require.NoError(t, err)
	assert.Equal(t, tablesIn(t, pool, "public"), tablesIn(t, pool, "tenant_e"), "every table, in tenant_e too")
	require.NoError(t, client.Setup(ctx))
}
