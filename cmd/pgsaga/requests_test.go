package main

import (
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/internal/testdb"
	"github.com/pgsaga/pgsaga/saga"
	"github.com/pgsaga/pgsaga/steps"
	"github.com/pgsaga/pgsaga/steps/transport"
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
	client, err := saga.NewClientFromDB(db.SQL, saga.ClientConfig{Logger: slog.New(slog.NewTextHandler(io.Discard, nil)),
		Transport: transport.Config{IdlePollInterval: testdb.NoSafetyPoll}})
	require.NoError(t, err)
	undo := steps.Define("jobs.undo", "jobs.undo", func(ctx context.Context, tx *steps.Tx, cmd jobCmd) (steps.Message, error) {
		if refuseUndo.Load() {
			return nil, steps.Fail(jobDone{}, "undo refused")
		}
		return jobDone{}, nil
	})
	def := saga.MustDefine(saga.Spec[jobStarted]{
		Name: "job",
		Trigger: saga.Trigger[jobStarted]{Topic: "jobs.start", Start: func(msg *message.Message) (string, jobStarted, error) {
			j, err := steps.Decode[jobStarted](msg)
			return j.Job, j, err
		}},
		Steps: []saga.Step[jobStarted]{{Name: "work",
			Action:       &saga.Command[jobStarted]{Topic: "jobs.work", Build: func(j jobStarted) steps.Message { return jobCmd(j) }},
			Compensation: &saga.Command[jobStarted]{Topic: undo.Topic, Build: func(j jobStarted) steps.Message { return jobCmd(j) }},
			Deadline:     time.Hour, CompensationDeadline: time.Hour}},
	})
	require.NoError(t, client.Register(def))
	require.NoError(t, client.AddSteps(undo))
	require.NoError(t, client.Start(context.Background()))
	t.Cleanup(func() { _ = client.Stop() })
	return client, func(job string) uuid.UUID {
		msg, err := steps.NewMessage(jobStarted{Job: job}, steps.Envelope{})
		require.NoError(t, err)
		require.NoError(t, client.Transport().Publisher(client.DB()).Publish("jobs.start", msg))
		id := saga.ID("job", job)
		waitStatus(t, client, id, saga.StatusRunning)
		return id
	}
}

func waitStatus(t *testing.T, client *saga.Client, id uuid.UUID, want saga.Status) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		in, err := saga.NewInspector(client.DB()).Get(context.Background(), id)
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
	require.NoError(t, client.Stop())
	code, out, errOut = pgsaga(t, "cancel", running.String(), "--no-wait")
	require.Equal(t, exitOK, code, errOut)
	assert.Contains(t, out, "a worker carries it out")
	code, _, errOut = pgsaga(t, "cancel", running.String(), "--timeout", "300ms")
	assert.Equal(t, exitFailed, code)
	assert.Contains(t, errOut, "no worker carried out the cancel of "+running.String())
	var pending int
	require.NoError(t, sqlDB(t).QueryRow(`SELECT count(*) FROM saga_requests WHERE saga_id = $1 AND done_at IS NULL`, running).Scan(&pending))
	assert.Equal(t, 1, pending, "asking twice for the saga as it is is one request")
}
