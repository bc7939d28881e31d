package idempotency_test

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/idempotency"
	"github.com/pgsaga/pgsaga/internal/testdb"
)

// seedKeys inserts n keys of scope with the given status, finished (or
// created, when pending) age ago.
func seedKeys(t *testing.T, db *testdb.DB, scope string, n int, status idempotency.Status, age time.Duration) {
	t.Helper()
	completed := "now() - make_interval(secs => $3)"
	if status == idempotency.StatusPending {
		completed = "NULL"
	}
	_, err := db.SQL.Exec(fmt.Sprintf(`
		INSERT INTO idempotency_keys (scope, key, request_hash, status, created_at, completed_at)
		SELECT $1, $1 || '-' || g, '\x01', $2, now() - make_interval(secs => $3), %s
		FROM generate_series(1, $4) g`, completed), scope, string(status), age.Seconds(), n)
	require.NoError(t, err)
}

func TestReaperDeletesOnlyExpiredFinishedKeysInBatches(t *testing.T) {
	t.Parallel()
	db := testdb.Fresh(t)
	seedKeys(t, db, "old-completed", 7, idempotency.StatusCompleted, 2*time.Hour)
	seedKeys(t, db, "old-failed", 3, idempotency.StatusFailed, 2*time.Hour)
	seedKeys(t, db, "recent", 2, idempotency.StatusCompleted, time.Minute)
	seedKeys(t, db, "old-pending", 2, idempotency.StatusPending, 48*time.Hour)

	r, err := idempotency.NewReaper(idempotency.ReaperConfig{DB: db.SQL, TTL: time.Hour, BatchSize: 4})
	require.NoError(t, err)
	deleted, batches, err := r.RunOnce(context.Background())
	require.NoError(t, err)
	assert.Equal(t, 10, deleted)
	assert.Equal(t, 3, batches, "10 keys in batches of 4")

	left := map[string]int{}
	rows, err := db.SQL.Query(`SELECT scope, count(*) FROM idempotency_keys GROUP BY scope`)
	require.NoError(t, err)
	defer rows.Close()
	for rows.Next() {
		var scope string
		var n int
		require.NoError(t, rows.Scan(&scope, &n))
		left[scope] = n
	}
	assert.Equal(t, map[string]int{"recent": 2, "old-pending": 2}, left)

	deleted, _, err = r.RunOnce(context.Background())
	require.NoError(t, err)
	assert.Zero(t, deleted, "nothing left to reap")
}

// Reapers in several processes split the work without errors or overlap.
func TestConcurrentReapers(t *testing.T) {
	t.Parallel()
	db := testdb.Fresh(t)
	seedKeys(t, db, "old", 1000, idempotency.StatusCompleted, 2*time.Hour)
	const reapers = 4
	var (
		wg      sync.WaitGroup
		mu      sync.Mutex
		total   int
		errs    []error
		started = make(chan struct{})
	)
	for range reapers {
		pool := testdb.Open(t, db.URL, 2)
		r, err := idempotency.NewReaper(idempotency.ReaperConfig{DB: pool.SQL, TTL: time.Hour, BatchSize: 50})
		require.NoError(t, err)
		wg.Go(func() {
			<-started
			n, _, err := r.RunOnce(context.Background())
			mu.Lock()
			defer mu.Unlock()
			total += n
			if err != nil {
				errs = append(errs, err)
			}
		})
	}
	close(started)
	wg.Wait()
	require.Empty(t, errs)
	assert.Equal(t, 1000, total, "every key deleted exactly once")
	assert.Zero(t, count(t, db, `SELECT count(*) FROM idempotency_keys`))
}

func TestReaperConfig(t *testing.T) {
	t.Parallel()
	_, err := idempotency.NewReaper(idempotency.ReaperConfig{})
	require.ErrorContains(t, err, "DB is required")
	_, err = idempotency.NewReaper(idempotency.ReaperConfig{DB: testdb.Shared(t).SQL, BatchSize: -1})
	require.ErrorContains(t, err, "BatchSize")
}
