package idempotency_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/idempotency"
	"github.com/pgsaga/pgsaga/internal/pgdb"
	"github.com/pgsaga/pgsaga/internal/testdb"
	"github.com/pgsaga/pgsaga/migrations"
	"github.com/pgsaga/pgsaga/saga/delivery"
)

// provider is a fake external service with its own idempotency by key.
type provider struct {
	mu      sync.Mutex
	calls   map[string]int
	charged map[string]int
}

func newProvider() *provider { return &provider{calls: map[string]int{}, charged: map[string]int{}} }

func (p *provider) charge(key string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.calls[key]++
	if p.charged[key] == 0 {
		p.charged[key] = 1
	}
}

// A worker crashes after the external call, before phase two. After its
// lease expires exactly one of several workers takes over, calls the provider
// again with the same key (which charges once), and completes; the crashed
// worker's late completion is refused.
//
// Leases are an hour long, so no step of the test outlives one however slow
// the machine; the crashed worker's lease runs out when the test says so, by
// the database's clock.
func TestLeaseTakeoverAfterCrash(t *testing.T) {
	t.Parallel()
	s, db := newStore(t, func(c *idempotency.Config) { c.LeaseDuration = time.Hour })
	ctx := context.Background()
	req := newRequest("charge 100")
	ext := newProvider()

	first, err := s.Acquire(ctx, req)
	require.NoError(t, err)
	require.NotNil(t, first.Lease)
	assert.Equal(t, 1, first.Lease.Attempt)
	ext.charge(req.Key) // then the worker dies: no phase two

	// Before expiry the key is in progress, for everyone.
	_, err = s.Acquire(ctx, req)
	require.ErrorIs(t, err, idempotency.ErrInProgress)

	// The lease runs out.
	_, err = db.SQL.Exec(`UPDATE idempotency_keys SET locked_until = clock_timestamp() - interval '1 second'
WHERE scope = $1 AND key = $2 AND lease_token = $3`, req.Scope, req.Key, first.Lease.Token)
	require.NoError(t, err)

	const workers = 8
	var (
		wg     sync.WaitGroup
		start  = make(chan struct{})
		leases = make(chan *idempotency.Lease, workers)
		busy   = make(chan error, workers)
	)
	for range workers {
		wg.Go(func() {
			<-start
			acq, err := s.Acquire(ctx, req)
			switch {
			case err != nil:
				busy <- err
			case acq.Lease != nil:
				leases <- acq.Lease
			}
		})
	}
	close(start)
	wg.Wait()
	close(leases)
	close(busy)
	require.Len(t, leases, 1, "exactly one takeover")
	for err := range busy {
		require.ErrorIs(t, err, idempotency.ErrInProgress)
	}
	winner := <-leases
	assert.True(t, winner.Takeover)
	assert.Equal(t, 2, winner.Attempt)

	ext.charge(req.Key) // the same downstream key again
	require.NoError(t, s.CompleteLease(ctx, winner, idempotency.StatusCompleted, idempotency.Response{Code: 200, Body: []byte("charged")}))

	err = s.CompleteLease(ctx, first.Lease, idempotency.StatusCompleted, idempotency.Response{Code: 200, Body: []byte("stale")})
	require.ErrorIs(t, err, idempotency.ErrLeaseLost, "the stale worker's completion is refused")

	assert.Equal(t, 2, ext.calls[req.Key], "the provider saw the key twice")
	assert.Equal(t, 1, ext.charged[req.Key], "and charged once")
	rec, err := s.Get(ctx, req.Scope, req.Key)
	require.NoError(t, err)
	assert.Equal(t, idempotency.StatusCompleted, rec.Status)
	assert.Equal(t, "charged", string(rec.Response.Body))
	assert.Equal(t, 2, rec.Attempts)

	again, err := s.Acquire(ctx, req)
	require.NoError(t, err)
	require.NotNil(t, again.Record, "a finished key replays")
	assert.Equal(t, "charged", string(again.Record.Response.Body))
}

// A stale worker cannot complete even when the new holder has not finished.
func TestStaleLeaseCannotComplete(t *testing.T) {
	t.Parallel()
	s, _ := newStore(t, nil)
	ctx := context.Background()
	req := newRequest("x")
	first, err := s.AcquireFor(ctx, req, time.Millisecond)
	require.NoError(t, err)
	var second idempotency.Acquisition
	require.Eventually(t, func() bool {
		second, err = s.AcquireFor(ctx, req, time.Minute)
		return err == nil
	}, 10*time.Second, 5*time.Millisecond)
	require.True(t, second.Lease.Takeover)
	require.ErrorIs(t, s.CompleteLease(ctx, first.Lease, idempotency.StatusFailed, idempotency.Response{}), idempotency.ErrLeaseLost)
	require.ErrorIs(t, s.ReleaseLease(ctx, first.Lease), idempotency.ErrLeaseLost)
	require.NoError(t, s.CompleteLease(ctx, second.Lease, idempotency.StatusFailed, idempotency.Response{Code: 402}))
	rec, err := s.Get(ctx, req.Scope, req.Key)
	require.NoError(t, err)
	assert.Equal(t, idempotency.StatusFailed, rec.Status)
	assert.True(t, rec.LockedUntil.IsZero(), "a finished key holds no lease")
}

// An unknown outcome is never stored: a released lease stays pending and the
// next worker takes it over at once, with the same key.
func TestReleasedLeaseIsTakenOverAtOnce(t *testing.T) {
	t.Parallel()
	s, _ := newStore(t, nil)
	ctx := context.Background()
	req := newRequest("x")
	first, err := s.AcquireFor(ctx, req, time.Hour)
	require.NoError(t, err)
	require.NoError(t, s.ReleaseLease(ctx, first.Lease))
	rec, err := s.Get(ctx, req.Scope, req.Key)
	require.NoError(t, err)
	assert.Equal(t, idempotency.StatusPending, rec.Status, "released, not finished")
	second, err := s.Acquire(ctx, req)
	require.NoError(t, err)
	require.NotNil(t, second.Lease)
	assert.True(t, second.Lease.Takeover)
}

// A key under a lease is in progress for a single-phase claim too.
func TestLeasedKeyBlocksSinglePhaseClaim(t *testing.T) {
	t.Parallel()
	s, db := newStore(t, nil)
	ctx := context.Background()
	req := newRequest("x")
	_, err := s.Acquire(ctx, req)
	require.NoError(t, err)
	tx, err := db.SQL.Begin()
	require.NoError(t, err)
	defer tx.Rollback() //nolint:errcheck
	_, err = s.ClaimTx(ctx, tx, req)
	var ipe *idempotency.InProgressError
	require.ErrorAs(t, err, &ipe)
	assert.False(t, ipe.LockedUntil.IsZero())
}

// A held lease says how long it has left on the database's clock, which set
// it: with the server an hour ahead of this machine, time.Until(LockedUntil)
// is an hour and a minute, RetryAfter a minute. A worker waiting out a
// dead worker's lease by its own clock waited an hour too long (or, behind,
// not at all).
func TestAHeldLeaseSaysHowLongItHasLeftOnTheDatabasesClock(t *testing.T) {
	srv := testdb.StartPrivateSkewed(t, time.Hour)
	ctx := context.Background()
	db, err := pgdb.Open(ctx, pgdb.Config{URL: srv.URL, MaxConns: 4})
	require.NoError(t, err)
	t.Cleanup(db.Close)
	_, err = migrations.Apply(ctx, db.SQL)
	require.NoError(t, err)
	s, err := idempotency.NewStore(idempotency.Config{DB: db.SQL})
	require.NoError(t, err)

	req := newRequest("held")
	first, err := s.AcquireFor(ctx, req, time.Minute)
	require.NoError(t, err)
	require.NotNil(t, first.Lease)
	for name, claim := range map[string]func() error{
		"Acquire": func() error { _, err := s.AcquireFor(ctx, req, time.Minute); return err },
		"Claim": func() error {
			_, err := s.Do(ctx, req, func(context.Context, delivery.DBTX) (idempotency.Response, error) {
				t.Error("a held key ran")
				return idempotency.Response{}, nil
			})
			return err
		},
	} {
		err := claim()
		var busy *idempotency.InProgressError
		require.ErrorAs(t, err, &busy, name)
		assert.InDelta(t, time.Minute.Seconds(), busy.RetryAfter.Seconds(), 30, "%s: RetryAfter on the database's clock", name)
		assert.InDelta(t, (time.Hour + time.Minute).Seconds(), time.Until(busy.LockedUntil).Seconds(), 30, "%s: LockedUntil is the server's time", name)
	}
}
