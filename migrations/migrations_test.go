package migrations_test

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/internal/testdb"
	"github.com/pgsaga/pgsaga/internal/testout"
	"github.com/pgsaga/pgsaga/internal/testpg"
	"github.com/pgsaga/pgsaga/migrations"
)

func TestMain(m *testing.M) {
	// A copy of this test binary started by TestConcurrentProcesses applies
	// the migrations to the database it is given and exits.
	if url := os.Getenv("PGSAGA_MIGRATE_HELPER_URL"); url != "" {
		os.Exit(applyAndExit(url))
	}
	testpg.Main(m)
}

func applyAndExit(url string) int {
	db, err := sqlOpen(url)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	defer db.Close()
	if _, err := migrations.Apply(context.Background(), db.SQL); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	return 0
}

func TestApplyTwiceIsNoOp(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.Empty(t)

	applied, err := migrations.Apply(ctx, db.SQL)
	require.NoError(t, err)
	current, known, err := migrations.Version(ctx, db.SQL)
	require.NoError(t, err)
	require.NotEmpty(t, applied, "a fresh database must get every migration")
	assert.Equal(t, known, current)
	assert.Equal(t, known, applied[len(applied)-1])

	before := schemaFingerprint(t, db)
	applied, err = migrations.Apply(ctx, db.SQL)
	require.NoError(t, err)
	assert.Empty(t, applied, "the second run must apply nothing")
	assert.Equal(t, before, schemaFingerprint(t, db), "the second run must not change the schema")
	assertEachVersionOnce(t, db)
}

func TestConcurrentAppliersInOneProcess(t *testing.T) {
	t.Parallel()
	// The race without a lock is a narrow window; several rounds make a
	// missing lock show up on every run.
	for round := range 4 {
		t.Run(fmt.Sprintf("round%d", round), func(t *testing.T) {
			applyConcurrently(t, 8)
		})
	}
}

func applyConcurrently(t *testing.T, appliers int) {
	db := testdb.Empty(t)
	// Each applier has its own pool, as separate processes would.
	handles := make([]*sqlDB, appliers)
	for i := range handles {
		h, err := sqlOpen(db.URL)
		require.NoError(t, err)
		t.Cleanup(h.Close)
		handles[i] = h
	}
	var (
		wg    sync.WaitGroup
		start = make(chan struct{})
		errs  = make([]error, appliers)
		total = make([]int, appliers)
	)
	for i := range handles {
		wg.Go(func() {
			<-start
			applied, err := migrations.Apply(context.Background(), handles[i].SQL)
			errs[i], total[i] = err, len(applied)
		})
	}
	close(start)
	wg.Wait()

	sum := 0
	for i := range errs {
		require.NoError(t, errs[i], "applier %d", i)
		sum += total[i]
	}
	current, known, err := migrations.Version(context.Background(), db.SQL)
	require.NoError(t, err)
	assert.Equal(t, known, current)
	assert.Equal(t, countSources(t), sum, "every migration must be applied by exactly one applier")
	assertEachVersionOnce(t, db)
}

func TestConcurrentProcesses(t *testing.T) {
	t.Parallel()
	db := testdb.Empty(t)
	const procs = 4

	cmds := make([]*exec.Cmd, procs)
	outs := make([]*testout.Buffer, procs)
	for i := range cmds {
		cmd := exec.Command(os.Args[0], "-test.run=^$")
		cmd.Env = append(os.Environ(), "PGSAGA_MIGRATE_HELPER_URL="+db.URL)
		outs[i] = &testout.Buffer{}
		cmd.Stdout, cmd.Stderr = outs[i], outs[i]
		cmds[i] = cmd
	}
	for _, c := range cmds {
		require.NoError(t, c.Start())
	}
	for i, c := range cmds {
		require.NoError(t, c.Wait(), "process %d failed: %s", i, outs[i].String())
	}
	current, known, err := migrations.Version(context.Background(), db.SQL)
	require.NoError(t, err)
	assert.Equal(t, known, current)
	assertEachVersionOnce(t, db)
}

func TestTemplateIsMigrated(t *testing.T) {
	t.Parallel()
	db := testdb.Shared(t)
	current, known, err := migrations.Version(context.Background(), db.SQL)
	require.NoError(t, err)
	assert.Equal(t, known, current)
	var exists bool
	require.NoError(t, db.SQL.QueryRow(`SELECT to_regclass('idempotency_keys') IS NOT NULL`).Scan(&exists))
	assert.True(t, exists)
}

// pgsaga's migrations create pgsaga's tables only: the sample's come from
// the sample's own migrations (orders.Migrate, payments.Migrate), not into
// every user's database.
func TestTheLibraryCreatesNoSampleTable(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.Empty(t)
	_, err := migrations.Apply(ctx, db.SQL)
	require.NoError(t, err)
	var found []string
	rows, err := db.SQL.QueryContext(ctx, `SELECT t FROM unnest($1::text[]) AS t WHERE to_regclass(t) IS NOT NULL`,
		[]string{"customers", "order_views", "accounts", "account_postings", "charge_fences"})
	require.NoError(t, err)
	defer rows.Close()
	for rows.Next() {
		var name string
		require.NoError(t, rows.Scan(&name))
		found = append(found, name)
	}
	require.NoError(t, rows.Err())
	assert.Empty(t, found, "the library's migrations created the sample's tables")
	var queue bool
	require.NoError(t, db.SQL.QueryRowContext(ctx, `SELECT to_regclass('pgsaga_queue') IS NOT NULL`).Scan(&queue))
	assert.True(t, queue, "pgsaga's own tables are there")
}
