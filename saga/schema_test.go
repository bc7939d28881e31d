package saga_test

import (
	"context"
	"net/url"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/internal/testdb"
	"github.com/pgsaga/pgsaga/saga"
	"github.com/pgsaga/pgsaga/saga/delivery"
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

// schemaClient is a started client of schema over pool, serving one saga
// of one step ("schema.trip"); migrate migrates its database first.
func schemaClient(t *testing.T, pool *pgxpool.Pool, schema string, migrate bool) *saga.Client {
	t.Helper()
	ctx := context.Background()
	client, err := saga.NewClient(pool, saga.ClientConfig{Schema: schema, Logger: logger(), FinishedChannel: "schema_" + schema})
	require.NoError(t, err)
	if migrate {
		_, err = client.Migrate(ctx)
		require.NoError(t, err)
	}
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
	return client
}

// runSaga starts a schema.trip of key on client, in a transaction of pool,
// and waits for it to complete.
func runSaga(t *testing.T, client *saga.Client, pool *pgxpool.Pool, key string) {
	t.Helper()
	ctx := context.Background()
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

// runOneSaga migrates pool's database through a client of schema, and
// runs one saga of one step on it to its end.
func runOneSaga(t *testing.T, pool *pgxpool.Pool, schema, key string) {
	t.Helper()
	runSaga(t, schemaClient(t, pool, schema, true), pool, key)
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

	client := unstarted(t, pool, "tenant_c")
	_, err := client.Migrate(ctx)
	require.ErrorIs(t, err, saga.ErrSchemaNotOnPath)
	assert.Contains(t, err.Error(), `search_path`, "the error says what to set")
	assert.Zero(t, tablesIn(t, pool, "public"), "Migrate wrote nothing")
	assert.Zero(t, tablesIn(t, pool, "tenant_c"), "Migrate wrote nothing")
	require.ErrorIs(t, client.Start(ctx), saga.ErrSchemaNotOnPath)
	require.ErrorIs(t, client.Setup(ctx), saga.ErrSchemaNotOnPath)

	for _, bad := range []string{"Tenant", "pg_x", "9a", "a-b", "a;DROP TABLE x", "information_schema", string(make([]byte, 64))} {
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
	client := unstarted(t, pool, "tenant_e")
	err = client.Setup(ctx)
	require.ErrorIs(t, err, saga.ErrSchemaNotOnPath)
	assert.Contains(t, err.Error(), "public.pgsaga_queue")
	require.ErrorIs(t, client.Start(ctx), saga.ErrSchemaNotOnPath)

	_, err = client.Migrate(ctx)
	require.NoError(t, err)
	assert.Equal(t, tablesIn(t, pool, "public"), tablesIn(t, pool, "tenant_e"), "every table, in tenant_e too")
	require.NoError(t, client.Setup(ctx))
}

// A transaction handed to StartTx or PublishTx that resolves names in
// another schema than the client's is refused, before anything is
// written: its trigger would land in public's queue, which nothing of the
// client reads.
func TestACallersTransactionInAnotherSchemaIsRefused(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.Fresh(t) // pgsaga in public too
	pool := schemaPool(t, db.URL, "tenant_f, public")
	client := schemaClient(t, pool, "tenant_f", true)
	other := schemaPool(t, db.URL, "")
	tx, err := other.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }()
	_, err = client.StartTx(ctx, saga.PgxTx(tx), "schema.trip", started{Trip: "elsewhere"})
	require.ErrorIs(t, err, saga.ErrSchemaNotOnPath)
	msg := message.NewMessage(uuid.NewString(), []byte(`{}`))
	require.ErrorIs(t, client.PublishTx(ctx, saga.PgxTx(tx), "schema.trips", msg), saga.ErrSchemaNotOnPath)
	require.NoError(t, tx.Commit(ctx))
	var queued int
	require.NoError(t, other.QueryRow(ctx, `SELECT count(*) FROM public.pgsaga_queue`).Scan(&queued))
	assert.Zero(t, queued, "nothing went to public's queue")

	runSaga(t, client, pool, "here") // a transaction of the client's search path starts one
}

// A schema that lacks a table of this version (migrated by an older one,
// say) is refused by Setup, naming the table the search path would have
// fallen through to.
func TestASchemaMissingATableIsRefused(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.Fresh(t)
	pool := schemaPool(t, db.URL, "tenant_h, public")
	client := unstarted(t, pool, "tenant_h")
	_, err := client.Migrate(ctx)
	require.NoError(t, err)
	require.NoError(t, client.Setup(ctx))
	_, err = pool.Exec(ctx, `DROP TABLE tenant_h.saga_definitions`)
	require.NoError(t, err)
	err = client.Setup(ctx)
	require.ErrorIs(t, err, saga.ErrSchemaNotOnPath)
	assert.Contains(t, err.Error(), "public.saga_definitions")
}

// docGrants is docs/operating.md's SQL granting a worker its privileges,
// for role on database in schema.
func docGrants(t *testing.T, role, database, schema string) []string {
	t.Helper()
	doc, err := os.ReadFile("../docs/operating.md")
	require.NoError(t, err)
	text := string(doc)
	start := strings.Index(text, "-- A worker (saga.Client.Start")
	end := strings.Index(text, "-- An operator")
	require.True(t, start > 0 && end > start, "the worker's grants in docs/operating.md")
	var stmts []string
	for _, stmt := range strings.Split(text[start:end], ";") {
		var lines []string
		for _, line := range strings.Split(stmt, "\n") {
			if l := strings.TrimSpace(line); l != "" && !strings.HasPrefix(l, "--") {
				lines = append(lines, l)
			}
		}
		if len(lines) == 0 {
			continue
		}
		q := strings.Join(lines, " ")
		q = strings.ReplaceAll(q, "pgsaga_worker", role)
		q = strings.ReplaceAll(q, "ON DATABASE app", `ON DATABASE "`+database+`"`)
		q = strings.ReplaceAll(q, "ON SCHEMA public", "ON SCHEMA "+schema)
		stmts = append(stmts, q)
	}
	require.GreaterOrEqual(t, len(stmts), 5)
	return stmts
}

// A worker role given exactly the grants docs/operating.md lists, in a
// schema of its own, starts and runs sagas; without USAGE on the schema it
// is refused saying so. (The grants used to lack INSERT on
// pgsaga_settings, which every start needs.)
func TestTheDocumentedWorkerGrantsRunASagaInASchema(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.Empty(t)
	const schema = "tenant_g"
	admin := schemaPool(t, db.URL, schema+", public")
	owner := unstarted(t, admin, schema)
	_, err := owner.Migrate(ctx)
	require.NoError(t, err)

	role, roleURL := loginRole(t, admin, db.URL)
	for _, q := range docGrants(t, role, db.Name, schema) {
		_, err := admin.Exec(ctx, q)
		require.NoError(t, err, q)
	}
	worker := schemaPool(t, roleURL, schema+", public")

	_, err = admin.Exec(ctx, `REVOKE USAGE ON SCHEMA `+schema+` FROM `+role)
	require.NoError(t, err)
	noUsage := unstarted(t, worker, schema)
	err = noUsage.Start(ctx)
	require.ErrorIs(t, err, saga.ErrSchemaNotOnPath)
	assert.Contains(t, err.Error(), "may not use schema")
	_, err = admin.Exec(ctx, `GRANT USAGE ON SCHEMA `+schema+` TO `+role)
	require.NoError(t, err)

	client := schemaClient(t, worker, schema, false)
	runSaga(t, client, worker, "granted")
	require.NoError(t, client.Health(ctx))
}

// loginRole creates a role that may log in, dropped with what it owns when
// the test ends, and returns it and dbURL as that role.
func loginRole(t *testing.T, admin *pgxpool.Pool, dbURL string) (role, roleURL string) {
	t.Helper()
	role = "worker_" + strings.ReplaceAll(uuid.NewString()[:8], "-", "")
	_, err := admin.Exec(context.Background(), `CREATE ROLE `+role+` LOGIN PASSWORD 'pw-`+role+`'`)
	require.NoError(t, err)
	t.Cleanup(func() {
		_, _ = admin.Exec(context.Background(), `DROP OWNED BY `+role)
		_, _ = admin.Exec(context.Background(), `DROP ROLE `+role)
	})
	u, err := url.Parse(dbURL)
	require.NoError(t, err)
	u.User = url.UserPassword(role, "pw-"+role)
	return role, u.String()
}

// A worker of a schema created but not migrated, beside an installation
// in public it has no privileges on, is told to migrate (the schema is
// checked before the privileges), not sent to grant it privileges on
// public's tables.
func TestAWorkerOfAnUnmigratedSchemaIsToldToMigrate(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.Fresh(t) // pgsaga in public
	admin := schemaPool(t, db.URL, "")
	role, roleURL := loginRole(t, admin, db.URL)
	_, err := admin.Exec(ctx, `CREATE SCHEMA tenant_i`)
	require.NoError(t, err)
	_, err = admin.Exec(ctx, `GRANT USAGE, CREATE ON SCHEMA tenant_i TO `+role)
	require.NoError(t, err)
	client, err := saga.NewClient(schemaPool(t, roleURL, "tenant_i, public"), saga.ClientConfig{Schema: "tenant_i", Logger: logger()})
	require.NoError(t, err)
	err = client.Start(ctx)
	require.ErrorIs(t, err, saga.ErrSchemaNotOnPath)
	assert.NotErrorIs(t, err, delivery.ErrMissingPrivileges)
	assert.Contains(t, err.Error(), "run Migrate")
}

// A schema named by an SQL keyword is created and migrated into like any
// other: CREATE SCHEMA quotes it.
func TestASchemaNamedByAKeyword(t *testing.T) {
	t.Parallel()
	db := testdb.Empty(t)
	pool := schemaPool(t, db.URL, "order, public")
	client := unstarted(t, pool, "order")
	_, err := client.Migrate(context.Background())
	require.NoError(t, err)
	assert.Positive(t, tablesIn(t, pool, "order"))
	require.NoError(t, client.Setup(context.Background()))
}

// unstarted is a client of schema over pool, not started.
func unstarted(t *testing.T, pool *pgxpool.Pool, schema string) *saga.Client {
	t.Helper()
	client, err := saga.NewClient(pool, saga.ClientConfig{Schema: schema, Logger: logger()})
	require.NoError(t, err)
	return client
}
