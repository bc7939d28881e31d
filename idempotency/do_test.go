package idempotency_test

import (
	"context"
	"strings"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/idempotency"
	"github.com/pgsaga/pgsaga/internal/pgdb"
	"github.com/pgsaga/pgsaga/internal/testdb"
	"github.com/pgsaga/pgsaga/saga/delivery"
)

// Do's request runs in the claim's transaction without a savepoint of its
// own, succeeding or failing: BEGIN, the claim, the request's own
// statements, the completion, COMMIT. It took a SAVEPOINT every request
// (a statement and a round trip), to take a failure's writes back.
func TestDoTakesNoSavepoint(t *testing.T) {
	t.Parallel()
	shared := testdb.Shared(t)
	var mu sync.Mutex
	var savepoints []string
	pool, err := pgdb.Open(context.Background(), pgdb.Config{URL: shared.URL, MaxConns: 2, Tracer: testdb.Tracer(func(sql string, _ []any) {
		if strings.Contains(strings.ToUpper(sql), "SAVEPOINT") {
			mu.Lock()
			savepoints = append(savepoints, sql)
			mu.Unlock()
		}
	})})
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	s, err := idempotency.NewStore(idempotency.Config{DB: pool.SQL})
	require.NoError(t, err)
	ctx := context.Background()
	ok, err := s.Do(ctx, newRequest("ok"), func(ctx context.Context, tx delivery.DBTX) (idempotency.Response, error) {
		_, err := tx.ExecContext(ctx, `SELECT 1`)
		return idempotency.Response{Code: 200}, err
	})
	require.NoError(t, err)
	assert.Equal(t, idempotency.StatusCompleted, ok.Status)
	failed, err := s.Do(ctx, newRequest("failed"), func(context.Context, delivery.DBTX) (idempotency.Response, error) {
		return idempotency.Response{}, &idempotency.Failure{Reason: "no", Response: idempotency.Response{Code: 402}}
	})
	require.NoError(t, err)
	assert.Equal(t, idempotency.StatusFailed, failed.Status)
	mu.Lock()
	defer mu.Unlock()
	assert.Empty(t, savepoints)
}

// A failed request's claim goes with its rollback; a request of the same
// key that claims it before the failure is stored decides the key's
// outcome, and the failed one gets that outcome, replayed, as any later
// request would. Without the check, storing the failure over it failed
// the request with ErrNotClaimed (or stored over a success).
func TestAFailureStoredAfterAnotherRequestFinishedTheKeyReplaysIt(t *testing.T) {
	s, db := newStore(t, nil)
	ctx := context.Background()
	req := newRequest("raced")
	restore := idempotency.SetAfterFailureRollback(func(r idempotency.Request) {
		if r.Key != req.Key {
			return
		}
		res, err := s.Do(ctx, req, func(context.Context, delivery.DBTX) (idempotency.Response, error) {
			return idempotency.Response{Code: 201, Body: []byte("theirs")}, nil
		})
		require.NoError(t, err)
		require.False(t, res.Replayed)
	})
	t.Cleanup(restore)
	res, err := s.Do(ctx, req, func(context.Context, delivery.DBTX) (idempotency.Response, error) {
		return idempotency.Response{}, &idempotency.Failure{Reason: "declined", Response: idempotency.Response{Code: 402}}
	})
	require.NoError(t, err)
	assert.True(t, res.Replayed)
	assert.Equal(t, idempotency.StatusCompleted, res.Status)
	assert.Equal(t, "theirs", string(res.Response.Body))
	assert.Equal(t, 1, count(t, db, `SELECT count(*) FROM idempotency_keys WHERE scope = $1 AND key = $2 AND status = 'completed'`, req.Scope, req.Key))
}
