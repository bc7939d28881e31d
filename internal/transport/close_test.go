package transport_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/internal/testdb"
	"github.com/pgsaga/pgsaga/internal/transport"
)

// twoPartHandler writes part "a", spends a few milliseconds in the database,
// then writes part "b": stopping the router in between must never leave "a"
// without "b".
func twoPartHandler(e *env) transport.HandlerFunc {
	return func(msg *message.Message) error {
		if err := effect(msg, e.eff, "a"); err != nil {
			return err
		}
		tx, _ := transport.TxFromContext(msg.Context())
		if _, err := tx.ExecContext(msg.Context(), `SELECT pg_sleep(0.003)`); err != nil {
			return err
		}
		return effect(msg, e.eff, "b")
	}
}

// assertNoPartialWork checks that exactly the handled messages (those no
// longer queued) have effects, each complete.
func assertNoPartialWork(t *testing.T, e *env, published int) {
	t.Helper()
	assert.Zero(t, e.count(`SELECT count(*) FROM (SELECT msg FROM `+e.eff+` GROUP BY msg HAVING count(*) FILTER (WHERE part = 'a') <> 1 OR count(*) FILTER (WHERE part = 'b') <> 1) d`),
		"messages with a partial or repeated effect")
	assert.Equal(t, published-e.waiting(e.in, "g"), e.count(`SELECT count(DISTINCT msg) FROM `+e.eff),
		"messages with an effect must be exactly the handled ones")
}

// handled counts the messages of n published that are no longer queued.
func (e *env) handled(n int) int { return n - e.waiting(e.in, "g") }

// Closing the router while handlers run under load leaves every message
// either fully processed and acked, or untouched.
func TestCloseUnderLoadIsAllOrNothing(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	const n = 400
	e.publish(n)

	for round := 0; e.handled(n) < n; round++ {
		require.Less(t, round, 80, "did not finish")
		r, err := e.tr.NewRouter()
		require.NoError(t, err)
		require.NoError(t, r.AddHandler("h", e.in, "g", twoPartHandler(e)))
		before := e.handled(n)

		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan error, 1)
		go func() { done <- r.Run(ctx) }()
		<-r.Running()
		// Stop in the middle of a batch: some messages in, more to go.
		waitFor(t, 20*time.Second, "progress", func() bool {
			c := e.handled(n)
			return c >= min(before+15, n) || c == n
		})
		if round%2 == 0 {
			require.NoError(t, r.Close())
		} else {
			cancel() // cancelling Run's context drains too
		}
		require.NoError(t, <-done)
		cancel()
		assertNoPartialWork(t, e, n)
	}
	assertExactlyOnce(t, e, n)
}

// A handler stuck past CloseTimeout is cut off: its attempt is rolled back,
// so its partial work is never committed, the batch commits the rest, and
// the message is processed exactly once later.
func TestStuckHandlerCutOffAtClose(t *testing.T) {
	t.Parallel()
	e := newEnv(t, func(c *transport.Config) { c.CloseTimeout = 300 * time.Millisecond })
	r, err := e.tr.NewRouter()
	require.NoError(t, err)
	inside, release := make(chan struct{}), make(chan struct{})
	lateErr := make(chan error, 1)
	require.NoError(t, r.AddHandler("h", e.in, "g", func(msg *message.Message) error {
		if err := effect(msg, e.eff, "a"); err != nil {
			return err
		}
		close(inside)
		<-release
		err := effect(msg, e.eff, "b")
		lateErr <- err
		return err
	}))
	done := make(chan error, 1)
	go func() { done <- r.Run(context.Background()) }()
	<-r.Running()
	e.publish(1)
	<-inside

	closeErr := r.Close() // times out waiting for the stuck handler
	close(release)
	require.ErrorIs(t, <-lateErr, transport.ErrAttemptOver, "the cut-off handler cannot write any more")
	<-done
	t.Logf("close returned %v", closeErr)

	// A fresh router processes the message, once.
	r2, err := e.tr.NewRouter()
	require.NoError(t, err)
	require.NoError(t, r2.AddHandler("h", e.in, "g", twoPartHandler(e)))
	startRouter(t, r2)
	e.drained(e.in, "g", 10*time.Second)
	assertExactlyOnce(t, e, 1)
}

// Several routers, each with its own connection pool like separate
// processes, are started and stopped at random while 2,400 messages flow in;
// afterwards each message's effect exists exactly once.
func TestExactlyOnceAcrossRestarts(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	seed := uint64(time.Now().UnixNano())
	t.Logf("seed %d", seed)
	const (
		batches   = 48
		batchSize = 50
		n         = batches * batchSize
		workers   = 3
	)
	var published atomic.Int32
	go func() {
		for range batches {
			e.publish(batchSize)
			published.Add(batchSize)
		}
	}()

	var (
		wg       sync.WaitGroup
		finished atomic.Bool
		starts   atomic.Int32
	)
	for w := range workers {
		rng := rand.New(rand.NewPCG(seed, uint64(w)))
		pool := testdb.Open(t, e.db.URL, 6)
		tr, err := transport.New(fastConfig(&testdb.DB{SQL: pool.SQL}))
		require.NoError(t, err)
		wg.Go(func() {
			for !finished.Load() {
				r, err := tr.NewRouter()
				if !assert.NoError(t, err) {
					return
				}
				if !assert.NoError(t, r.AddHandler("h", e.in, "g", twoPartHandler(e))) {
					return
				}
				done := make(chan error, 1)
				go func() { done <- r.Run(context.Background()) }()
				<-r.Running()
				starts.Add(1)
				// The chaos schedule: run for a random while, then stop.
				time.Sleep(time.Duration(20+rng.IntN(250)) * time.Millisecond)
				assert.NoError(t, r.Close())
				assert.NoError(t, <-done)
			}
		})
	}
	waitFor(t, 3*time.Minute, fmt.Sprintf("all %d messages consumed (seed %d)", n, seed), func() bool {
		if testing.Verbose() && rand.IntN(100) == 0 {
			t.Logf("published %d handled %d starts %d", published.Load(), e.handled(int(published.Load())), starts.Load())
		}
		return published.Load() == n && e.waiting(e.in, "g") == 0
	})
	finished.Store(true)
	wg.Wait()
	t.Logf("%d router starts", starts.Load())
	assert.Greater(t, starts.Load(), int32(workers), "routers were restarted")
	assertExactlyOnce(t, e, n)
}

// Subscribe is safe to run from many processes at once.
func TestSubscribeConcurrently(t *testing.T) {
	t.Parallel()
	db := testdb.Shared(t)
	for round := range 3 {
		topic := "sc_" + randomID()
		var wg sync.WaitGroup
		errs := make([]error, 8)
		start := make(chan struct{})
		for i := range errs {
			pool := testdb.Open(t, db.URL, 2)
			tr, err := transport.New(transport.Config{DB: pool.SQL, Logger: testLogger()})
			require.NoError(t, err)
			wg.Go(func() {
				<-start
				errs[i] = tr.Subscribe(context.Background(), transport.Subscription{Topic: topic, ConsumerGroup: "a"},
					transport.Subscription{Topic: topic, ConsumerGroup: "b"})
			})
		}
		close(start)
		wg.Wait()
		for i, err := range errs {
			require.NoError(t, err, "round %d, subscriber %d", round, i)
		}
		var n int
		require.NoError(t, db.SQL.QueryRow(`SELECT count(*) FROM pgsaga_subscriptions WHERE topic = $1`, topic).Scan(&n))
		assert.Equal(t, 2, n)
	}
}

// StopContext drains until its context ends, not the whole CloseTimeout:
// an attempt still running then is cut off, and the router stops.
func TestStopContextDrainsUntilItsContextEnds(t *testing.T) {
	t.Parallel()
	r, cut := runningUntilCut(t, time.Minute)
	stopCtx, stopCancel := context.WithCancel(context.Background())
	stopped := make(chan error, 1)
	go func() { stopped <- r.StopContext(stopCtx) }()
	waitFor(t, 10*time.Second, "the router closes", func() bool { return transport.Closing(r) })
	select {
	case err := <-stopped:
		t.Fatalf("StopContext returned before its context ended, with the attempt running: %v", err)
	default:
	}
	stopCancel()
	select {
	case err := <-stopped:
		require.NoError(t, err)
	case <-time.After(20 * time.Second): // far below the minute of CloseTimeout
		t.Fatal("StopContext waited past its context's end")
	}
	select {
	case <-cut: // its handler's context ended
	case <-time.After(10 * time.Second):
		t.Fatal("the attempt was not cut off")
	}
}

// A second StopContext, with a shorter context than the first's, shortens
// the drain under way: a Stop(ctx of 1 s) issued while a
// Stop(context.Background()) drains returns soon after its second, not
// after the whole CloseTimeout.
func TestASecondStopShortensTheDrain(t *testing.T) {
	t.Parallel()
	r, _ := runningUntilCut(t, 12*time.Second)
	first := make(chan error, 1)
	go func() { first <- r.StopContext(context.Background()) }()
	waitFor(t, 10*time.Second, "the router closes", func() bool { return transport.Closing(r) })

	short, cancelShort := context.WithTimeout(context.Background(), time.Second)
	defer cancelShort()
	began := time.Now()
	require.NoError(t, r.StopContext(short))
	took := time.Since(began)
	<-first
	assert.Less(t, took, 8*time.Second, "StopContext(1s) returned after %s: it waited for the first close's CloseTimeout (12 s)", took)
}

// runningUntilCut starts a router (its CloseTimeout closeTimeout) whose one
// message's attempt runs until it is cut off, and returns once it runs;
// cut is closed when the attempt's context has ended.
func runningUntilCut(t *testing.T, closeTimeout time.Duration) (r *transport.Router, cut <-chan struct{}) {
	t.Helper()
	e := newEnv(t, func(c *transport.Config) { c.CloseTimeout, c.AttemptTimeout = closeTimeout, time.Minute })
	running, ended := make(chan struct{}), make(chan struct{})
	var once sync.Once
	r, err := e.tr.NewRouter()
	require.NoError(t, err)
	require.NoError(t, r.AddHandler("h", e.in, "g", func(msg *message.Message) error {
		once.Do(func() { close(running) })
		<-msg.Context().Done() // until cut off
		close(ended)
		return msg.Context().Err()
	}, transport.WithConsumers(1)))
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	require.NoError(t, r.Start(ctx))
	e.publish(1)
	<-running
	return r, ended
}
