package idempotency_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/idempotency"
	"github.com/pgsaga/pgsaga/internal/testdb"
	"github.com/pgsaga/pgsaga/internal/testpg"
	"github.com/pgsaga/pgsaga/saga/delivery"
)

func TestMain(m *testing.M) { testpg.Main(m) }

func newStore(t *testing.T, mutate func(*idempotency.Config)) (*idempotency.Store, *testdb.DB) {
	t.Helper()
	db := testdb.Shared(t)
	cfg := idempotency.Config{DB: db.SQL}
	if mutate != nil {
		mutate(&cfg)
	}
	s, err := idempotency.NewStore(cfg)
	require.NoError(t, err)
	return s, db
}

func newRequest(body string) idempotency.Request {
	return idempotency.Request{Scope: "test-" + uuid.NewString()[:8], Key: uuid.NewString(), Hash: idempotency.Fingerprint([]byte(body))}
}

func count(t *testing.T, db *testdb.DB, query string, args ...any) int {
	t.Helper()
	var n int
	require.NoError(t, db.SQL.QueryRow(query, args...).Scan(&n))
	return n
}

// 32 goroutines race on one key, each in its own transaction: exactly one
// executes, none sees a unique violation, all get the same stored response.
func TestConcurrentClaimsHaveOneExecutor(t *testing.T) {
	t.Parallel()
	s, db := newStore(t, nil)
	req := newRequest("charge 100")
	_, err := db.SQL.Exec(`CREATE TABLE IF NOT EXISTS race_effects (scope text, key text, worker int)`)
	require.NoError(t, err)

	const workers = 32
	var (
		wg       sync.WaitGroup
		start    = make(chan struct{})
		executed atomic.Int32
		results  = make([]idempotency.Result, workers)
		errs     = make([]error, workers)
	)
	for i := range workers {
		wg.Go(func() {
			<-start
			results[i], errs[i] = s.Do(context.Background(), req, func(ctx context.Context, tx delivery.DBTX) (idempotency.Response, error) {
				executed.Add(1)
				if _, err := tx.ExecContext(ctx, `INSERT INTO race_effects VALUES ($1, $2, $3)`, req.Scope, req.Key, i); err != nil {
					return idempotency.Response{}, err
				}
				time.Sleep(50 * time.Millisecond) // hold the claim while the others pile up
				return idempotency.Response{Code: 201, Body: fmt.Appendf(nil, "charged by %d", i)}, nil
			})
		})
	}
	close(start)
	wg.Wait()

	assert.EqualValues(t, 1, executed.Load(), "exactly one executor")
	replayed := 0
	for i := range workers {
		require.NoError(t, errs[i], "worker %d", i)
		var pgErr *pgconn.PgError
		assert.False(t, errors.As(errs[i], &pgErr), "no database error reaches a caller")
		assert.Equal(t, results[0].Response.Body, results[i].Response.Body, "worker %d got the same response", i)
		assert.Equal(t, 201, results[i].Response.Code)
		if results[i].Replayed {
			replayed++
		}
	}
	assert.Equal(t, workers-1, replayed)
	assert.Equal(t, 1, count(t, db, `SELECT count(*) FROM race_effects WHERE scope = $1 AND key = $2`, req.Scope, req.Key))
}

// The executor rolls back: a racer waiting on its claim becomes the executor,
// so no work is lost.
func TestRolledBackExecutorHandsOver(t *testing.T) {
	t.Parallel()
	s, db := newStore(t, nil)
	req := newRequest("x")
	ctx := context.Background()

	tx1, err := db.SQL.BeginTx(ctx, nil)
	require.NoError(t, err)
	c1, err := s.ClaimTx(ctx, tx1, req)
	require.NoError(t, err)
	require.True(t, c1.Execute)

	second := make(chan idempotency.Claim, 1)
	pid := make(chan int, 1)
	tx2, err := db.SQL.BeginTx(ctx, nil)
	require.NoError(t, err)
	defer tx2.Rollback() //nolint:errcheck
	go func() {
		pid <- backendPID(t, tx2)
		c2, err := s.ClaimTx(ctx, tx2, req) // waits for tx1
		assert.NoError(t, err)
		if err == nil {
			assert.NoError(t, s.CompleteTx(ctx, tx2, req, idempotency.StatusCompleted, idempotency.Response{Body: []byte("second")}))
			assert.NoError(t, tx2.Commit())
		}
		second <- c2
	}()
	waitForLockWaiter(t, db, pid)
	require.NoError(t, tx1.Rollback())

	c2 := <-second
	assert.True(t, c2.Execute, "the waiting racer executes after the first rolled back")
	rec, err := s.Get(ctx, req.Scope, req.Key)
	require.NoError(t, err)
	assert.Equal(t, idempotency.StatusCompleted, rec.Status)
	assert.Equal(t, "second", string(rec.Response.Body))
}

// backendPID returns the server process of tx.
func backendPID(t *testing.T, tx *sql.Tx) int {
	var pid int
	require.NoError(t, tx.QueryRow(`SELECT pg_backend_pid()`).Scan(&pid))
	return pid
}

// waitForLockWaiter polls until the backend pid waits on a lock.
func waitForLockWaiter(t *testing.T, db *testdb.DB, pid <-chan int) {
	t.Helper()
	p := <-pid
	deadline := time.Now().Add(10 * time.Second)
	for count(t, db, `SELECT count(*) FROM pg_stat_activity WHERE pid = $1 AND wait_event_type = 'Lock'`, p) == 0 {
		require.True(t, time.Now().Before(deadline), "no backend started waiting on a lock")
		time.Sleep(5 * time.Millisecond)
	}
}

// A claim waits for a concurrent claimer no longer than LockTimeout, then
// reports ErrInProgress.
func TestClaimWaitIsBoundedByLockTimeout(t *testing.T) {
	t.Parallel()
	s, db := newStore(t, func(c *idempotency.Config) { c.LockTimeout = 200 * time.Millisecond })
	req := newRequest("x")
	ctx := context.Background()
	tx1, err := db.SQL.BeginTx(ctx, nil)
	require.NoError(t, err)
	defer tx1.Rollback() //nolint:errcheck
	_, err = s.ClaimTx(ctx, tx1, req)
	require.NoError(t, err)

	tx2, err := db.SQL.BeginTx(ctx, nil)
	require.NoError(t, err)
	defer tx2.Rollback() //nolint:errcheck
	start := time.Now()
	_, err = s.ClaimTx(ctx, tx2, req)
	require.ErrorIs(t, err, idempotency.ErrInProgress)
	var ipe *idempotency.InProgressError
	require.ErrorAs(t, err, &ipe)
	assert.True(t, ipe.LockedUntil.IsZero(), "held by a transaction, not a lease")
	assert.Less(t, time.Since(start), 3*time.Second)
}

// Under REPEATABLE READ (watermill-sql's subscriber transaction) a racer that
// waited for a concurrent claim that then commits gets a serialization
// failure, surfaced as ErrConflict: its snapshot cannot see the stored row,
// so the whole transaction must be retried. A new transaction replays.
func TestRepeatableReadRacerGetsConflict(t *testing.T) {
	t.Parallel()
	s, db := newStore(t, nil)
	req := newRequest("x")
	ctx := context.Background()
	rr := &sql.TxOptions{Isolation: sql.LevelRepeatableRead}

	tx1, err := db.SQL.BeginTx(ctx, rr)
	require.NoError(t, err)
	c1, err := s.ClaimTx(ctx, tx1, req)
	require.NoError(t, err)
	require.True(t, c1.Execute)

	result := make(chan error, 1)
	pid := make(chan int, 1)
	tx2, err := db.SQL.BeginTx(ctx, rr)
	require.NoError(t, err)
	defer tx2.Rollback() //nolint:errcheck
	// tx2's snapshot is taken here, while tx1's claim is uncommitted.
	pid <- backendPID(t, tx2)
	go func() {
		_, err := s.ClaimTx(ctx, tx2, req)
		result <- err
	}()
	waitForLockWaiter(t, db, pid)
	require.NoError(t, s.CompleteTx(ctx, tx1, req, idempotency.StatusCompleted, idempotency.Response{Body: []byte("done")}))
	require.NoError(t, tx1.Commit())

	err = <-result
	require.ErrorIs(t, err, idempotency.ErrConflict)
	var pgErr *pgconn.PgError
	require.ErrorAs(t, err, &pgErr)
	assert.Equal(t, "40001", pgErr.Code)

	tx3, err := db.SQL.BeginTx(ctx, rr)
	require.NoError(t, err)
	defer tx3.Rollback() //nolint:errcheck
	c3, err := s.ClaimTx(ctx, tx3, req)
	require.NoError(t, err)
	assert.False(t, c3.Execute)
	assert.Equal(t, "done", string(c3.Record.Response.Body), "a retry in a new transaction replays")
}

// Pins the PostgreSQL fact behind insert-first: SELECT … FOR UPDATE of a
// missing row locks nothing, so two sessions both pass it, and the second
// insert fails with a unique violation.
func TestPinSelectForUpdateFirstLetsTwoThrough(t *testing.T) {
	t.Parallel()
	_, db := newStore(t, nil)
	req := newRequest("x")
	ctx := context.Background()
	txs := make([]*sql.Tx, 2)
	for i := range txs {
		tx, err := db.SQL.BeginTx(ctx, nil)
		require.NoError(t, err)
		defer tx.Rollback() //nolint:errcheck
		var found int
		err = tx.QueryRowContext(ctx, `SELECT 1 FROM idempotency_keys WHERE scope = $1 AND key = $2 FOR UPDATE`, req.Scope, req.Key).Scan(&found)
		require.ErrorIs(t, err, sql.ErrNoRows, "session %d sees no row and locks nothing", i)
		txs[i] = tx
	}
	_, err := txs[0].ExecContext(ctx, `INSERT INTO idempotency_keys (scope, key, request_hash) VALUES ($1, $2, $3)`, req.Scope, req.Key, req.Hash)
	require.NoError(t, err)
	second := make(chan error, 1)
	pid := make(chan int, 1)
	pid <- backendPID(t, txs[1])
	go func() {
		_, err := txs[1].ExecContext(ctx, `INSERT INTO idempotency_keys (scope, key, request_hash) VALUES ($1, $2, $3)`, req.Scope, req.Key, req.Hash)
		second <- err
	}()
	waitForLockWaiter(t, db, pid)
	require.NoError(t, txs[0].Commit())
	var pgErr *pgconn.PgError
	require.ErrorAs(t, <-second, &pgErr)
	assert.Equal(t, "23505", pgErr.Code, "both sessions believed they were first")
}

// A business failure is stored as failed and replayed as failed; a transient
// failure stores nothing and the next attempt executes.
func TestFailureKinds(t *testing.T) {
	t.Parallel()
	s, db := newStore(t, nil)
	ctx := context.Background()

	_, err := db.SQL.Exec(`CREATE TABLE IF NOT EXISTS failure_effects (scope text)`)
	require.NoError(t, err)
	req := newRequest("charge 1000")
	calls := 0
	for range 3 {
		res, err := s.Do(ctx, req, func(ctx context.Context, tx delivery.DBTX) (idempotency.Response, error) {
			calls++
			if _, err := tx.ExecContext(ctx, `INSERT INTO failure_effects VALUES ($1)`, req.Scope); err != nil {
				return idempotency.Response{}, err
			}
			return idempotency.Response{}, &idempotency.Failure{Reason: "insufficient funds", Response: idempotency.Response{Code: 402, Body: []byte("no money")}}
		})
		require.NoError(t, err)
		assert.Equal(t, idempotency.StatusFailed, res.Status)
		assert.Equal(t, 402, res.Response.Code)
		assert.Equal(t, "no money", string(res.Response.Body))
	}
	assert.Equal(t, 1, calls, "a business failure is final")
	assert.Zero(t, count(t, db, `SELECT count(*) FROM failure_effects WHERE scope = $1`, req.Scope), "stored without the writes that led to it")

	req = newRequest("charge 5")
	boom := errors.New("gateway timeout")
	_, err = s.Do(ctx, req, func(context.Context, delivery.DBTX) (idempotency.Response, error) {
		return idempotency.Response{}, boom
	})
	require.ErrorIs(t, err, boom)
	assert.Zero(t, count(t, db, `SELECT count(*) FROM idempotency_keys WHERE scope = $1`, req.Scope), "a transient failure leaves no key")
	res, err := s.Do(ctx, req, func(context.Context, delivery.DBTX) (idempotency.Response, error) {
		return idempotency.Response{Code: 200, Body: []byte("ok")}, nil
	})
	require.NoError(t, err)
	assert.False(t, res.Replayed, "the retry executes")
	assert.Equal(t, idempotency.StatusCompleted, res.Status)
}

func TestKeyReusedWithDifferentRequest(t *testing.T) {
	t.Parallel()
	s, _ := newStore(t, nil)
	ctx := context.Background()
	req := newRequest("charge 100")
	_, err := s.Do(ctx, req, func(context.Context, delivery.DBTX) (idempotency.Response, error) {
		return idempotency.Response{Code: 200}, nil
	})
	require.NoError(t, err)
	other := req
	other.Hash = idempotency.Fingerprint([]byte("charge 999"))
	_, err = s.Do(ctx, other, func(context.Context, delivery.DBTX) (idempotency.Response, error) {
		t.Fatal("must not execute")
		return idempotency.Response{}, nil
	})
	require.ErrorIs(t, err, idempotency.ErrKeyReused)
}

func TestInvalidRequests(t *testing.T) {
	t.Parallel()
	s, db := newStore(t, nil)
	tx, err := db.SQL.Begin()
	require.NoError(t, err)
	defer tx.Rollback() //nolint:errcheck
	long := string(make([]byte, 300))
	for name, req := range map[string]idempotency.Request{
		"no scope":   {Key: "k", Hash: []byte{1}},
		"no key":     {Scope: "s", Hash: []byte{1}},
		"long key":   {Scope: "s", Key: long, Hash: []byte{1}},
		"long scope": {Scope: long, Key: "k", Hash: []byte{1}},
		"no hash":    {Scope: "s", Key: "k"},
	} {
		_, err := s.ClaimTx(context.Background(), tx, req)
		require.ErrorIs(t, err, idempotency.ErrInvalidRequest, name)
	}
	require.ErrorIs(t, s.CompleteTx(context.Background(), tx, newRequest("x"), idempotency.StatusPending, idempotency.Response{}), idempotency.ErrInvalidRequest)
	require.ErrorIs(t, s.CompleteTx(context.Background(), tx, newRequest("x"), idempotency.StatusCompleted, idempotency.Response{}), idempotency.ErrNotClaimed)
	_, err = idempotency.NewStore(idempotency.Config{LockTimeout: time.Microsecond})
	require.Error(t, err)
}

func TestFingerprintIsLengthPrefixed(t *testing.T) {
	t.Parallel()
	assert.NotEqual(t, idempotency.Fingerprint([]byte("ab"), []byte("c")), idempotency.Fingerprint([]byte("a"), []byte("bc")))
	assert.Equal(t, idempotency.Fingerprint([]byte("a")), idempotency.Fingerprint([]byte("a")))
}

// CompleteTx finishes only a pending single-phase claim: it never rewrites
// a stored outcome (a second completion, or one for a key this transaction
// did not claim), and never finishes a two-phase claim, which only its
// lease's holder may complete.
func TestCompleteFinishesOnlyAPendingClaimWithoutLease(t *testing.T) {
	t.Parallel()
	s, db := newStore(t, nil)
	ctx := context.Background()
	stored := func(req idempotency.Request) (string, string) {
		var status, body string
		require.NoError(t, db.SQL.QueryRow(`SELECT status, coalesce(convert_from(response, 'UTF8'), '') FROM idempotency_keys WHERE scope = $1 AND key = $2`,
			req.Scope, req.Key).Scan(&status, &body))
		return status, body
	}

	t.Run("finished", func(t *testing.T) {
		req := newRequest("charge 100")
		tx, err := db.SQL.Begin()
		require.NoError(t, err)
		claim, err := s.ClaimTx(ctx, tx, req)
		require.NoError(t, err)
		require.True(t, claim.Execute)
		require.NoError(t, s.CompleteTx(ctx, tx, req, idempotency.StatusCompleted, idempotency.Response{Code: 200, Body: []byte("first")}))
		err = s.CompleteTx(ctx, tx, req, idempotency.StatusFailed, idempotency.Response{Code: 402, Body: []byte("second")})
		require.ErrorIs(t, err, idempotency.ErrNotClaimed, "a second completion is refused")
		require.NoError(t, tx.Commit())
		status, body := stored(req)
		assert.Equal(t, "completed", status)
		assert.Equal(t, "first", body, "the stored outcome is kept")
	})

	t.Run("leased", func(t *testing.T) {
		req := newRequest("charge 200")
		acq, err := s.AcquireFor(ctx, req, time.Minute)
		require.NoError(t, err)
		require.NotNil(t, acq.Lease)
		tx, err := db.SQL.Begin()
		require.NoError(t, err)
		defer tx.Rollback() //nolint:errcheck
		err = s.CompleteTx(ctx, tx, req, idempotency.StatusCompleted, idempotency.Response{Code: 200, Body: []byte("not the holder")})
		require.ErrorIs(t, err, idempotency.ErrNotClaimed, "only the lease's holder completes a leased claim")
		require.NoError(t, tx.Commit())
		status, _ := stored(req)
		assert.Equal(t, "pending", status)
		require.NoError(t, s.CompleteLease(ctx, acq.Lease, idempotency.StatusCompleted, idempotency.Response{Code: 200, Body: []byte("holder")}))
		status, body := stored(req)
		assert.Equal(t, "completed", status)
		assert.Equal(t, "holder", body)
	})
}

// A claim's lock_timeout bounds the claim only: ClaimTx and AcquireTx leave
// the transaction's own setting as they found it, whichever way the claim
// ends.
func TestClaimRestoresLockTimeout(t *testing.T) {
	t.Parallel()
	s, db := newStore(t, func(c *idempotency.Config) { c.LockTimeout = 250 * time.Millisecond })
	ctx := context.Background()
	setting := func(tx *sql.Tx) string {
		var v string
		require.NoError(t, tx.QueryRow(`SELECT current_setting('lock_timeout')`).Scan(&v))
		return v
	}
	done := newRequest("done")
	_, err := s.Do(ctx, done, func(context.Context, delivery.DBTX) (idempotency.Response, error) {
		return idempotency.Response{Code: 200}, nil
	})
	require.NoError(t, err)
	leased := newRequest("leased")
	_, err = s.Acquire(ctx, leased)
	require.NoError(t, err)

	for name, claim := range map[string]func(tx *sql.Tx) error{
		"new key":      func(tx *sql.Tx) error { _, err := s.ClaimTx(ctx, tx, newRequest("x")); return err },
		"finished key": func(tx *sql.Tx) error { _, err := s.ClaimTx(ctx, tx, done); return err },
		"leased key":   func(tx *sql.Tx) error { _, err := s.ClaimTx(ctx, tx, leased); return err },
		"key reused": func(tx *sql.Tx) error {
			_, err := s.ClaimTx(ctx, tx, idempotency.Request{Scope: done.Scope, Key: done.Key, Hash: []byte("other")})
			return err
		},
		"new lease":      func(tx *sql.Tx) error { _, err := s.AcquireTx(ctx, tx, newRequest("x"), time.Minute); return err },
		"finished lease": func(tx *sql.Tx) error { _, err := s.AcquireTx(ctx, tx, done, time.Minute); return err },
		"held lease":     func(tx *sql.Tx) error { _, err := s.AcquireTx(ctx, tx, leased, time.Minute); return err },
	} {
		tx, err := db.SQL.BeginTx(ctx, nil)
		require.NoError(t, err)
		_, err = tx.Exec(`SET LOCAL lock_timeout = '7s'`)
		require.NoError(t, err)
		_ = claim(tx) // outcomes are other tests' business
		assert.Equal(t, "7s", setting(tx), name)
		require.NoError(t, tx.Rollback())
	}
}

// countingTx is a transaction that counts the statements it is given.
type countingTx struct {
	*sql.Tx
	n int
}

func (c *countingTx) ExecContext(ctx context.Context, q string, args ...any) (sql.Result, error) {
	c.n++
	return c.Tx.ExecContext(ctx, q, args...)
}

func (c *countingTx) QueryContext(ctx context.Context, q string, args ...any) (*sql.Rows, error) {
	c.n++
	return c.Tx.QueryContext(ctx, q, args...)
}

func (c *countingTx) QueryRowContext(ctx context.Context, q string, args ...any) *sql.Row {
	c.n++
	return c.Tx.QueryRowContext(ctx, q, args...)
}

// The claim of a new key is one statement: it sets the claim's
// lock_timeout, inserts, and puts the transaction's own back (a separate
// restore was a round trip and a statement on every step).
// TestClaimRestoresLockTimeout says the setting is put back.
func TestANewClaimIsOneStatement(t *testing.T) {
	t.Parallel()
	s, db := newStore(t, nil)
	ctx := context.Background()
	for name, claim := range map[string]func(tx *countingTx) error{
		"ClaimTx":   func(tx *countingTx) error { _, err := s.ClaimTx(ctx, tx, newRequest("one")); return err },
		"AcquireTx": func(tx *countingTx) error { _, err := s.AcquireTx(ctx, tx, newRequest("one"), time.Minute); return err },
	} {
		sqlTx, err := db.SQL.BeginTx(ctx, nil)
		require.NoError(t, err)
		tx := &countingTx{Tx: sqlTx}
		require.NoError(t, claim(tx), name)
		assert.Equal(t, 1, tx.n, "%s of a new key: statements", name)
		require.NoError(t, sqlTx.Rollback())
	}
}
