package transport_test

import (
	"context"
	"encoding/json"
	"errors"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/internal/pgdb"
	"github.com/pgsaga/pgsaga/internal/testdb"
	"github.com/pgsaga/pgsaga/internal/transport"
)

// calls records which messages' awaited calls finished, as an external
// service would (the handler's next run finds the outcome there).
type calls struct {
	mu   sync.Mutex
	done map[string]int
}

func newCalls() *calls { return &calls{done: map[string]int{}} }

func (c *calls) finish(id string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.done[id]++
}

func (c *calls) of(id string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.done[id]
}

// A handler that awaits a call gets it run outside its batch: the batch
// commits the other messages while the call runs, the message is parked
// meanwhile without costing an attempt, and when the call returns it is
// delivered again at once (its park lasts an hour: only the wake-up brings
// it back), as attempt 1 still, and its handler finds the call's outcome.
func TestAwaitedCallRunsOutsideTheBatch(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	done := newCalls()
	started, release := make(chan struct{}), make(chan struct{})
	var runs atomic.Int32
	var sawAttempt atomic.Int32
	r, err := e.tr.NewRouter()
	require.NoError(t, err)
	require.NoError(t, r.AddHandler("h", e.in, "g", func(msg *message.Message) error {
		if msg.Metadata.Get("await") != "yes" {
			return effect(msg, e.eff, "plain")
		}
		runs.Add(1)
		if done.of(msg.UUID) > 0 {
			sawAttempt.Store(int32(transport.AttemptFromContext(msg.Context())))
			if !transport.AwaitedFromContext(msg.Context()) {
				return transport.Permanent(errors.New("the run after the call does not know it"))
			}
			return effect(msg, e.eff, "after the call")
		}
		if transport.AwaitedFromContext(msg.Context()) {
			return transport.Permanent(errors.New("the first run thinks it comes after a call"))
		}
		if err := effect(msg, e.eff, "before the call"); err != nil {
			return err
		}
		return transport.Await(time.Hour, func(ctx context.Context) error {
			close(started)
			<-release
			done.finish(msg.UUID)
			return nil
		})
	}, transport.WithConsumers(1)))
	startRouter(t, r)

	awaiting := message.NewMessage("await-"+e.id, []byte(`{}`))
	awaiting.Metadata.Set("await", "yes")
	plain := message.NewMessage("plain-"+e.id, []byte(`{}`))
	require.NoError(t, e.tr.Publisher(e.db.SQL).Publish(e.in, awaiting, plain)) // one batch

	<-started
	waitFor(t, 10*time.Second, "the batch committed while the call runs", func() bool {
		return e.count(`SELECT count(*) FROM `+e.eff+` WHERE part = 'plain'`) == 1
	})
	assert.Zero(t, e.count(`SELECT count(*) FROM `+e.eff+` WHERE msg = $1`, awaiting.UUID), "the awaiting attempt was rolled back")
	assert.Equal(t, 1, e.count(`SELECT count(*) FROM pgsaga_queue WHERE uuid = $1 AND attempts = 0
		AND available_at > now() + interval '30 minutes'`, awaiting.UUID), "parked for the call's bound, no attempt counted")

	close(release)
	e.drained(e.in, "g", 10*time.Second)
	assert.Equal(t, 1, e.count(`SELECT count(*) FROM `+e.eff+` WHERE msg = $1 AND part = 'after the call'`, awaiting.UUID))
	assert.Zero(t, e.count(`SELECT count(*) FROM `+e.eff+` WHERE msg = $1 AND part = 'before the call'`, awaiting.UUID))
	assert.Equal(t, int32(2), runs.Load(), "the handler ran twice: before and after its call")
	assert.Equal(t, int32(1), sawAttempt.Load(), "awaiting cost no attempt")
	assert.Equal(t, 1, done.of(awaiting.UUID), "the call ran once")
	assert.Empty(t, e.deadLetters(e.in))
}

// An awaited call that fails is the attempt's failure: the message is
// retried after its backoff, and dead-lettered with the call's error when
// its attempts run out.
func TestAwaitedCallThatFailsCostsTheAttempt(t *testing.T) {
	t.Parallel()
	for name, hold := range map[string]time.Duration{"held": 20 * time.Second, "parked": -1} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t, func(c *transport.Config) { c.Retry.MaxAttempts, c.AwaitHold = 2, hold })
			var handled, called atomic.Int32
			e.runOne(t, func(msg *message.Message) error {
				handled.Add(1)
				return transport.Await(time.Hour, func(ctx context.Context) error {
					called.Add(1)
					return errors.New("the gateway is down")
				})
			})
			e.drained(e.in, "g", 10*time.Second)
			dl := e.deadLetters(e.in)
			require.Len(t, dl, 1)
			assert.Equal(t, 2, dl[0].Attempts)
			assert.Contains(t, dl[0].Reason, "the gateway is down")
			assert.Equal(t, int32(2), handled.Load())
			assert.Equal(t, int32(2), called.Load())
		})
	}
}

// A call that returns while its delivery holds the batch (Config.AwaitHold)
// is followed by the handler's next run in the same batch: the message is
// never parked nor delivered again.
func TestAwaitedCallReturningWithinTheHoldStaysInTheBatch(t *testing.T) {
	t.Parallel()
	e := newEnv(t, func(c *transport.Config) { c.AwaitHold = 20 * time.Second })
	done := newCalls()
	var mu sync.Mutex
	var txids []int64
	e.runOne(t, func(msg *message.Message) error {
		tx, _ := transport.TxFromContext(msg.Context())
		var txid int64
		if err := tx.QueryRowContext(msg.Context(), `SELECT txid_current()`).Scan(&txid); err != nil {
			return err
		}
		mu.Lock()
		txids = append(txids, txid)
		mu.Unlock()
		if transport.AwaitedFromContext(msg.Context()) != (done.of(msg.UUID) > 0) {
			return transport.Permanent(errors.New("AwaitedFromContext is wrong"))
		}
		if done.of(msg.UUID) > 0 {
			return effect(msg, e.eff, "after the call")
		}
		return transport.Await(time.Hour, func(context.Context) error { done.finish(msg.UUID); return nil })
	})
	e.drained(e.in, "g", 10*time.Second)
	mu.Lock()
	defer mu.Unlock()
	require.Len(t, txids, 2, "the handler ran twice")
	assert.Equal(t, txids[0], txids[1], "both runs in one batch transaction")
	assert.Equal(t, 1, e.count(`SELECT count(*) FROM `+e.eff+` WHERE part = 'after the call'`))
}

// A handler that awaits again and again, though its calls succeed, is
// bounded: past RetryPolicy.MaxAttempts awaits of one message, awaiting
// counts as a failed attempt, and the message is dead-lettered in the end
// instead of looping for ever.
func TestAwaitingForEverIsBounded(t *testing.T) {
	t.Parallel()
	e := newEnv(t, func(c *transport.Config) { c.Retry.MaxAttempts, c.AwaitHold = 2, -1 })
	var handled atomic.Int32
	e.runOne(t, func(msg *message.Message) error {
		handled.Add(1)
		return transport.Await(time.Hour, func(context.Context) error { return nil })
	})
	e.drained(e.in, "g", 10*time.Second)
	dl := e.deadLetters(e.in)
	require.Len(t, dl, 1)
	assert.ErrorContains(t, errors.New(dl[0].Reason), "awaited")
	assert.Equal(t, int32(4), handled.Load(), "two awaits honoured, then two attempts that count")
}

// Outside a queue (HandleInTx, an in-process delivery) there is no message
// to hand back: the call runs inline, within the attempt's deadline, and
// the handler runs again in a fresh attempt.
func TestAwaitOutsideAQueueRunsTheCallInline(t *testing.T) {
	t.Parallel()
	t.Run("HandleInTx", func(t *testing.T) {
		t.Parallel()
		e := newEnv(t, nil)
		done := newCalls()
		msg := message.NewMessage("own-"+e.id, []byte(`{}`))
		var runs atomic.Int32
		err := e.tr.HandleInTx(context.Background(), "h", e.in, msg, func(m *message.Message) error {
			runs.Add(1)
			if transport.AwaitedFromContext(m.Context()) != (done.of(m.UUID) > 0) {
				return transport.Permanent(errors.New("AwaitedFromContext is wrong"))
			}
			if done.of(m.UUID) > 0 {
				return effect(m, e.eff, "after the call")
			}
			if err := effect(m, e.eff, "before the call"); err != nil {
				return err
			}
			return transport.Await(time.Hour, func(context.Context) error { done.finish(m.UUID); return nil })
		})
		require.NoError(t, err)
		assert.Equal(t, int32(2), runs.Load())
		assert.Equal(t, 1, done.of(msg.UUID))
		assert.Equal(t, 1, e.count(`SELECT count(*) FROM `+e.eff+` WHERE part = 'after the call'`))
		assert.Zero(t, e.count(`SELECT count(*) FROM `+e.eff+` WHERE part = 'before the call'`), "the awaiting attempt was rolled back")
	})
	t.Run("in process", func(t *testing.T) {
		t.Parallel()
		e := newLocalEnv(t, nil)
		done := newCalls()
		var runs atomic.Int32
		e.routeLocal(t, forward(e), func(m *message.Message) error {
			runs.Add(1)
			if transport.AwaitedFromContext(m.Context()) != (done.of(m.UUID) > 0) {
				return transport.Permanent(errors.New("AwaitedFromContext is wrong"))
			}
			if done.of(m.UUID) > 0 {
				if err := noteTx(m, "l"); err != nil {
					return err
				}
				return effect(m, e.eff, "l")
			}
			return transport.Await(time.Hour, func(context.Context) error { done.finish(m.UUID); return nil })
		})
		e.publish(1)
		e.drained(e.in, "g", 10*time.Second)
		assert.Equal(t, int32(2), runs.Load())
		assert.Zero(t, e.queuedFor(e.out, "local"), "handled in process after its call, never queued")
		assert.Equal(t, 1, e.count(`SELECT count(*) FROM txids l JOIN txids h ON h.txid = l.txid WHERE l.handler = 'l' AND h.handler = 'h'`),
			"in the publisher's transaction")
	})
	t.Run("awaiting twice", func(t *testing.T) {
		t.Parallel()
		e := newEnv(t, func(c *transport.Config) { c.Retry.MaxAttempts = 1 })
		var runs atomic.Int32
		err := e.tr.HandleInTx(context.Background(), "h", e.in, message.NewMessage("twice-"+e.id, []byte(`{}`)), func(*message.Message) error {
			runs.Add(1)
			return transport.Await(time.Hour, func(context.Context) error { return nil })
		})
		require.ErrorIs(t, err, transport.ErrDeadLettered)
		assert.ErrorIs(t, err, transport.ErrAwaitedAgain)
		assert.Equal(t, int32(2), runs.Load(), "one call, then the handler's second run awaits again: a failure")
	})
}

// Await with no call or no positive bound is a programming error: the
// message fails permanently, saying why.
func TestAwaitRefusesNonsense(t *testing.T) {
	t.Parallel()
	for name, err := range map[string]error{
		"no call":  transport.Await(time.Second, nil),
		"no bound": transport.Await(0, func(context.Context) error { return nil }),
	} {
		t.Run(name, func(t *testing.T) {
			assert.True(t, transport.IsPermanent(err), "%v", err)
			assert.ErrorContains(t, err, "Await")
		})
	}
}

// Closing the router cancels the calls still running and wakes their
// messages, uncounted: the next worker delivers them at once instead of
// after the call's bound.
func TestClosingTheRouterWakesAwaitingMessages(t *testing.T) {
	t.Parallel()
	e := newEnv(t, drainCutsOff(200*time.Millisecond))
	started := make(chan struct{})
	var cancelled atomic.Bool
	r, err := e.tr.NewRouter()
	require.NoError(t, err)
	require.NoError(t, r.AddHandler("h", e.in, "g", func(msg *message.Message) error {
		return transport.Await(time.Hour, func(ctx context.Context) error {
			close(started)
			<-ctx.Done()
			cancelled.Store(true)
			return ctx.Err()
		})
	}))
	stop := startRouter(t, r)
	ids := e.publish(1)
	<-started
	waitFor(t, 10*time.Second, "the message parked", func() bool {
		return e.count(`SELECT count(*) FROM pgsaga_queue WHERE uuid = $1 AND available_at > now() + interval '30 minutes'`, ids[0]) == 1
	})
	stop()
	assert.True(t, cancelled.Load(), "Stop returns after the call was cancelled")
	assert.Equal(t, 1, e.count(`SELECT count(*) FROM pgsaga_queue WHERE uuid = $1 AND attempts = 0 AND available_at <= now()`, ids[0]),
		"woken, no attempt counted")
}

// logSink keeps the messages logged at Debug and above, for tests that
// wait for the transport to have done something that leaves no other trace.
type logSink struct {
	mu   sync.Mutex
	msgs []string
}

func (s *logSink) Enabled(context.Context, slog.Level) bool { return true }
func (s *logSink) Handle(_ context.Context, r slog.Record) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.msgs = append(s.msgs, r.Message)
	return nil
}
func (s *logSink) WithAttrs([]slog.Attr) slog.Handler { return s }
func (s *logSink) WithGroup(string) slog.Handler      { return s }

func (s *logSink) saw(prefix string) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, m := range s.msgs {
		if strings.HasPrefix(m, prefix) {
			return true
		}
	}
	return false
}

// The wake-up after a call leaves a message alone that another consumer
// has attempted since it was parked (its park ran out): that attempt's
// backoff stands.
func TestWakeLeavesAMessageAttemptedSince(t *testing.T) {
	t.Parallel()
	sink := &logSink{}
	e := newEnv(t, func(c *transport.Config) { c.Logger = slog.New(sink) })
	started, release := make(chan struct{}), make(chan struct{})
	r, err := e.tr.NewRouter()
	require.NoError(t, err)
	require.NoError(t, r.AddHandler("h", e.in, "g", func(msg *message.Message) error {
		return transport.Await(time.Hour, func(ctx context.Context) error {
			close(started)
			<-release
			return nil
		})
	}))
	startRouter(t, r)
	ids := e.publish(1)
	<-started
	waitFor(t, 10*time.Second, "the message parked", func() bool {
		return e.count(`SELECT count(*) FROM pgsaga_queue WHERE uuid = $1 AND available_at > now() + interval '30 minutes'`, ids[0]) == 1
	})
	// Another consumer's attempt failed meanwhile, with a long backoff.
	_, err = e.db.SQL.Exec(`UPDATE pgsaga_queue SET attempts = 1, available_at = now() + interval '2 hours' WHERE uuid = $1`, ids[0])
	require.NoError(t, err)
	close(release)
	waitFor(t, 10*time.Second, "the call's end handled", func() bool { return sink.saw("awaited call finished") })
	assert.Equal(t, 1, e.count(`SELECT count(*) FROM pgsaga_queue WHERE uuid = $1 AND attempts = 1 AND available_at > now() + interval '90 minutes'`, ids[0]),
		"the later attempt's backoff stands")
}

// connLog records the statements each connection sends, in order.
type connLog struct {
	mu sync.Mutex
	by map[*pgx.Conn][]string
}

func (l *connLog) add(c *pgx.Conn, sql string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.by == nil {
		l.by = map[*pgx.Conn][]string{}
	}
	l.by[c] = append(l.by[c], sql)
}

func (l *connLog) TraceQueryStart(ctx context.Context, c *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	l.add(c, d.SQL)
	return ctx
}
func (*connLog) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}
func (*connLog) TraceBatchStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceBatchStartData) context.Context {
	return ctx
}
func (l *connLog) TraceBatchQuery(_ context.Context, c *pgx.Conn, d pgx.TraceBatchQueryData) {
	l.add(c, d.SQL)
}
func (*connLog) TraceBatchEnd(context.Context, *pgx.Conn, pgx.TraceBatchEndData) {}

// newLoggedEnv is newEnv on a pool of its own whose statements it logs.
func newLoggedEnv(t *testing.T, mutate func(*transport.Config)) (*env, *connLog) {
	t.Helper()
	log := &connLog{}
	db := testdb.Shared(t)
	pool, err := pgdb.Open(context.Background(), pgdb.Config{URL: db.URL, MaxConns: 4, Tracer: log})
	require.NoError(t, err)
	t.Cleanup(pool.Close) // after the router's stop, registered later
	return newEnvOn(t, db, func(c *transport.Config) {
		c.DB = pool.SQL
		mutate(c)
	}), log
}

// around returns, for every statement containing part, the statements
// sent on its connection just before and just after it ("" for none).
func (l *connLog) around(part string) (before, after []string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, stmts := range l.by {
		for i, s := range stmts {
			if !strings.Contains(s, part) {
				continue
			}
			b, a := "", ""
			if i > 0 {
				b = stmts[i-1]
			}
			if i+1 < len(stmts) {
				a = stmts[i+1]
			}
			before, after = append(before, b), append(after, a)
		}
	}
	return before, after
}

// The wake-up of a message whose awaited call ended is one round trip: its
// lock and statement bounds and the wake-up go in one pipeline, one
// implicit transaction, with no BEGIN before them nor COMMIT after.
func TestAWakeUpSendsNoBeginNorCommit(t *testing.T) {
	t.Parallel()
	e, log := newLoggedEnv(t, func(c *transport.Config) { c.AwaitHold = -1 })
	done := newCalls()
	e.runOne(t, func(msg *message.Message) error {
		if done.of(msg.UUID) > 0 {
			return effect(msg, e.eff, "after the call")
		}
		return transport.Await(time.Hour, func(context.Context) error { done.finish(msg.UUID); return nil })
	})
	e.drained(e.in, "g", 10*time.Second)
	require.Equal(t, 1, e.count(`SELECT count(*) FROM `+e.eff+` WHERE part = 'after the call'`), "woken and handled")
	before, after := log.around("WITH woken AS")
	require.Len(t, before, 1, "one wake-up")
	assert.Contains(t, before[0], "set_config('lock_timeout'", "bounded")
	setBefore, _ := log.around("AS pgsaga_lock_timeout")
	require.NotEmpty(t, setBefore)
	for _, s := range setBefore {
		assert.NotEqual(t, "begin", strings.ToLower(strings.TrimSpace(s)), "no BEGIN of its own")
	}
	assert.NotEqual(t, "commit", strings.ToLower(strings.TrimSpace(after[0])), "no COMMIT of its own")
}

// The messages of a batch whose handlers' calls outlive the hold are
// parked with one statement for the batch, written with its commit.
func TestABatchParksItsAwaitingMessagesInOneStatement(t *testing.T) {
	t.Parallel()
	e, log := newLoggedEnv(t, func(c *transport.Config) {
		c.AwaitHold = -1
		c.BatchSize = 50
		c.BatchTimeout = time.Minute
	})
	done := newCalls()
	release := make(chan struct{})
	r, err := e.tr.NewRouter()
	require.NoError(t, err)
	require.NoError(t, r.AddHandler("h", e.in, "g", func(msg *message.Message) error {
		if done.of(msg.UUID) > 0 {
			return effect(msg, e.eff, "after the call")
		}
		return transport.Await(time.Hour, func(context.Context) error {
			<-release
			done.finish(msg.UUID)
			return nil
		})
	}, transport.WithConsumers(1)))
	ids := e.publish(5) // one batch
	startRouter(t, r)
	waitFor(t, 10*time.Second, "the batch parked its messages", func() bool {
		return e.count(`SELECT count(*) FROM pgsaga_queue WHERE topic = $1 AND available_at > now() + interval '30 minutes'`, e.in) == len(ids)
	})
	parks, _ := log.around("SET available_at = clock_timestamp() + make_interval")
	assert.Len(t, parks, 1, "one statement parks the batch's messages")
	close(release)
	e.drained(e.in, "g", 10*time.Second)
	assert.Equal(t, len(ids), e.count(`SELECT count(*) FROM `+e.eff+` WHERE part = 'after the call'`), "each woken and handled once")
	assert.Empty(t, e.deadLetters(e.in))
}

// While MaxAwaitedCalls awaited calls run, the process claims nothing
// more; when one returns, claiming goes on. (Nothing bounded them: 20,000
// sagas against a 60 s gateway ran 8,958 calls at once, with as many open
// files.)
func TestClaimingWaitsWhileTheAwaitedCallsAreAtTheirCap(t *testing.T) {
	t.Parallel()
	e := newEnv(t, func(c *transport.Config) { c.MaxAwaitedCalls, c.BatchSize = 2, 1 })
	release := make(chan struct{}, 4)
	var started atomic.Int32
	r, err := e.tr.NewRouter()
	require.NoError(t, err)
	require.NoError(t, r.AddHandler("h", e.in, "g", func(msg *message.Message) error {
		if transport.AwaitedFromContext(msg.Context()) {
			return effect(msg, e.eff, "after the call")
		}
		return transport.Await(time.Hour, func(ctx context.Context) error {
			started.Add(1)
			select {
			case <-release:
				return nil
			case <-ctx.Done():
				return ctx.Err()
			}
		})
	}, transport.WithConsumers(1)))
	e.publish(4)
	startRouter(t, r)

	waitFor(t, 10*time.Second, "two calls running and the consumer waiting for room", func() bool {
		return started.Load() == 2 && transport.ClaimsWaitingForRoom(e.tr) == 1
	})
	assert.Equal(t, int32(2), started.Load(), "no third call while two run")
	assert.Equal(t, 2, e.count(`SELECT count(*) FROM pgsaga_queue WHERE topic = $1 AND available_at <= now()`, e.in), "two messages not claimed")
	release <- struct{}{}
	waitFor(t, 10*time.Second, "a third call once one returned", func() bool { return started.Load() == 3 })
	for range 3 {
		release <- struct{}{}
	}
	e.drained(e.in, "g", 10*time.Second)
	assert.Equal(t, int32(4), started.Load(), "each call ran once")
	assert.Equal(t, 4, e.count(`SELECT count(*) FROM `+e.eff+` WHERE part = 'after the call'`))
}

// The awaited calls of a batch overlap: each starts when its handler
// awaits, the batch goes on with its other messages meanwhile, and the
// handlers whose calls returned within the hold (counted from each call's
// start) run again before the batch commits, in its transaction. Here no
// call returns before every call of the batch has started: held one after
// another, each would run out its hold and be parked.
func TestTheAwaitedCallsOfABatchOverlap(t *testing.T) {
	t.Parallel()
	const n = 5
	e, log := newLoggedEnv(t, func(c *transport.Config) {
		c.AwaitHold = 2 * time.Second
		c.BatchSize = 50
		c.BatchTimeout = time.Minute
	})
	done := newCalls()
	var started atomic.Int32
	all := make(chan struct{}) // closed when the n-th call starts
	var mu sync.Mutex
	txids := map[int64]int{}
	r, err := e.tr.NewRouter()
	require.NoError(t, err)
	require.NoError(t, r.AddHandler("h", e.in, "g", func(msg *message.Message) error {
		tx, _ := transport.TxFromContext(msg.Context())
		var txid int64
		if err := tx.QueryRowContext(msg.Context(), `SELECT txid_current()`).Scan(&txid); err != nil {
			return err
		}
		mu.Lock()
		txids[txid]++
		mu.Unlock()
		if done.of(msg.UUID) > 0 {
			return effect(msg, e.eff, "after the call")
		}
		return transport.Await(time.Hour, func(ctx context.Context) error {
			if started.Add(1) == n {
				close(all)
			}
			select {
			case <-all:
			case <-ctx.Done():
				return ctx.Err()
			}
			done.finish(msg.UUID)
			return nil
		})
	}, transport.WithConsumers(1)))
	ids := e.publish(n) // one batch
	startRouter(t, r)
	e.drained(e.in, "g", 30*time.Second)
	waitFor(t, 10*time.Second, "nothing left in flight", func() bool {
		return transport.InFlight(r) == 0 && transport.AwaitedCalls(r) == 0
	})

	assert.Equal(t, n, e.count(`SELECT count(*) FROM `+e.eff+` WHERE part = 'after the call'`), "each handled once after its call")
	mu.Lock()
	defer mu.Unlock()
	assert.Len(t, txids, 1, "every run of every message in the batch's transaction: none was parked")
	for _, runs := range txids {
		assert.Equal(t, 2*len(ids), runs, "each handler ran twice: before and after its call")
	}
	parks, _ := log.around("SET available_at = clock_timestamp() + make_interval")
	assert.Empty(t, parks, "nothing parked")
	assert.Empty(t, e.deadLetters(e.in))
}

// A batch that breaks while one of its messages' calls is held lets the
// call go on alone: the batch is rolled back, the call's message is
// delivered again and finds the call's outcome, nothing waits for a
// result no one takes, and the router stops.
func TestABrokenBatchLetsItsHeldCallsGo(t *testing.T) {
	t.Parallel()
	e := newEnv(t, func(c *transport.Config) {
		c.AwaitHold = 20 * time.Second
		c.BatchSize = 50
		c.BatchTimeout = time.Minute
	})
	done := newCalls()
	returned := make(chan struct{})
	r, err := e.tr.NewRouter()
	require.NoError(t, err)
	require.NoError(t, r.AddHandler("h", e.in, "g", func(msg *message.Message) error {
		switch {
		case msg.Metadata.Get("ends") == "yes":
			<-returned // the held call has returned
			tx, _ := transport.TxFromContext(msg.Context())
			_, _ = tx.ExecContext(msg.Context(), "COMMIT")
			return nil
		case done.of(msg.UUID) > 0:
			return effect(msg, e.eff, "after the call")
		}
		return transport.Await(time.Hour, func(context.Context) error {
			done.finish(msg.UUID)
			close(returned)
			return nil
		})
	}, transport.WithConsumers(1)))
	awaiting := message.NewMessage("await-"+e.id, []byte(`{}`))
	breaking := message.NewMessage("ends-"+e.id, []byte(`{}`))
	breaking.Metadata.Set("ends", "yes")
	require.NoError(t, e.tr.Publisher(e.db.SQL).Publish(e.in, awaiting, breaking)) // one batch, the breaking one last
	stop := startRouter(t, r)
	e.drained(e.in, "g", 30*time.Second)
	waitFor(t, 10*time.Second, "nothing left in flight", func() bool {
		return transport.InFlight(r) == 0 && transport.AwaitedCalls(r) == 0
	})
	assert.Equal(t, 1, e.count(`SELECT count(*) FROM `+e.eff+` WHERE msg = $1 AND part = 'after the call'`, awaiting.UUID), "delivered again, it found the call's outcome")
	assert.Equal(t, 1, done.of(awaiting.UUID), "the call ran once")
	dead := e.deadLetters(e.in)
	require.Len(t, dead, 1)
	assert.Equal(t, breaking.UUID, dead[0].UUID)
	stop()
}

// indexOf is the index publish gave msg.
func indexOf(msg *message.Message) int {
	var p struct{ I int }
	_ = json.Unmarshal(msg.Payload, &p)
	return p.I
}

// Close waits for the run after a held call as for any attempt in
// flight, up to CloseTimeout, and then cuts it off: the run, made by the
// batch right before its commit, is in flight for the router until it
// ends.
func TestCloseCutsOffARunAfterItsHeldCall(t *testing.T) {
	t.Parallel()
	e := newEnv(t, func(c *transport.Config) {
		c.AttemptTimeout, c.BatchTimeout, c.CloseTimeout = 20*time.Second, 10*time.Second, 300*time.Millisecond
		c.AwaitHold = 2 * time.Second
		c.StatementTimeout = 2 * time.Second // Watermill's own close gives up after 7 s
	})
	done := newCalls()
	rerun := make(chan struct{})
	var once sync.Once
	r, err := e.tr.NewRouter()
	require.NoError(t, err)
	require.NoError(t, r.AddHandler("h", e.in, "g", func(msg *message.Message) error {
		if done.of(msg.UUID) > 0 {
			once.Do(func() { close(rerun) })
			<-msg.Context().Done() // ends when cut off (or at its deadline)
			return msg.Context().Err()
		}
		return transport.Await(time.Hour, func(context.Context) error { done.finish(msg.UUID); return nil })
	}, transport.WithConsumers(1)))
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	require.NoError(t, r.Start(ctx))
	e.publish(1)
	select {
	case <-rerun:
	case <-time.After(10 * time.Second):
		t.Fatal("the run after the call never started")
	}
	stopped := make(chan error, 1)
	go func() { stopped <- r.Stop() }()
	select {
	case err := <-stopped:
		assert.NoError(t, err, "the run was cut off at CloseTimeout, and the router closed")
	case <-time.After(5 * time.Second): // Watermill's close would fail after 7 s
		t.Fatal("Stop did not cut off the run after the held call")
	}
}

// The run after a held call has an attempt's whole time, however long the
// batch's other deliveries took since the first run: its call succeeded,
// so it costs no attempt.
func TestTheRunAfterAHeldCallHasAnAttemptsTime(t *testing.T) {
	t.Parallel()
	e := newEnv(t, func(c *transport.Config) {
		c.AttemptTimeout, c.BatchTimeout = 300*time.Millisecond, 5*time.Second
		c.AwaitHold = 100 * time.Millisecond
	})
	done := newCalls()
	var calls, maxAttempt atomic.Int32
	r, err := e.tr.NewRouter()
	require.NoError(t, err)
	require.NoError(t, r.AddHandler("h", e.in, "g", func(msg *message.Message) error {
		if indexOf(msg) != 0 {
			time.Sleep(200 * time.Millisecond) // slow work, within its own attempt's 300 ms
			return effect(msg, e.eff, "other")
		}
		if n := int32(transport.AttemptFromContext(msg.Context())); n > maxAttempt.Load() {
			maxAttempt.Store(n)
		}
		if done.of(msg.UUID) > 0 {
			return effect(msg, e.eff, "after the call")
		}
		return transport.Await(time.Hour, func(context.Context) error {
			calls.Add(1)
			done.finish(msg.UUID)
			return nil
		})
	}, transport.WithConsumers(1)))
	e.publish(3) // one batch: 0 awaits a quick call, 1 and 2 take 200 ms each
	startRouter(t, r)
	e.drained(e.in, "g", 20*time.Second)
	assert.Equal(t, 1, e.count(`SELECT count(*) FROM `+e.eff+` WHERE part = 'after the call'`))
	assert.Equal(t, int32(1), maxAttempt.Load(), "no attempt of the awaiting message failed")
	assert.Equal(t, int32(1), calls.Load(), "the call ran once")
}

// A held call that returned while the router closes is not followed by
// its run in the batch (no attempt starts then): its message is parked
// and woken once the batch is over, so that its next delivery, in the
// next router, knows of the call and does not make it again.
func TestAHeldCallThatReturnedAsTheRouterClosesIsNotMadeAgain(t *testing.T) {
	t.Parallel()
	e := newEnv(t, func(c *transport.Config) {
		c.AttemptTimeout, c.BatchTimeout, c.CloseTimeout = 20*time.Second, 10*time.Second, 10*time.Second
		c.AwaitHold = 2 * time.Second
	})
	var calls, awaitedRuns atomic.Int32
	closing := make(chan struct{})
	handler := func(msg *message.Message) error {
		if indexOf(msg) == 1 {
			<-closing
			return effect(msg, e.eff, "other")
		}
		if transport.AwaitedFromContext(msg.Context()) {
			awaitedRuns.Add(1)
			return effect(msg, e.eff, "after the call")
		}
		return transport.Await(time.Hour, func(context.Context) error { calls.Add(1); return nil })
	}
	r, err := e.tr.NewRouter()
	require.NoError(t, err)
	require.NoError(t, r.AddHandler("h", e.in, "g", handler, transport.WithConsumers(1)))
	e.publish(2) // one batch: 0 awaits a quick call, 1 waits for the close
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	require.NoError(t, r.Start(ctx))
	waitFor(t, 10*time.Second, "the call ran", func() bool { return calls.Load() == 1 })
	stopped := make(chan error, 1)
	go func() { stopped <- r.Stop() }()
	waitFor(t, 10*time.Second, "the router closes", func() bool { return transport.Closing(r) })
	close(closing)
	require.NoError(t, <-stopped)

	r2, err := e.tr.NewRouter()
	require.NoError(t, err)
	require.NoError(t, r2.AddHandler("h", e.in, "g", handler, transport.WithConsumers(1)))
	startRouter(t, r2)
	e.drained(e.in, "g", 20*time.Second)
	assert.Equal(t, int32(1), calls.Load(), "the call ran once for its message")
	assert.Equal(t, int32(1), awaitedRuns.Load(), "the run after the call knew of it")
}
