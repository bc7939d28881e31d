package transport

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"io"
	"log/slog"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/internal/dbtx"
	"github.com/pgsaga/pgsaga/internal/testdb"
)

// Guards of the consumer that no well-behaved handler reaches; each test
// fails if its guard is removed.

func internalConsumer(t *testing.T, mutate func(*Config)) (*consumer, *testdb.DB) {
	t.Helper()
	db := testdb.Shared(t)
	cfg := Config{DB: db.SQL, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))}
	if mutate != nil {
		mutate(&cfg)
	}
	tr, err := New(cfg)
	require.NoError(t, err)
	topic := "internal_" + time.Now().Format("150405.000000000")
	require.NoError(t, tr.Subscribe(context.Background(), Subscription{Topic: topic, ConsumerGroup: "g"}))
	return newConsumer(tr, route{name: "h", topic: topic, group: "g", retry: tr.cfg.Retry}, newGate(), nil), db
}

// queued publishes one message to c's topic and returns its queue row.
func queued(t *testing.T, c *consumer) int64 {
	t.Helper()
	msg := message.NewMessage("m-"+time.Now().Format("150405.000000000"), nil)
	require.NoError(t, c.t.Publisher(c.t.db).Publish(c.rt.topic, msg))
	var id int64
	require.NoError(t, c.t.db.QueryRow(`SELECT id FROM pgsaga_queue WHERE uuid = $1`, msg.UUID).Scan(&id))
	return id
}

func newTestBatch() *batch {
	b := &batch{}
	b.settled = sync.NewCond(&b.mu)
	return b
}

// A broken batch is never allowed to commit, even if its connection could:
// what its broken attempt did is in the transaction.
func TestCommitQueryRefusesABrokenBatch(t *testing.T) {
	c := &consumer{}
	c.cur = newTestBatch()
	assert.Equal(t, commitSQL, c.commitQuery())
	c.cur = newTestBatch()
	c.cur.broken = errors.New("an attempt could not be rolled back")
	assert.Equal(t, refuseCommitSQL, c.commitQuery())
	c.cur = nil
	assert.Equal(t, refuseCommitSQL, c.commitQuery(), "no batch: nothing to allow")
}

// The commit waits for the deliveries under way, and none starts after it.
func TestCommitQueryWaitsForDeliveriesUnderWay(t *testing.T) {
	c := &consumer{}
	b := newTestBatch()
	c.cur = b
	require.True(t, b.admit(false))
	var settled atomic.Bool
	type answer struct {
		query   string
		settled bool
	}
	got := make(chan answer, 1)
	go func() {
		q := c.commitQuery()
		got <- answer{q, settled.Load()}
	}()
	// Once commitQuery has begun, it waits for settle.
	for {
		b.mu.Lock()
		committing := b.committing
		b.mu.Unlock()
		if committing {
			break
		}
		runtime.Gosched()
	}
	settled.Store(true)
	b.settle()
	a := <-got
	assert.True(t, a.settled, "commitQuery returned with a delivery under way")
	assert.Equal(t, commitSQL, a.query)
	assert.False(t, b.admit(false), "no delivery starts once the commit is under way")
}

// The failure of an attempt that broke its batch is recorded once: a
// second record of the same attempt (another consumer recorded it
// meanwhile) changes nothing.
func TestRecordAfterCountsAnAttemptOnce(t *testing.T) {
	c, db := internalConsumer(t, nil)
	id := queued(t, c)
	f := failure{d: delivery{id: id}, n: 1, cause: errors.New("broke")}
	c.recordAfter(f)
	var attempts int
	var avail time.Time
	require.NoError(t, db.SQL.QueryRow(`SELECT attempts, available_at FROM pgsaga_queue WHERE id = $1`, id).Scan(&attempts, &avail))
	assert.Equal(t, 1, attempts)
	_, err := db.SQL.Exec(`UPDATE pgsaga_queue SET available_at = 'epoch' WHERE id = $1`, id)
	require.NoError(t, err)
	c.recordAfter(f)
	require.NoError(t, db.SQL.QueryRow(`SELECT attempts, available_at FROM pgsaga_queue WHERE id = $1`, id).Scan(&attempts, &avail))
	assert.Equal(t, 1, attempts)
	assert.True(t, avail.Equal(time.Unix(0, 0)), "the second record left the row alone")
}

// A final failure recorded after its batch rolled back does not dead-letter
// a message whose attempt was recorded meanwhile by another consumer (one,
// say, of a process allowing more attempts, which scheduled a retry): an
// attempt counts once, and the message stays queued.
func TestRecordAfterDoesNotDeadLetterAnAttemptRecordedElsewhere(t *testing.T) {
	c, db := internalConsumer(t, nil)
	id := queued(t, c)
	_, err := db.SQL.Exec(`UPDATE pgsaga_queue SET attempts = 5 WHERE id = $1`, id)
	require.NoError(t, err)
	c.recordAfter(failure{d: delivery{id: id}, n: 5, cause: errors.New("broke")}) // final for this consumer
	assert.Equal(t, 5, attemptsOf(t, db, id), "the message is still queued")
	var dead int // on this test's topic: the package's database holds other tests' (and runs') dead letters
	require.NoError(t, db.SQL.QueryRow(`SELECT count(*) FROM pgsaga_dead_letters WHERE topic = $1`, c.rt.topic).Scan(&dead))
	assert.Zero(t, dead)
}

// Recording a failure after the batch waits for the message's row: the
// batch's own backend, on its way out after losing its connection, may
// still hold it. It records once the row is free.
func TestRecordAfterWaitsForTheRow(t *testing.T) {
	c, db := internalConsumer(t, func(cfg *Config) { cfg.LockTimeout = time.Minute })
	id := queued(t, c)
	holder := holdRow(t, db, id)
	done := recordInBackground(c, failure{d: delivery{id: id}, n: 1, cause: errors.New("broke")})
	db.WaitForLockWait(t)
	require.NoError(t, holder.Rollback())
	<-done
	assert.Equal(t, 1, attemptsOf(t, db, id))
}

// ... but not longer than Config.LockTimeout: a consumer holding the
// message for longer decides what becomes of it.
func TestRecordAfterGivesUpAfterLockTimeout(t *testing.T) {
	c, db := internalConsumer(t, func(cfg *Config) { cfg.LockTimeout = 50 * time.Millisecond; cfg.StatementTimeout = time.Minute })
	id := queued(t, c)
	holder := holdRow(t, db, id)
	done := recordInBackground(c, failure{d: delivery{id: id}, n: 5, cause: errors.New("broke")}) // final: dead letter
	select {
	case <-done:
	case <-time.After(30 * time.Second):
		t.Fatal("recordAfter waited past its lock timeout")
	}
	require.NoError(t, holder.Rollback())
	assert.Zero(t, attemptsOf(t, db, id))
}

// holdRow locks queue row id in a transaction it returns.
func holdRow(t *testing.T, db *testdb.DB, id int64) *sql.Tx {
	t.Helper()
	holder, err := db.SQL.Begin()
	require.NoError(t, err)
	t.Cleanup(func() { _ = holder.Rollback() })
	_, err = holder.Exec(`SELECT 1 FROM pgsaga_queue WHERE id = $1 FOR UPDATE`, id)
	require.NoError(t, err)
	return holder
}

// recordInBackground runs c.recordAfter(f); the channel closes when it
// returns.
func recordInBackground(c *consumer, f failure) <-chan struct{} {
	done := make(chan struct{})
	go func() {
		defer close(done)
		c.recordAfter(f)
	}()
	return done
}

func attemptsOf(t *testing.T, db *testdb.DB, id int64) int {
	t.Helper()
	var n int
	require.NoError(t, db.SQL.QueryRow(`SELECT attempts FROM pgsaga_queue WHERE id = $1`, id).Scan(&n))
	return n
}

// A message is admitted only into the batch that claimed it: one that
// reaches the gate after its batch ended, while another is open, is left
// queued.
func TestAdmitOnlyIntoTheClaimingBatch(t *testing.T) {
	c := &consumer{log: slog.New(slog.NewTextHandler(io.Discard, nil))}
	c.cur = newTestBatch()
	c.cur.d.tx = new(sql.Tx)
	msg := message.NewMessage("m", nil)
	msg.Metadata.Set(metaDelivery, "1/0")
	tk, run := c.admit(new(sql.Tx), msg, false)
	assert.Nil(t, tk)
	assert.False(t, run)
	tk, run = c.admit(c.cur.d.tx, msg, false)
	require.NotNil(t, tk)
	assert.True(t, run)
}

// A stopped listener on its way out cannot mark its successor as
// listening, nor as down: consumers would trust notifications nobody
// receives, or poll for nothing.
func TestOnlyTheLatestListenerSetsUp(t *testing.T) {
	h := &wakeHub{}
	old := h.newListener()
	h.setUp(old, true)
	require.True(t, h.up.Load())
	cur := h.newListener()
	assert.False(t, h.up.Load(), "a new listener is not up until it listens")
	h.setUp(old, true)
	assert.False(t, h.up.Load(), "the old listener's late OnListen")
	h.setUp(cur, true)
	h.setUp(old, false)
	assert.True(t, h.up.Load(), "the old listener's exit")
}

// A failed poll waits in HandleError and returns no wait: watermill-sql
// adds the error to its logger for every wait it is given, so a consumer
// failing for hours would log ever longer lines.
func TestFailedPollWaitsInsideTheBackoffManager(t *testing.T) {
	p := &pollState{cfg: Config{RetryInterval: 20 * time.Millisecond, MaxRetryInterval: time.Second},
		endBatch: func(error) bool { return false }, stopping: func() bool { return false },
		wakeCh: make(chan struct{}, 1), closed: make(chan struct{}), next: -1}
	start := time.Now()
	assert.Zero(t, p.HandleError(watermill.NopLogger{}, false, errors.New("connection refused")))
	assert.GreaterOrEqual(t, time.Since(start), 20*time.Millisecond, "it waited RetryInterval")
}

// After a batch its consumer abandoned, the consumer polls again at once:
// the failure was its own, logged, and the messages are free.
func TestAbandonedBatchIsPolledAgainAtOnce(t *testing.T) {
	p := &pollState{cfg: Config{RetryInterval: time.Hour, MaxRetryInterval: time.Hour},
		endBatch: func(error) bool { return true }, stopping: func() bool { return false },
		wakeCh: make(chan struct{}, 1), closed: make(chan struct{}), next: -1}
	got := make(chan time.Duration, 1)
	go func() { got <- p.HandleError(watermill.NopLogger{}, false, sql.ErrTxDone) }()
	select {
	case d := <-got:
		assert.Zero(t, d)
	case <-time.After(30 * time.Second):
		t.Fatal("HandleError backed off after an abandoned batch")
	}
}

// A replayed row the handler never scans is closed when the attempt's
// context for rows is cancelled: it does not keep a connection of the
// replay pool for ever.
func TestUnscannedReplayedRowIsClosedAtTheEndOfTheAttempt(t *testing.T) {
	db := dbtx.NewReplayDB()
	defer db.Close()
	ctx, cancel := context.WithCancel(context.Background())
	_ = replayed{Columns: []string{"n"}, Values: [][]driver.Value{{int64(1)}}}.RowOn(ctx, db)
	require.Equal(t, 1, db.Stats().InUse)
	cancel()
	deadline := time.Now().Add(10 * time.Second)
	for db.Stats().InUse != 0 {
		if time.Now().After(deadline) {
			t.Fatal("the unscanned row still holds its connection")
		}
		time.Sleep(time.Millisecond)
	}
}

// A handler statement that may set, roll back to or release a savepoint
// is told by its words in any case; others are not.
func TestMentionsSavepoint(t *testing.T) {
	for q, want := range map[string]bool{
		"SAVEPOINT mine": true, "rollback to mine": true, "Release Mine": true, "SELECT 1; SaVePoInT x": true,
		"SELECT 1": false, "INSERT INTO t VALUES ('roll back')": false, "": false, "rollbac": false,
	} {
		if got := mentionsSavepoint(q); got != want {
			t.Errorf("mentionsSavepoint(%q) = %v, want %v", q, got, want)
		}
	}
}

// A batch's claim of a key is its message's: another message's attempt
// does not get it while it is held, gets it once it is freed; an attempt
// that gets it with another request hash is told to store its own; an
// in-process delivery (no queue row) or an attempt that is over gets none.
func TestClaimedInBatch(t *testing.T) {
	d := &deliveryTx{claims: &batchClaims{owner: map[string]int64{}, hash: map[string][]byte{}}}
	k := claimKey("step", "key-1")
	d.claims.owner[k], d.claims.hash[k] = 7, []byte{1}
	attempt := func(id int64) *attemptTx { return &attemptTx{d: d, queueID: id} }
	check := func(what string, a *attemptTx, scope, key string, hash []byte, claimed, rehash bool) {
		t.Helper()
		c, r := a.ClaimedInBatch(scope, key, hash)
		if c != claimed || r != rehash {
			t.Fatalf("%s: got claimed %v, rehash %v; want %v, %v", what, c, r, claimed, rehash)
		}
	}
	hash := []byte{1}
	check("the owner's attempt gets its claim", attempt(7), "step", "key-1", hash, true, false)
	check("so does its next attempt (after an awaited call, say)", attempt(7), "step", "key-1", hash, true, false)
	check("another message does not, while the owner holds it", attempt(8), "step", "key-1", hash, false, false)
	check("a key the batch did not claim is nobody's", attempt(7), "step", "key-2", hash, false, false)
	check("nor one of another scope", attempt(7), "other", "key-1", hash, false, false)
	check("the owner whose message a middleware changed stores its hash", attempt(7), "step", "key-1", []byte{3}, true, true)
	check("every run (a failed one took what it stored with it)", attempt(7), "step", "key-1", []byte{3}, true, true)
	d.claims.free(7)
	check("an in-process delivery has no claim of the batch's", attempt(0), "step", "key-1", hash, false, false)
	over := attempt(8)
	over.over = true
	check("an attempt that is over gets nothing", over, "step", "key-1", []byte{3}, false, false)
	check("a freed claim goes to the next copy, with its hash", attempt(8), "step", "key-1", []byte{2}, true, true)
	check("and is then that copy's", attempt(7), "step", "key-1", []byte{2}, false, false)
	check("a copy with the batch's hash stores nothing", attempt(8), "step", "key-1", hash, true, false)
	var none *batchClaims
	none.free(7) // a batch without claims frees nothing
	check("a batch without claims has none", &attemptTx{d: &deliveryTx{}, queueID: 7}, "step", "key-1", hash, false, false)
}

// countingLogger counts the lines logged at each level.
type countingLogger struct {
	watermill.NopLogger
	mu     sync.Mutex
	errors int
	infos  int
}

func (l *countingLogger) Error(string, error, watermill.LogFields) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.errors++
}

func (l *countingLogger) Info(string, watermill.LogFields) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.infos++
}

func (l *countingLogger) With(watermill.LogFields) watermill.LoggerAdapter { return l }

// In a database outage every consumer of a process fails every backoff:
// the failures are told together, the first at once, then a line a minute
// at most, and the first poll that works again once. (180 s of an outage
// logged 20,351 identical warnings.)
func TestFailedPollsOfAProcessAreToldOnceAMinute(t *testing.T) {
	now := time.Unix(0, 0)
	f := &pollFailures{now: func() time.Time { return now }}
	log := &countingLogger{}
	consumers := make([]*pollState, 20)
	for i := range consumers {
		consumers[i] = &pollState{cfg: Config{RetryInterval: time.Nanosecond, MaxRetryInterval: time.Nanosecond},
			endBatch: func(error) bool { return false }, stopping: func() bool { return false },
			wakeCh: make(chan struct{}, 1), closed: make(chan struct{}), next: -1, failures: f}
	}
	for range 180 { // three minutes, a poll of every consumer every second
		for _, p := range consumers {
			p.HandleError(log, false, errors.New("connection refused"))
		}
		now = now.Add(time.Second)
	}
	assert.Equal(t, 1+2, log.errors, "the first failure, then one line a minute (3,600 failed polls)")
	for _, p := range consumers {
		p.HandleError(log, true, nil)
	}
	assert.Equal(t, 1, log.infos, "working again, told once")
	consumers[0].HandleError(log, false, errors.New("connection refused"))
	assert.Equal(t, 4, log.errors, "a new outage is told at once")
}
