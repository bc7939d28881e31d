package main

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/internal/testdb"
	"github.com/pgsaga/pgsaga/internal/transport"
	"github.com/pgsaga/pgsaga/saga"
	"github.com/pgsaga/pgsaga/steps"
)

type jobStarted struct {
	Job string `json:"job"`
}

func (jobStarted) MessageType() string { return "clitest.JobStarted" }

type jobCmd struct {
	Job string `json:"job"`
}

func (jobCmd) MessageType() string { return "clitest.JobCmd" }

type jobDone struct{}

func (jobDone) MessageType() string { return "clitest.JobDone" }

// A saga of one step whose action never answers (its topic has no
// participant) and whose compensation refuses while refuseUndo is set: a
// saga that stays running until cancelled, and parks when its cancel's
// compensation is refused.
func jobSaga(t *testing.T, refuseUndo *atomic.Bool) (client *saga.Client, start func(job string) uuid.UUID) {
	t.Helper()
	db := testdb.Fresh(t)
	t.Setenv("DATABASE_URL", db.URL)
	return jobSagaOn(t, db, refuseUndo)
}

// jobSagaOn is jobSaga on db.
func jobSagaOn(t *testing.T, db *testdb.DB, refuseUndo *atomic.Bool) (client *saga.Client, start func(job string) uuid.UUID) {
	t.Helper()
	return jobSagaVersion(t, db, refuseUndo, 1, nil)
}

// jobSagaVersion is jobSagaOn with version of the saga's definition, the
// only one the client knows, and the engine's retry policy (nil: the
// default).
func jobSagaVersion(t *testing.T, db *testdb.DB, refuseUndo *atomic.Bool, version int, retry *transport.RetryPolicy) (client *saga.Client, start func(job string) uuid.UUID) {
	t.Helper()
	client, err := saga.NewClientFromDB(db.SQL, saga.ClientConfig{Logger: slog.New(slog.NewTextHandler(io.Discard, nil)),
		Transport: transport.Config{IdlePollInterval: testdb.NoSafetyPoll}, Retry: retry})
	require.NoError(t, err)
	undo := steps.Define("jobs.undo", "jobs.undo", func(ctx context.Context, tx *steps.Tx, cmd jobCmd) (steps.Message, error) {
		if refuseUndo.Load() {
			return nil, steps.Fail(jobDone{}, "undo refused")
		}
		return jobDone{}, nil
	})
	def := saga.MustDefine(saga.Spec[jobStarted]{
		Name:    "job",
		Version: version,
		Trigger: saga.On("jobs.start", func(j jobStarted) (string, jobStarted, error) { return j.Job, j, nil }),
		Steps: []saga.Step[jobStarted]{{Name: "work",
			Action:       saga.Send(steps.Define[jobCmd]("jobs.work", "jobs.work", nil), func(j jobStarted) jobCmd { return jobCmd(j) }),
			Compensation: saga.Send(undo, func(j jobStarted) jobCmd { return jobCmd(j) }),
			Deadline:     time.Hour, CompensationDeadline: time.Hour}},
	})
	require.NoError(t, client.Register(def))
	require.NoError(t, client.AddSteps(undo))
	require.NoError(t, client.Start(context.Background()))
	t.Cleanup(func() { _ = client.Stop(context.Background()) })
	return client, func(job string) uuid.UUID {
		msg, err := steps.NewMessage(jobStarted{Job: job}, steps.Envelope{})
		require.NoError(t, err)
		require.NoError(t, client.PublishTx(context.Background(), client.DB(), "jobs.start", msg))
		id := saga.ID("job", job)
		waitStatus(t, client, id, saga.StatusRunning)
		return id
	}
}

func waitStatus(t *testing.T, client *saga.Client, id uuid.UUID, want saga.Status) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		in, err := client.Get(context.Background(), id)
		if err == nil && in.Status == want {
			return
		}
		require.True(t, time.Now().Before(deadline), "saga %s never %s (last %s, %v)", id, want, in.Status, err)
		time.Sleep(10 * time.Millisecond)
	}
}

// cancel and retry, carried out by the workers that know the saga: cancel
// compensates a running saga; a refused compensation parks it; retry,
// once the cause is fixed, compensates it; what the saga is in no state
// for is refused (exit 1), and so is an unknown saga; a bad id is a usage
// error.
func TestCancelAndRetryCarriedOutByTheWorkers(t *testing.T) {
	var refuseUndo atomic.Bool
	refuseUndo.Store(true)
	client, start := jobSaga(t, &refuseUndo)
	id := start("j1")

	code, out, errOut := pgsaga(t, "cancel", id.String(), "--reason", "wrong customer")
	require.Equal(t, exitOK, code, errOut)
	assert.Contains(t, out, "cancel of "+id.String()+" done")
	waitStatus(t, client, id, saga.StatusFailed)
	code, out, _ = pgsaga(t, "show", id.String())
	require.Equal(t, exitOK, code)
	assert.Contains(t, out, "cancelled by an operator: wrong customer")

	refuseUndo.Store(false)
	code, out, errOut = pgsaga(t, "retry", id.String(), "--json")
	require.Equal(t, exitOK, code, errOut)
	var r requestJSON
	require.NoError(t, json.Unmarshal([]byte(out), &r))
	assert.Equal(t, "done", r.Outcome)
	assert.Equal(t, "retry", r.Kind)
	waitStatus(t, client, id, saga.StatusCompensated)

	code, _, errOut = pgsaga(t, "retry", id.String())
	assert.Equal(t, exitFailed, code)
	assert.Contains(t, errOut, "refused")
	code, _, errOut = pgsaga(t, "cancel", uuid.NewString())
	assert.Equal(t, exitFailed, code)
	assert.Contains(t, errOut, "not found")
	for _, args := range [][]string{{"retry", "x"}, {"cancel"}, {"retry", id.String(), "--timeout", "0s"}, {"retry", id.String(), "--reason", "r"}} {
		code, _, errOut = pgsaga(t, args...)
		assert.Equal(t, exitUsage, code, "%v: %s", args, errOut)
	}

	// With no worker running, the request is recorded and waits for one.
	running := start("j2")
	require.NoError(t, client.Stop(context.Background()))
	code, out, errOut = pgsaga(t, "cancel", running.String(), "--no-wait")
	require.Equal(t, exitOK, code, errOut)
	assert.Contains(t, out, "a worker carries it out")
	code, _, errOut = pgsaga(t, "cancel", running.String(), "--timeout", "300ms")
	assert.Equal(t, exitFailed, code)
	assert.Contains(t, errOut, "no worker carried out the cancel of "+running.String())
	var pending int
	require.NoError(t, sqlDB(t).QueryRow(`SELECT count(*) FROM saga_requests WHERE saga_id = $1 AND done_at IS NULL`, running).Scan(&pending))
	assert.Equal(t, 1, pending, "asking twice for the saga as it is is one request")
	var queued int
	require.NoError(t, sqlDB(t).QueryRow(`SELECT count(*) FROM pgsaga_queue WHERE topic = $1`, saga.RequestTopic("job")).Scan(&queued))
	assert.Equal(t, 1, queued, "a request still queued is not published again")
}

// A request that only a worker of another definition version sees is
// handed back, not dead-lettered: it waits, and a worker that knows the
// saga carries it out without being asked again. A request whose message
// was dead-lettered all the same (here moved there by hand, as a poisoned
// queue or an operator would) is reported so as soon as it is, and
// published again when asked again.
func TestARequestDeadLetteredIsCarriedOutWhenAskedAgain(t *testing.T) {
	var refuseUndo atomic.Bool
	db := testdb.Fresh(t)
	t.Setenv("DATABASE_URL", db.URL)
	v1, start := jobSagaOn(t, db, &refuseUndo)
	id := start("j1")
	other := start("j2")
	require.NoError(t, v1.Stop(context.Background()))

	v2, _ := jobSagaVersion(t, db, &refuseUndo, 2, &transport.RetryPolicy{MaxAttempts: 1})
	code, _, errOut := pgsaga(t, "cancel", other.String(), "--reason", "first", "--timeout", "1s")
	require.Equal(t, exitFailed, code, errOut)
	assert.Contains(t, errOut, "no worker carried out the cancel of "+other.String())
	var dead int
	require.NoError(t, db.SQL.QueryRow(`SELECT count(*) FROM pgsaga_dead_letters WHERE topic = $1`, saga.RequestTopic("job")).Scan(&dead))
	assert.Zero(t, dead, "a worker that does not know version 1 hands the request back")

	code, _, errOut = pgsaga(t, "cancel", id.String(), "--no-wait")
	require.Equal(t, exitOK, code, errOut)
	// Asked again, the same request is waited for; once the command says
	// it waits, its message is dead-lettered under it.
	waiting := &signalWriter{on: "waiting for a worker", seen: make(chan struct{})}
	type result struct {
		code   int
		errOut string
	}
	done := make(chan result, 1)
	go func() {
		var out bytes.Buffer
		code := run(context.Background(), []string{"cancel", id.String(), "--timeout", "30s"}, &out, waiting)
		done <- result{code, waiting.String()}
	}()
	select {
	case <-waiting.seen:
	case r := <-done:
		t.Fatalf("cancel ended before it waited: %d %s", r.code, r.errOut)
	}
	res, err := db.SQL.Exec(`WITH moved AS (
		DELETE FROM pgsaga_queue WHERE topic = $1 AND uuid IN (SELECT r.id::text FROM saga_requests r WHERE r.saga_id = $2) RETURNING *)
		INSERT INTO pgsaga_dead_letters (uuid, topic, consumer_group, handler, payload, metadata, reason, attempts, created_at)
		SELECT uuid, topic, consumer_group, 'test', payload, metadata, 'moved by the test', attempts, created_at FROM moved`, saga.RequestTopic("job"), id)
	require.NoError(t, err)
	moved, err := res.RowsAffected()
	require.NoError(t, err)
	require.EqualValues(t, 1, moved)
	r := <-done
	require.Equal(t, exitFailed, r.code, r.errOut)
	assert.Contains(t, r.errOut, "was dead-lettered", "said as soon as it is, not after --timeout")
	assert.Contains(t, r.errOut, "ask again")
	require.NoError(t, v2.Stop(context.Background()))

	v1, _ = jobSagaOn(t, db, &refuseUndo)
	waitStatus(t, v1, other, saga.StatusCompensated)
	code, out, errOut := pgsaga(t, "cancel", id.String(), "--timeout", "20s")
	require.Equal(t, exitOK, code, errOut)
	assert.Contains(t, out, "cancel of "+id.String()+" done")
	waitStatus(t, v1, id, saga.StatusCompensated)
	var requests int
	require.NoError(t, db.SQL.QueryRow(`SELECT count(*) FROM saga_requests WHERE saga_id = $1`, id).Scan(&requests))
	assert.Equal(t, 1, requests, "asked twice, one request, carried out once")
}

// retry and cancel of every saga --status, --saga and --older-than select:
// without --yes they say how many they would ask (exit 2); with it they ask
// each, wait, and report how each ended: done, refused (the reasons
// grouped; exit 1), or not carried out in time (exit 1). Sagas the flags
// do not select are left alone.
func TestBulkRetryAndCancel(t *testing.T) {
	var refuseUndo atomic.Bool
	refuseUndo.Store(true)
	client, start := jobSaga(t, &refuseUndo)
	ids := []uuid.UUID{start("b1"), start("b2"), start("b3")}
	requestsOf := func(id uuid.UUID) int {
		var n int
		require.NoError(t, sqlDB(t).QueryRow(`SELECT count(*) FROM saga_requests WHERE saga_id = $1`, id).Scan(&n))
		return n
	}

	code, _, errOut := pgsaga(t, "cancel", "--status", "running", "--saga", "job")
	require.Equal(t, exitUsage, code, errOut)
	assert.Contains(t, errOut, "3 sagas")
	assert.Contains(t, errOut, "--yes")
	assert.Zero(t, requestsOf(ids[0]), "nothing asked without --yes")

	code, out, errOut := pgsaga(t, "cancel", "--status", "running", "--saga", "other", "--yes")
	require.Equal(t, exitOK, code, errOut)
	assert.Contains(t, out, "no saga matches", "the name selects")

	progressEvery, askBatch = 0, 2 // every line of progress; two batches
	t.Cleanup(func() { progressEvery, askBatch = time.Second, 100 })
	code, out, errOut = pgsaga(t, "cancel", "--status", "running", "--saga", "job", "--reason", "bulk", "--yes", "--json")
	require.Equal(t, exitOK, code, errOut)
	assert.Contains(t, errOut, "asked 3 of 3", "progress on stderr")
	var bulk map[string]any
	require.NoError(t, json.Unmarshal([]byte(out), &bulk))
	assert.EqualValues(t, 3, bulk["asked"])
	assert.EqualValues(t, 3, bulk["done"])
	assert.EqualValues(t, 0, bulk["refused"])
	assert.EqualValues(t, 0, bulk["pending"])
	assert.Len(t, bulk["requests"], 3)
	for _, id := range ids {
		waitStatus(t, client, id, saga.StatusFailed) // the undo was refused: parked
	}
	progressEvery, askBatch = time.Second, 100

	other := start("b4")
	refuseUndo.Store(false)
	code, out, errOut = pgsaga(t, "retry", "--status", "failed", "--yes")
	require.Equal(t, exitOK, code, errOut)
	assert.Contains(t, out, "retry asked of 3 sagas: 3 done")
	for _, id := range ids {
		waitStatus(t, client, id, saga.StatusCompensated)
	}
	assert.Zero(t, requestsOf(other), "a running saga is not asked for with --status failed")

	code, out, errOut = pgsaga(t, "retry", "--status", "compensated", "--older-than", "0s", "--yes")
	assert.Equal(t, exitFailed, code, errOut)
	assert.Contains(t, out, "3 refused")
	assert.Equal(t, 1, strings.Count(out, "cannot be retried"), "one group of refusals: %s", out)

	code, out, errOut = pgsaga(t, "retry", "--status", "compensated", "--older-than", "1h", "--yes")
	require.Equal(t, exitOK, code, errOut)
	assert.Contains(t, out, "no saga matches")

	last := start("b5")
	require.NoError(t, client.Stop(context.Background()))
	code, out, errOut = pgsaga(t, "cancel", "--status", "running", "--yes", "--no-wait")
	require.Equal(t, exitOK, code, errOut)
	assert.Contains(t, out, "cancel asked of 2 sagas")
	code, out, errOut = pgsaga(t, "cancel", "--status", "running", "--yes", "--timeout", "200ms")
	assert.Equal(t, exitFailed, code, errOut)
	assert.Contains(t, out, "2 not carried out within 200ms")
	assert.Equal(t, 1, requestsOf(last), "asking again while the request waits is the same request")

	for _, args := range [][]string{
		{"retry"}, {"cancel", "--yes"}, {"retry", last.String(), "--status", "failed"}, {"retry", "--status", "bogus", "--yes"},
		{"cancel", "--older-than", "-1s", "--yes"},
	} {
		code, _, errOut = pgsaga(t, args...)
		assert.Equal(t, exitUsage, code, "%v: %s", args, errOut)
	}
}

// signalWriter closes seen the first time what is written to it holds on.
type signalWriter struct {
	mu   sync.Mutex
	buf  bytes.Buffer
	on   string
	seen chan struct{}
}

func (w *signalWriter) String() string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.buf.String()
}

func (w *signalWriter) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	had := strings.Contains(w.buf.String(), w.on)
	w.buf.Write(p)
	if !had && strings.Contains(w.buf.String(), w.on) {
		close(w.seen)
	}
	return len(p), nil
}
