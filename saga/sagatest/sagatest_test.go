package sagatest_test

import (
	"context"
	"database/sql"
	"errors"
	"io"
	"log/slog"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"testing/fstest"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/internal/testdb"
	"github.com/pgsaga/pgsaga/internal/transport"
	"github.com/pgsaga/pgsaga/saga"
	"github.com/pgsaga/pgsaga/saga/sagatest"
	"github.com/pgsaga/pgsaga/saga/sagatest/embeddedpg"
	"github.com/pgsaga/pgsaga/steps"
)

// The kit's tests run with an application schema of their own, as a
// user's would (TestDBHoldsTheApplicationsTables).
func TestMain(m *testing.M) {
	embeddedpg.Main(m, sagatest.Schema{Files: notesSchema, Migrate: func(ctx context.Context, db *sql.DB) ([]int64, error) {
		_, err := db.ExecContext(ctx, `CREATE TABLE IF NOT EXISTS kit_notes (id int PRIMARY KEY)`)
		return []int64{1}, err
	}})
}

// notesSchema is the kit's tests' application schema.
var notesSchema = fstest.MapFS{"00001_notes.sql": {Data: []byte(`CREATE TABLE kit_notes (id int PRIMARY KEY)`)}}

// A test database holds the tables of the schemas given to Main.
func TestDBHoldsTheApplicationsTables(t *testing.T) {
	t.Parallel()
	db := sagatest.DB(t)
	_, err := db.SQL.Exec(`INSERT INTO kit_notes VALUES (1)`)
	require.NoError(t, err, "the application's table is in the database")
	var queue bool
	require.NoError(t, db.SQL.QueryRow(`SELECT to_regclass('pgsaga_queue') IS NOT NULL`).Scan(&queue))
	assert.True(t, queue, "pgsaga's are too")
}

var quiet = slog.New(slog.NewTextHandler(io.Discard, nil))

// The same seed makes the same decisions for the same messages, whatever
// the order they come in.
func TestFaultsAreReproducible(t *testing.T) {
	t.Parallel()
	db := testdb.Fresh(t)
	decide := func(order []string) map[string]error {
		inj, err := sagatest.NewInjector(db.SQL, sagatest.Faults{Seed: 7, CrashBeforeCommitRate: 0.5}, nil)
		require.NoError(t, err)
		h := inj.Intercept("h", func(*message.Message) error { return nil })
		out := map[string]error{}
		for _, id := range order {
			out[id] = h(message.NewMessage(id, nil))
		}
		return out
	}
	ids := []string{"a", "b", "c", "d", "e", "f", "g", "h"}
	forward := decide(ids)
	backward := decide([]string{"h", "g", "f", "e", "d", "c", "b", "a"})
	assert.Equal(t, forward, backward)
	crashed := 0
	for _, err := range forward {
		if errors.Is(err, sagatest.ErrInjectedCrash) {
			crashed++
		}
	}
	assert.True(t, crashed > 0 && crashed < len(ids), "about half crash: %d of %d", crashed, len(ids))
}

func TestFaultsValidate(t *testing.T) {
	t.Parallel()
	db := testdb.Shared(t)
	for _, f := range []sagatest.Faults{
		{DuplicateRate: 1.5},
		{CrashBeforeCommitRate: -0.1},
		{CrashBeforeCommitRate: 0.6, CrashAfterCommitRate: 0.6},
	} {
		_, err := sagatest.NewInjector(db.SQL, f, nil)
		require.Error(t, err)
	}
	_, err := sagatest.NewInjector(nil, sagatest.Faults{}, nil)
	require.Error(t, err)
}

// Duplicates arrive later, as copies with the same UUID; crashes after
// commit deliver the message again; a killed connection is recovered.
func TestInjectorOnARouter(t *testing.T) {
	t.Parallel()
	db := testdb.Fresh(t)
	// A killed connection abandons its whole batch: keep batches small and
	// kills rare enough that batches get through.
	inj, err := sagatest.NewInjector(testdb.Open(t, db.URL, 4).SQL, sagatest.Faults{
		Seed: 3, DuplicateRate: 1, MaxCopies: 2, MaxCopyDelay: 50 * time.Millisecond,
		CrashAfterCommitRate: 0.3, KillConnectionRate: 0.05, CrashBeforeCommitRate: 0.2,
	}, quiet)
	require.NoError(t, err)
	// Up to 0.25 of attempts fail: with the default 5 attempts, one message
	// in a thousand would be dead-lettered, too often for this test.
	tr, err := transport.New(transport.Config{DB: db.SQL, PollInterval: 20 * time.Millisecond, IdlePollInterval: testdb.NoSafetyPoll, BatchSize: 5,
		Intercept: inj.Intercept, Logger: quiet, Retry: transport.RetryPolicy{MaxAttempts: 20}})
	require.NoError(t, err)
	topic := "t_" + uuid.NewString()[:8]
	// "archive" keeps a copy of every row the topic ever got.
	require.NoError(t, tr.Subscribe(context.Background(), transport.Subscription{Topic: topic, ConsumerGroup: "archive"}))
	_, err = db.SQL.Exec(`CREATE TABLE seen (uuid text, copy text)`)
	require.NoError(t, err)
	r, err := tr.NewRouter()
	require.NoError(t, err)
	require.NoError(t, r.AddHandler("h", topic, "", func(msg *message.Message) error {
		tx, _ := transport.TxFromContext(msg.Context())
		_, err := tx.ExecContext(msg.Context(), `INSERT INTO seen VALUES ($1, $2)`, msg.UUID, msg.Metadata.Get(sagatest.CopyMetadata))
		return err
	}))
	require.NoError(t, r.Start(context.Background()))
	var msgs []*message.Message
	// Fixed UUIDs: the faults of each message's first attempt are the same
	// every run, and include every kind counted below.
	for i := range 20 {
		id := uuid.NewSHA1(uuid.NameSpaceOID, []byte("injector-"+strconv.Itoa(i)))
		msgs = append(msgs, message.NewMessage(id.String(), []byte(`{}`)))
	}
	require.NoError(t, tr.Publisher(db.SQL).Publish(topic, msgs...))

	// Every committed row of the topic (originals, copies, redeliveries
	// after commit) is handled exactly once: one committed effect per row.
	waitUntil := func(what string, cond func() bool) {
		deadline := time.Now().Add(30 * time.Second)
		for !cond() {
			require.True(t, time.Now().Before(deadline), "timed out waiting for %s (%+v)", what, inj.Stats())
			time.Sleep(20 * time.Millisecond)
		}
	}
	count := func(q string) int {
		var n int
		require.NoError(t, db.SQL.QueryRow(q).Scan(&n))
		return n
	}
	waitUntil("the originals", func() bool { return count(`SELECT count(DISTINCT uuid) FROM seen`) == 20 })
	inj.Flush()
	waitUntil("every row consumed", func() bool {
		return count(`SELECT count(*) FROM pgsaga_queue WHERE consumer_group = 'h'`) == 0
	})
	require.NoError(t, r.Stop())
	require.NoError(t, inj.Close())
	assert.Equal(t, count(`SELECT count(*) FROM pgsaga_queue WHERE consumer_group = 'archive'`), count(`SELECT count(*) FROM seen`),
		"one effect per delivered row")
	var dead []string
	rows, err := db.SQL.Query(`SELECT format('%s attempts=%s: %s', uuid, attempts, reason) FROM pgsaga_dead_letters`)
	require.NoError(t, err)
	for rows.Next() {
		var d string
		require.NoError(t, rows.Scan(&d))
		dead = append(dead, d)
	}
	require.NoError(t, rows.Err())
	assert.Empty(t, dead, "nothing is dead-lettered")
	st := inj.Stats()
	assert.Equal(t, 20, st.Duplicated, "every message was duplicated")
	assert.Positive(t, st.CrashesAfter)
	assert.Positive(t, st.CrashesBefore)
	assert.Positive(t, st.ConnectionsKilled)
	var copies int
	require.NoError(t, db.SQL.QueryRow(`SELECT count(*) FROM seen WHERE copy <> ''`).Scan(&copies))
	assert.Positive(t, copies, "copies were delivered with the copy mark")
}

type fakeWorker struct {
	once             sync.Once
	started, stopped *atomic.Int32
}

func (w *fakeWorker) Start(context.Context) error { w.started.Add(1); return nil }
func (w *fakeWorker) Stop() error                 { w.once.Do(func() { w.stopped.Add(1) }); return nil }

func TestChurnRestartsWorkers(t *testing.T) {
	t.Parallel()
	var started, stopped atomic.Int32
	c, err := sagatest.StartChurn(sagatest.ChurnConfig{Workers: 3, MinUp: 5 * time.Millisecond, MaxUp: 20 * time.Millisecond, Seed: 1,
		New: func() (sagatest.Worker, error) {
			return &fakeWorker{started: &started, stopped: &stopped}, nil
		}})
	require.NoError(t, err)
	deadline := time.Now().Add(10 * time.Second)
	for c.Restarts() < 10 {
		require.True(t, time.Now().Before(deadline))
		time.Sleep(5 * time.Millisecond)
	}
	require.NoError(t, c.Stop())
	require.NoError(t, c.Stop(), "stopping twice is fine")
	assert.GreaterOrEqual(t, int(started.Load()), 13)
	assert.Equal(t, started.Load(), stopped.Load(), "every worker started was stopped")
	_, err = sagatest.StartChurn(sagatest.ChurnConfig{})
	require.Error(t, err)
}

// The checker names each broken generic invariant and its rows.
func TestCheckerReportsRows(t *testing.T) {
	t.Parallel()
	db := testdb.Fresh(t)
	def := saga.MustDefine(saga.Spec[struct{}]{
		Name:    "probe",
		Trigger: saga.On("probe.start", func(probeCmd) (string, struct{}, error) { return "k", struct{}{}, nil }),
		Steps:   []saga.Step[struct{}]{{Name: "do", Action: saga.Send(steps.Define[probeCmd]("probe.do", "probe.do", nil), func(struct{}) probeCmd { return probeCmd{} })}},
	})
	running := uuid.New()
	_, err := db.SQL.Exec(`INSERT INTO saga_instances (id, saga_type, definition_version, status, data, current_step) VALUES ($1, 'probe', 1, 'running', '{}', 0)`, running)
	require.NoError(t, err)
	// Four commands sent: one handled, one dead-lettered, one still queued,
	// and one of which nothing is left.
	_, err = db.SQL.Exec(`INSERT INTO saga_history (saga_id, seq, kind, step, command_key) VALUES
		($1, 1, 'sent', 'do', 'handled'), ($1, 2, 'sent', 'do', 'dead'), ($1, 3, 'sent', 'do', 'queued'), ($1, 4, 'resent', 'do', 'lost-command')`, running)
	require.NoError(t, err)
	_, err = db.SQL.Exec(`INSERT INTO idempotency_keys (scope, key, request_hash, status, completed_at) VALUES ('do', 'handled', '\x01', 'completed', now())`)
	require.NoError(t, err)
	_, err = db.SQL.Exec(`INSERT INTO pgsaga_dead_letters (uuid, topic, consumer_group, handler, metadata, reason, attempts, created_at)
		VALUES ('d', 'probe.do', 'g', 'h', '{"idempotency_key": "dead"}', 'test', 1, now())`)
	require.NoError(t, err)
	_, err = db.SQL.Exec(`INSERT INTO pgsaga_queue (topic, consumer_group, uuid, metadata) VALUES ('probe.do', 'g', 'q', '{"idempotency_key": "queued"}')`)
	require.NoError(t, err)
	_, err = db.SQL.Exec(`INSERT INTO idempotency_keys (scope, key, request_hash) VALUES ('s', 'k', '\x01')`)
	require.NoError(t, err)
	_, err = db.SQL.Exec(`INSERT INTO domain_events (event_id, stream_id, version, event_type, payload, metadata) VALUES
		($1, 'x', 1, 'e', '{}', '{"idempotency_key": "dup"}'), ($2, 'x', 2, 'e', '{}', '{"idempotency_key": "dup"}')`, uuid.New(), uuid.New())
	require.NoError(t, err)
	violations, err := sagatest.Checker{DB: db.SQL, Definitions: []*saga.Definition{def}}.Check(context.Background())
	require.NoError(t, err)
	got := map[string][]string{}
	for _, v := range violations {
		got[v.Invariant] = v.Rows
	}
	assert.Equal(t, []string{running.String() + " probe running"}, got["sagas not terminal"])
	assert.Equal(t, []string{"s/k"}, got["idempotency keys left pending"])
	assert.Equal(t, []string{"x e key dup x2"}, got["effects applied more than once (events appended twice under one key)"])
	assert.Equal(t, []string{"lost-command"}, got["commands neither handled, dead-lettered nor queued"])
}

func TestWaitTerminalNamesTheUnfinished(t *testing.T) {
	t.Parallel()
	db := testdb.Fresh(t)
	missing := uuid.New()
	_, err := sagatest.WaitTerminal(context.Background(), db.SQL, []uuid.UUID{missing}, 50*time.Millisecond)
	require.ErrorContains(t, err, missing.String()+" not started")
}

type probeCmd struct{}

func (probeCmd) MessageType() string { return "probe.Do" }

// A message delivered in process exists only if its publisher commits: its
// copies are made in that transaction, so a publisher that rolls back
// leaves no copy of it, and one that commits has its copies delivered.
func TestInjectorCopiesInProcessMessagesOnlyIfTheyCommit(t *testing.T) {
	t.Parallel()
	db := testdb.Fresh(t)
	inj, err := sagatest.NewInjector(testdb.Open(t, db.URL, 4).SQL, sagatest.Faults{Seed: 5, DuplicateRate: 1, MaxCopies: 1, MaxCopyDelay: time.Millisecond,
		Skip: func(handler string) bool { return handler == "h" }}, quiet) // only the in-process handler's messages are copied
	require.NoError(t, err)
	tr, err := transport.New(transport.Config{DB: db.SQL, PollInterval: 20 * time.Millisecond, IdlePollInterval: testdb.NoSafetyPoll,
		Intercept: inj.Intercept, Logger: quiet, RetryInterval: 20 * time.Millisecond,
		Retry: transport.RetryPolicy{MaxAttempts: 5, InitialBackoff: 10 * time.Millisecond, MaxBackoff: 20 * time.Millisecond}})
	require.NoError(t, err)
	in, out := "in_"+uuid.NewString()[:8], "out_"+uuid.NewString()[:8]
	_, err = db.SQL.Exec(`CREATE TABLE seen (uuid text, copy text)`)
	require.NoError(t, err)
	var failed sync.Map
	r, err := tr.NewRouter()
	require.NoError(t, err)
	require.NoError(t, r.AddHandler("h", in, "", func(msg *message.Message) error {
		tx, _ := transport.TxFromContext(msg.Context())
		if err := tr.Publisher(tx).Publish(out, message.NewMessage("out-"+msg.UUID, nil)); err != nil {
			return err
		}
		if _, again := failed.LoadOrStore(msg.UUID, true); !again && msg.UUID == "rolled-back" {
			return errors.New("the publisher rolls back after the in-process delivery")
		}
		return nil
	}))
	require.NoError(t, r.AddHandler("l", out, "", func(msg *message.Message) error {
		tx, _ := transport.TxFromContext(msg.Context())
		_, err := tx.ExecContext(msg.Context(), `INSERT INTO seen VALUES ($1, $2)`, msg.UUID, msg.Metadata.Get(sagatest.CopyMetadata))
		return err
	}, transport.InProcess()))
	require.NoError(t, tr.Subscribe(context.Background(), r.Subscriptions()...))
	require.NoError(t, r.Start(context.Background()))
	t.Cleanup(func() { _ = r.Stop() })
	require.NoError(t, tr.Publisher(db.SQL).Publish(in, message.NewMessage("committed", nil), message.NewMessage("rolled-back", nil)))
	count := func(q string) int {
		var n int
		require.NoError(t, db.SQL.QueryRow(q).Scan(&n))
		return n
	}
	deadline := time.Now().Add(30 * time.Second)
	for count(`SELECT count(*) FROM pgsaga_queue`) > 0 || count(`SELECT count(DISTINCT uuid) FROM seen`) < 2 {
		require.True(t, time.Now().Before(deadline), "timed out (%+v)", inj.Stats())
		time.Sleep(20 * time.Millisecond)
	}
	require.NoError(t, r.Stop())
	require.NoError(t, inj.Close())
	assert.Equal(t, 1, count(`SELECT count(*) FROM seen WHERE uuid = 'out-committed' AND copy <> ''`), "the committed in-process message was copied")
	assert.Zero(t, count(`SELECT count(*) FROM seen WHERE uuid = 'out-rolled-back' AND copy <> ''`), "no copy of a message that was rolled back")
	assert.Equal(t, 1, count(`SELECT count(*) FROM seen WHERE uuid = 'out-rolled-back'`))
}

// A worker restarted after a kill counts its sightings of a message from
// one again; the faults it draws depend on the message's delivery attempt
// too, so a message whose first attempt crashed does not crash again, in
// every new process, on the same draw until its attempts run out.
func TestInjectorRestartedDrawsAfreshForTheNextAttempt(t *testing.T) {
	t.Parallel()
	db := testdb.Fresh(t)
	topic := "t_" + uuid.NewString()[:8]
	_, err := db.SQL.Exec(`CREATE TABLE done (uuid text PRIMARY KEY)`)
	require.NoError(t, err)
	// One "process": a fresh injector (same seed) and router. Retries wait
	// an hour, so a failed attempt is retried only by the next process.
	run := func(until func() bool) {
		inj, err := sagatest.NewInjector(db.SQL, sagatest.Faults{Seed: 11, CrashBeforeCommitRate: 0.5}, quiet)
		require.NoError(t, err)
		tr, err := transport.New(transport.Config{DB: db.SQL, PollInterval: 20 * time.Millisecond, IdlePollInterval: testdb.NoSafetyPoll,
			Intercept: inj.Intercept, Logger: quiet, Retry: transport.RetryPolicy{MaxAttempts: 2, InitialBackoff: time.Hour, MaxBackoff: time.Hour}})
		require.NoError(t, err)
		r, err := tr.NewRouter()
		require.NoError(t, err)
		require.NoError(t, r.AddHandler("h", topic, "", func(msg *message.Message) error {
			tx, _ := transport.TxFromContext(msg.Context())
			_, err := tx.ExecContext(msg.Context(), `INSERT INTO done VALUES ($1)`, msg.UUID)
			return err
		}))
		require.NoError(t, tr.Subscribe(context.Background(), r.Subscriptions()...))
		require.NoError(t, r.Start(context.Background()))
		deadline := time.Now().Add(30 * time.Second)
		for !until() {
			require.True(t, time.Now().Before(deadline), "timed out")
			time.Sleep(20 * time.Millisecond)
		}
		require.NoError(t, r.Stop())
		require.NoError(t, inj.Close())
	}
	count := func(q string) int {
		var n int
		require.NoError(t, db.SQL.QueryRow(q).Scan(&n))
		return n
	}
	const n = 20
	tr, err := transport.New(transport.Config{DB: db.SQL, Logger: quiet})
	require.NoError(t, err)
	require.NoError(t, tr.Subscribe(context.Background(), transport.Subscription{Topic: topic, ConsumerGroup: "h"}))
	var msgs []*message.Message
	for i := range n { // fixed UUIDs: the same draws every run
		msgs = append(msgs, message.NewMessage(uuid.NewSHA1(uuid.NameSpaceOID, []byte("restart-"+strconv.Itoa(i))).String(), nil))
	}
	require.NoError(t, tr.Publisher(db.SQL).Publish(topic, msgs...))
	// First process: every message gets its first attempt.
	run(func() bool { return count(`SELECT count(*) FROM pgsaga_queue WHERE attempts = 0`) == 0 })
	crashed := count(`SELECT count(*) FROM pgsaga_queue`)
	require.Positive(t, crashed, "some first attempts crashed")
	_, err = db.SQL.Exec(`UPDATE pgsaga_queue SET available_at = now()`) // their hour has passed
	require.NoError(t, err)
	// Second process: their second, last attempt.
	run(func() bool { return count(`SELECT count(*) FROM pgsaga_queue`) == 0 })
	assert.Positive(t, count(`SELECT count(*) FROM done`)-(n-crashed), "a message whose first attempt crashed succeeded on its second, in the new process")
	assert.Less(t, count(`SELECT count(*) FROM pgsaga_dead_letters`), crashed, "not every such message crashed again")
}

// Stats of several injectors add up field by field.
func TestStatsAdd(t *testing.T) {
	t.Parallel()
	a := sagatest.Stats{Attempts: 1, Retries: 2, Duplicated: 3, Copies: 4, CrashesBefore: 5, CrashesAfter: 6, ConnectionsKilled: 7, Delays: 8, Replayed: 9}
	assert.Equal(t, sagatest.Stats{Attempts: 2, Retries: 4, Duplicated: 6, Copies: 8, CrashesBefore: 10, CrashesAfter: 12, ConnectionsKilled: 14, Delays: 16, Replayed: 18}, a.Add(a))
}
