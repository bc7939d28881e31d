package main

import (
	"context"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/internal/dbtx"
	"github.com/pgsaga/pgsaga/internal/testdb"
)

// Each statement is pinned on who sends it, from its text.
func TestOwnerOf(t *testing.T) {
	t.Parallel()
	for query, owner := range map[string]string{
		"begin isolation level read committed": ownerTransactions,
		"COMMIT":                               ownerTransactions,
		"ROLLBACK TO SAVEPOINT pgsaga_attempt; RELEASE SAVEPOINT pgsaga_attempt": ownerTransactions,
		"SAVEPOINT pgsaga_request":      ownerTransactions,
		"-- ping\nSAVEPOINT x":          ownerTransactions,
		"SET CONSTRAINTS ALL IMMEDIATE": ownerTransactions,
		"WITH settings AS (SELECT set_config($1, $2, true)) UPDATE pgsaga_queue SET":                               ownerDelivery,
		"DELETE FROM pgsaga_queue WHERE id = $1":                                                                   ownerDelivery,
		"SELECT set_config($3, $1, $4) AS pgsaga_lock_timeout, set_config($5, $2, $6) AS pgsaga_statement_timeout": ownerDelivery,
		"SELECT pg_notify($1, $2)":                                  ownerDelivery,
		"INSERT INTO idempotency_keys (scope, key) VALUES ($1, $2)": ownerDelivery,
		"SELECT id FROM saga_instances WHERE id = $1":               ownerEngine,
		"INSERT INTO saga_history (saga_id) VALUES ($1)":            ownerEngine,
		"INSERT INTO domain_events (event_id) VALUES ($1)":          ownerDomain,
		"UPDATE accounts SET version = version + 1":                 ownerDomain,
		"INSERT INTO order_views AS v (order_id) VALUES ($1)":       ownerDomain,
		"INSERT INTO fake_gateway_operations (key) VALUES ($1)":     ownerGateway,
		// The gateway's table named in a statement of the delivery's is
		// the gateway's; a domain table named with an engine's, the engine's.
		"WITH c AS (INSERT INTO fake_gateway_call_counts (key) VALUES ($1)) SELECT pg_notify($1, $2)": ownerGateway,
		"SELECT o.id FROM order_views o JOIN saga_instances s ON s.id = o.saga_id":                    ownerEngine,
		// A word that contains a table's name is not the table.
		"SELECT my_saga_instances_copy FROM x": ownerDomain,
		"SELECT begin_at FROM orders":          ownerDomain,
	} {
		assert.Equal(t, owner, ownerOf(query), query)
	}
}

// Statements by owner add up to statements a saga, from the count they
// come from, and the list is most called first.
func TestStatementsByOwnerAddUp(t *testing.T) {
	t.Parallel()
	from := statementCount{serverOK: true, server: 10, serverByText: map[string]int64{"COMMIT": 4, "SELECT 1 FROM saga_instances": 6},
		client: 1, clientByText: map[string]int64{"SELECT 1": 1}, commits: 3}
	to := statementCount{serverOK: true, server: 60, serverByText: map[string]int64{"COMMIT": 24, "SELECT 1 FROM saga_instances": 16,
		"DELETE FROM pgsaga_queue": 10, "INSERT INTO fake_gateway_operations": 10}, client: 2, clientByText: map[string]int64{"SELECT 1": 2}, commits: 23}
	f := perSaga(from, to, 10, false)
	assert.Equal(t, 5.0, f.perSaga)
	assert.Equal(t, map[string]float64{ownerTransactions: 2, ownerEngine: 1, ownerDelivery: 1, ownerGateway: 1, ownerDomain: 0}, f.byOwner)
	assert.Equal(t, 2.0, f.commitsPerSaga)
	require.Len(t, f.list, 4)
	assert.Equal(t, statementLine{perSaga: 2, owner: ownerTransactions, query: "COMMIT"}, f.list[0])
	var out strings.Builder
	require.NoError(t, writeList(&out, f.list))
	assert.Equal(t, "2.00\ttransactions\tCOMMIT\n1.00\tdelivery\tDELETE FROM pgsaga_queue\n"+
		"1.00\tengine\tSELECT 1 FROM saga_instances\n1.00\tgateway\tINSERT INTO fake_gateway_operations\n", out.String())

	// Without the server's count, the pools' is split.
	from.serverOK = false
	f = perSaga(from, to, 1, false)
	assert.Equal(t, map[string]float64{ownerDomain: 1, ownerDelivery: 0, ownerEngine: 0, ownerGateway: 0, ownerTransactions: 0}, f.byOwner)
}

// The pools' tracer counts a commit for each COMMIT and for each statement
// or pipeline sent outside a transaction, and none for what is rolled back
// or for a statement inside a transaction.
func TestCommitsCounted(t *testing.T) {
	t.Parallel()
	db := testdb.Fresh(t)
	cfg, err := pgx.ParseConfig(db.URL)
	require.NoError(t, err)
	var c statementCounter
	cfg.Tracer = &c
	ctx := context.Background()
	conn, err := pgx.ConnectConfig(ctx, cfg)
	require.NoError(t, err)
	defer conn.Close(ctx)
	step := func(what string, want, wantTrips int64, fn func() error) {
		t.Helper()
		before, trips := c.commits.Load(), c.trips.Load()
		require.NoError(t, fn(), what)
		assert.Equal(t, want, c.commits.Load()-before, "commits of "+what)
		assert.Equal(t, wantTrips, c.trips.Load()-trips, "round trips of "+what)
	}
	exec := func(q string) func() error {
		return func() error { _, err := conn.Exec(ctx, q); return err }
	}
	step("a statement on its own", 1, 1, exec("SELECT 1"))
	step("a transaction", 1, 4, func() error {
		tx, err := conn.Begin(ctx)
		if err != nil {
			return err
		}
		if _, err := tx.Exec(ctx, "SELECT 1"); err != nil {
			return err
		}
		if _, err := tx.Exec(ctx, "SELECT 2"); err != nil {
			return err
		}
		return tx.Commit(ctx)
	})
	step("a transaction rolled back", 0, 3, func() error {
		tx, err := conn.Begin(ctx)
		if err != nil {
			return err
		}
		if _, err := tx.Exec(ctx, "SELECT 1"); err != nil {
			return err
		}
		return tx.Rollback(ctx)
	})
	step("a pipeline on its own", 1, 1, func() error {
		b := &pgx.Batch{}
		b.Queue("SELECT 1")
		b.Queue("SELECT 2")
		return conn.SendBatch(ctx, b).Close()
	})
	step("a pipeline in a transaction", 1, 3, func() error {
		tx, err := conn.Begin(ctx)
		if err != nil {
			return err
		}
		b := &pgx.Batch{}
		b.Queue("SELECT 1")
		b.Queue("SELECT 2")
		if err := tx.SendBatch(ctx, b).Close(); err != nil {
			return err
		}
		return tx.Commit(ctx)
	})
	step("a pipelined transaction (dbtx.Pipe)", 1, 2, func() error {
		p := dbtx.BeginPipe(conn)
		if _, err := p.ExecContext(ctx, "SELECT 1"); err != nil {
			return err
		}
		if err := p.QueueExec("two", "SELECT 2"); err != nil {
			return err
		}
		return p.Commit(ctx)
	})
	step("a pipelined transaction rolled back", 0, 2, func() error {
		p := dbtx.BeginPipe(conn)
		if _, err := p.ExecContext(ctx, "SELECT 1"); err != nil {
			return err
		}
		return p.Rollback(ctx)
	})
	assert.Equal(t, int64(4), c.texts()["SELECT 2"], "counted by text too")

	// The gateway's pool: its statements counted, its commits apart.
	gcfg := cfg.Copy()
	gcfg.Tracer = c.gateway()
	gconn, err := pgx.ConnectConfig(ctx, gcfg)
	require.NoError(t, err)
	defer gconn.Close(ctx)
	before, commitsBefore, tripsBefore := c.n.Load(), c.commits.Load(), c.trips.Load()
	_, err = gconn.Exec(ctx, "SELECT 1")
	require.NoError(t, err)
	b := &pgx.Batch{}
	b.Queue("SELECT 1")
	require.NoError(t, gconn.SendBatch(ctx, b).Close())
	assert.Equal(t, int64(2), c.n.Load()-before)
	assert.Equal(t, commitsBefore, c.commits.Load())
	assert.Equal(t, tripsBefore, c.trips.Load(), "the gateway's round trips are not the saga's")
	assert.Equal(t, int64(2), c.gatewayCommits.Load())
}
