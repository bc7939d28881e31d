package saga_test

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/idempotency"
	"github.com/pgsaga/pgsaga/internal/stepsrt"
	"github.com/pgsaga/pgsaga/internal/testdb"
	"github.com/pgsaga/pgsaga/internal/testout"
	"github.com/pgsaga/pgsaga/internal/testpg"
	"github.com/pgsaga/pgsaga/internal/transport"
	"github.com/pgsaga/pgsaga/saga"
	"github.com/pgsaga/pgsaga/steps"
)

func TestMain(m *testing.M) { testpg.Main(m) }

// logger is the tests' logger (PGSAGA_TEST_LOG shows it).
var logger = testout.Logger

// The test saga: trip = book (action/cancel) then pay (action/refund).

type started struct {
	Trip string `json:"trip"`
}

func (started) MessageType() string { return "test.TripRequested" }

type tripCmd struct {
	Trip string `json:"trip"`
	Op   string `json:"op"`
}

func (tripCmd) MessageType() string { return "test.TripCommand" }

type tripReply struct {
	Op string `json:"op"`
}

func (tripReply) MessageType() string { return "test.TripReply" }

type tripData struct {
	Trip   string `json:"trip"`
	Booked string `json:"booked,omitempty"`
}

// behaviour of a participant for one op.
type behaviour int

const (
	succeed   behaviour = iota
	refuse              // business failure
	breakDown           // transient error, every time
)

type env struct {
	t      *testing.T
	db     *testdb.DB
	tr     *transport.Transport
	rt     stepsrt.Runtime
	engine *saga.Engine
	def    *saga.Definition
	router *transport.Router
	id     string
	topics map[string]string // op → topic

	mu    sync.Mutex
	plan  map[string]behaviour // op → behaviour
	calls map[string]int       // op → handler runs
}

type options struct {
	deadline      time.Duration            // of every step unless set below
	deadlines     map[string]time.Duration // per step
	compDeadlines map[string]time.Duration // of compensations, per step; default 10s
	maxAttempts   int
	silent        []string // ops whose participant takes the command and never answers
	absent        []string // ops without a participant: their commands never leave the queue
	finished      string   // the engine's FinishedChannel
	timeout       time.Duration
	panicFor      string // a trip whose commands' Build panics
	panicWith     string // what it panics with; default "a bug in Build for <trip>"
}

func (o options) compDeadlineOf(step string) time.Duration {
	if d, ok := o.compDeadlines[step]; ok {
		return d
	}
	return 10 * time.Second
}

func (o options) deadlineOf(step string) time.Duration {
	if d, ok := o.deadlines[step]; ok {
		return d
	}
	return o.deadline
}

func newEnv(t *testing.T, o options) *env {
	t.Helper()
	if o.deadline == 0 {
		o.deadline = 10 * time.Second
	}
	db := testdb.Shared(t)
	id := uuid.NewString()[:8]
	e := &env{t: t, db: db, id: id, plan: map[string]behaviour{}, calls: map[string]int{}, topics: map[string]string{}}
	for _, op := range []string{"book", "cancel", "pay", "refund"} {
		e.topics[op] = op + "_" + id
	}
	tr, err := transport.New(transport.Config{DB: db.SQL, Logger: logger(), PollInterval: 20 * time.Millisecond, IdlePollInterval: testdb.NoSafetyPoll,
		Retry: transport.RetryPolicy{MaxAttempts: 2, InitialBackoff: 5 * time.Millisecond}})
	require.NoError(t, err)
	store, err := idempotency.NewStore(idempotency.Config{DB: db.SQL})
	require.NoError(t, err)
	rt, err := stepsrt.New(stepsrt.Config{Transport: tr, Store: store, Logger: logger()})
	require.NoError(t, err)
	engine, err := saga.NewEngine(saga.Config{DB: db.SQL, Transport: tr, Logger: logger(), SweepInterval: 20 * time.Millisecond,
		FinishedChannel: o.finished})
	require.NoError(t, err)
	cmd := func(op string) *saga.Command[tripData] {
		return saga.Send(steps.Define[tripCmd](op, e.topics[op], nil), func(d tripData) tripCmd {
			if o.panicFor != "" && d.Trip == o.panicFor {
				if o.panicWith != "" {
					panic(o.panicWith)
				}
				panic("a bug in Build for " + d.Trip)
			}
			return tripCmd{Trip: d.Trip, Op: op}
		})
	}
	book := saga.OnReply(cmd("book"), func(d *tripData, reply tripReply) error {
		d.Booked = reply.Op
		return nil
	})
	def, err := saga.Define(saga.Spec[tripData]{
		Name:    "trip-" + id,
		Timeout: o.timeout,
		Trigger: saga.On("trips_"+id, func(s started) (string, tripData, error) { return s.Trip, tripData{Trip: s.Trip}, nil }),
		Steps: []saga.Step[tripData]{
			{Name: "book", Action: book, Compensation: cmd("cancel"), Deadline: o.deadlineOf("book"), MaxAttempts: o.maxAttempts,
				CompensationDeadline: o.compDeadlineOf("book")},
			{Name: "pay", Action: cmd("pay"), Compensation: cmd("refund"), Deadline: o.deadlineOf("pay"), MaxAttempts: o.maxAttempts,
				CompensationDeadline: o.compDeadlineOf("pay")},
		},
	})
	require.NoError(t, err)
	require.NoError(t, engine.Register(def))
	e.tr, e.rt, e.engine, e.def = tr, rt, engine, def
	// "archive" keeps a copy of every message of the saga for the tests.
	var archive []transport.Subscription
	for _, topic := range def.Topics() {
		archive = append(archive, transport.Subscription{Topic: topic, ConsumerGroup: "archive"})
	}
	require.NoError(t, tr.Subscribe(context.Background(), archive...))

	r, err := tr.NewRouter()
	require.NoError(t, err)
	require.NoError(t, engine.AddHandlers(r))
	silent, absent := map[string]bool{}, map[string]bool{}
	for _, op := range o.silent {
		silent[op] = true
	}
	for _, op := range o.absent {
		absent[op] = true
	}
	for op, topic := range e.topics {
		switch {
		case absent[op]:
		case silent[op]:
			// Takes every command (its queue row goes) and answers none.
			require.NoError(t, r.AddHandler("silent-"+op+"-"+id, topic, "participant-"+op+"-"+id, func(*message.Message) error {
				e.mu.Lock()
				e.calls[op]++
				e.mu.Unlock()
				return nil
			}))
		default:
			require.NoError(t, rt.Register(r, steps.Define("participant-"+op+"-"+id, topic, e.participant(op))))
		}
	}
	require.NoError(t, r.Start(context.Background()))
	t.Cleanup(func() { _ = r.Stop() })
	e.router = r
	return e
}

func (e *env) participant(op string) steps.Handler[tripCmd] {
	return func(ctx context.Context, tx *steps.Tx, cmd tripCmd) (steps.Message, error) {
		e.mu.Lock()
		e.calls[op]++
		b := e.plan[op]
		e.mu.Unlock()
		switch b {
		case refuse:
			return nil, steps.Fail(tripReply{Op: op}, op+" refused")
		case breakDown:
			return nil, fmt.Errorf("%s is broken", op)
		}
		return tripReply{Op: op}, nil
	}
}

func (e *env) set(op string, b behaviour) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.plan[op] = b
}

func (e *env) callsOf(op string) int {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.calls[op]
}

// start publishes a trigger and returns the saga's id.
func (e *env) start(trip string) uuid.UUID {
	e.t.Helper()
	msg, err := steps.NewMessage(started{Trip: trip}, steps.Envelope{CorrelationID: "corr-" + trip})
	require.NoError(e.t, err)
	require.NoError(e.t, e.tr.Publisher(e.db.SQL).Publish(e.def.Trigger, msg))
	return saga.ID(e.def.Name, trip)
}

// wait polls the instance until cond holds.
func (e *env) wait(id uuid.UUID, what string, cond func(saga.Instance) bool) saga.Instance {
	e.t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		inst, err := e.engine.Get(context.Background(), id)
		if err == nil && cond(inst) {
			return inst
		}
		if time.Now().After(deadline) {
			e.t.Fatalf("saga %s: timed out waiting for %s (last: %+v, err %v)", id, what, inst, err)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func (e *env) terminal(id uuid.UUID) saga.Instance {
	return e.wait(id, "a terminal state", func(i saga.Instance) bool { return i.Status.Terminal() })
}

func kinds(h []saga.HistoryEntry) []string {
	out := make([]string, len(h))
	for i, x := range h {
		out[i] = x.Kind
		if x.Step != "" {
			out[i] += ":" + x.Step
		}
	}
	return out
}

func TestHappyPath(t *testing.T) {
	t.Parallel()
	e := newEnv(t, options{})
	id := e.start("rome")
	inst := e.terminal(id)
	assert.Equal(t, saga.StatusCompleted, inst.Status)
	assert.Equal(t, []string{"started", "sent:book", "reply_ok:book", "sent:pay", "reply_ok:pay", "completed"}, kinds(inst.History))
	var data tripData
	require.NoError(t, json.Unmarshal(inst.Data, &data))
	assert.Equal(t, "book", data.Booked, "OnReply updated the data from the typed reply")
	assert.Equal(t, "corr-rome", inst.CorrelationID)
	assert.NotNil(t, inst.FinishedAt)
	assert.Nil(t, inst.DeadlineAt)
	assert.Equal(t, 0, e.callsOf("cancel")+e.callsOf("refund"))
}

// With a FinishedChannel, every instance that ends is announced once, when
// its last transaction commits, whether it completed or compensated.
func TestFinishedInstancesAreAnnounced(t *testing.T) {
	t.Parallel()
	channel := "finished_" + uuid.NewString()[:8]
	e := newEnv(t, options{finished: channel})
	var (
		mu    sync.Mutex
		heard = map[uuid.UUID]int{}
	)
	listening := make(chan struct{})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		done <- saga.ListenFinished(ctx, e.db.SQL, channel, func(id uuid.UUID) {
			mu.Lock()
			heard[id]++
			mu.Unlock()
		}, nil, logger())
	}()
	// Wait until the listener is in place: announce a dummy and hear it.
	go func() {
		dummy := uuid.New()
		for {
			_, _ = e.db.SQL.Exec(`SELECT pg_notify($1, $2)`, channel, dummy.String())
			mu.Lock()
			ok := heard[dummy] > 0
			mu.Unlock()
			if ok {
				close(listening)
				return
			}
			time.Sleep(10 * time.Millisecond)
		}
	}()
	<-listening
	ok := e.start("oslo")
	assert.Equal(t, saga.StatusCompleted, e.terminal(ok).Status)
	e.set("pay", refuse)
	refused := e.start("lima")
	assert.Equal(t, saga.StatusCompensated, e.terminal(refused).Status)
	deadline := time.Now().Add(10 * time.Second)
	for {
		mu.Lock()
		n := heard[ok] + heard[refused]
		mu.Unlock()
		if n == 2 {
			break
		}
		require.True(t, time.Now().Before(deadline), "not announced: %v", heard)
		time.Sleep(5 * time.Millisecond)
	}
	cancel()
	require.NoError(t, <-done)
	mu.Lock()
	defer mu.Unlock()
	assert.Equal(t, 1, heard[ok])
	assert.Equal(t, 1, heard[refused])
}

// A failure compensates the steps before it, last first.
func TestFailureCompensatesInReverse(t *testing.T) {
	t.Parallel()
	e := newEnv(t, options{})
	e.set("pay", refuse)
	inst := e.terminal(e.start("oslo"))
	assert.Equal(t, saga.StatusCompensated, inst.Status)
	assert.Equal(t, "pay: pay refused", inst.FailureReason)
	assert.Equal(t, []string{"started", "sent:book", "reply_ok:book", "sent:pay", "reply_failed:pay", "sent:book", "reply_ok:book", "compensated"}, kinds(inst.History))
	assert.Equal(t, saga.PhaseCompensation, inst.History[5].Phase)
	assert.Equal(t, 1, e.callsOf("cancel"))
	assert.Equal(t, 0, e.callsOf("refund"), "a failed step is not compensated")

	// The first step fails: nothing to compensate.
	e2 := newEnv(t, options{})
	e2.set("book", refuse)
	inst = e2.terminal(e2.start("lima"))
	assert.Equal(t, saga.StatusCompensated, inst.Status)
	assert.Equal(t, 0, e2.callsOf("cancel"))
}

// A second trigger with the same key starts nothing.
func TestDuplicateTrigger(t *testing.T) {
	t.Parallel()
	e := newEnv(t, options{})
	id := e.start("nice")
	e.start("nice")
	e.start("nice")
	e.terminal(id)
	var n int
	require.NoError(t, e.db.SQL.QueryRow(`SELECT count(*) FROM saga_instances WHERE saga_type = $1`, e.def.Name).Scan(&n))
	assert.Equal(t, 1, n)
	assert.Equal(t, 1, e.callsOf("book"))
}

// Duplicate and late replies change nothing: the instance's state, version
// and timeline stay as they were, and no command is sent.
func TestDuplicateAndLateRepliesChangeNothing(t *testing.T) {
	t.Parallel()
	e := newEnv(t, options{})
	id := e.start("bonn")
	inst := e.terminal(id)
	require.Equal(t, saga.StatusCompleted, inst.Status)

	// Replay every reply the saga received, twice, plus a reply to the
	// book step claiming failure after the saga moved on.
	rows, err := e.db.SQL.Query(`SELECT uuid, payload, metadata::text FROM `+archived(e.def.ReplyTopic)+` WHERE metadata->>'saga_id' = $1`, id.String())
	require.NoError(t, err)
	var replies []*message.Message
	for rows.Next() {
		var u, meta string
		var payload []byte
		require.NoError(t, rows.Scan(&u, &payload, &meta))
		m := message.NewMessage(u, payload)
		require.NoError(t, json.Unmarshal([]byte(meta), &m.Metadata))
		replies = append(replies, m, m.Copy())
	}
	require.NoError(t, rows.Close())
	require.Len(t, replies, 4)
	late := replies[0].Copy()
	late.UUID = uuid.NewString()
	late.Metadata.Set(steps.MetaOutcome, steps.OutcomeFailed)
	replies = append(replies, late)
	sentBefore := e.commandsSent(id)
	require.NoError(t, e.tr.Publisher(e.db.SQL).Publish(e.def.ReplyTopic, replies...))
	e.waitConsumed(e.def.ReplyTopic, "saga."+e.def.Name+".replies")

	after, err := e.engine.Get(context.Background(), id)
	require.NoError(t, err)
	assert.Equal(t, inst.Status, after.Status)
	assert.Equal(t, inst.Version, after.Version, "no update")
	assert.Equal(t, len(inst.History), len(after.History), "no timeline entry")
	assert.Equal(t, sentBefore, e.commandsSent(id), "no command")
}

// A reply for a saga nobody knows is dead-lettered with the reason.
func TestReplyForUnknownSagaIsDeadLettered(t *testing.T) {
	t.Parallel()
	e := newEnv(t, options{})
	ghost := uuid.New()
	msg, err := steps.NewMessage(tripReply{Op: "book"}, steps.Envelope{SagaID: ghost.String(), Key: "x", Outcome: steps.OutcomeOK})
	require.NoError(t, err)
	require.NoError(t, e.tr.Publisher(e.db.SQL).Publish(e.def.ReplyTopic, msg))
	var reason string
	deadline := time.Now().Add(10 * time.Second)
	for {
		err := e.db.SQL.QueryRow(`SELECT metadata->>'dead_letter_reason' FROM pgsaga_dead_letters WHERE uuid = $1`, msg.UUID).Scan(&reason)
		if err == nil {
			break
		}
		require.True(t, time.Now().Before(deadline), "not dead-lettered")
		time.Sleep(10 * time.Millisecond)
	}
	assert.Contains(t, reason, "unknown saga "+ghost.String())
}

func (e *env) commandsSent(id uuid.UUID) int {
	n := 0
	for _, topic := range e.topics {
		var c int
		require.NoError(e.t, e.db.SQL.QueryRow(`SELECT count(*) FROM `+archived(topic)+` WHERE metadata->>'saga_id' = $1`, id.String()).Scan(&c))
		n += c
	}
	return n
}

// archived is a FROM item, aliased m, holding every message published to
// topic, as the "archive" consumer group keeps them.
func archived(topic string) string {
	return `(SELECT * FROM pgsaga_queue WHERE consumer_group = 'archive' AND topic = '` + topic + `') m`
}

// sent returns the key and the reply token of the latest command of op
// the saga id sent, as archived: what a reply to it carries back.
func (e *env) sent(id uuid.UUID, op string) (key, token string) {
	e.t.Helper()
	require.NoError(e.t, e.db.SQL.QueryRow(`SELECT metadata->>$2, coalesce(metadata->>$3, '') FROM `+archived(e.topics[op])+
		` WHERE metadata->>'saga_id' = $1 ORDER BY id DESC LIMIT 1`, id.String(), steps.MetaKey, steps.MetaReplyToken).Scan(&key, &token))
	return key, token
}

func (e *env) waitConsumed(topic, group string) {
	e.t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		var waiting int
		require.NoError(e.t, e.db.SQL.QueryRow(`SELECT count(*) FROM pgsaga_queue WHERE topic = $1 AND consumer_group = $2`, topic, group).Scan(&waiting))
		if waiting == 0 {
			return
		}
		require.True(e.t, time.Now().Before(deadline), "%s not consumed", topic)
		time.Sleep(10 * time.Millisecond)
	}
}

// A participant that never answers: the command is sent again after its
// deadline, with the same key, as often as its step allows; then the
// engine waits for the answer until the command's not-after (the saga's
// timeout) and a deadline more, and only then gives up and compensates.
func TestSilentParticipantIsResentThenCompensated(t *testing.T) {
	t.Parallel()
	e := newEnv(t, options{deadlines: map[string]time.Duration{"pay": 50 * time.Millisecond}, maxAttempts: 3, silent: []string{"pay"},
		timeout: 3 * time.Second})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() { _ = e.engine.RunSweeper(ctx) }()
	inst := e.terminal(e.start("kiev"))
	assert.Equal(t, saga.StatusCompensated, inst.Status)
	assert.Equal(t, "pay: no answer by its not-after, the saga's timeout (3s)", inst.FailureReason)
	timedOut := inst.History[slices.IndexFunc(inst.History, func(h saga.HistoryEntry) bool { return h.Kind == "timed_out" })].At
	assert.False(t, timedOut.Before(inst.CreatedAt.Add(3*time.Second+50*time.Millisecond)),
		"given up on only a deadline after its not-after (%s after the start)", timedOut.Sub(inst.CreatedAt))
	var pay []string
	for _, h := range inst.History {
		// A sweep may find a command not yet taken by the participant (on
		// a busy machine): waiting costs no attempt, and is left out here.
		if h.Step == "pay" && h.Kind != "waiting" {
			pay = append(pay, h.Kind+"/"+string(h.Phase))
		}
	}
	assert.Equal(t, []string{"sent/action", "deadline/action", "resent/action", "deadline/action", "resent/action", "awaiting_reply/action",
		"timed_out/action", "sent/compensation", "reply_ok/compensation"}, pay, "pay's action may have happened: it is compensated too")
	all := kinds(inst.History)
	assert.Equal(t, []string{"sent:book", "reply_ok:book", "compensated"}, all[len(all)-3:], "then book is compensated")
	assert.Equal(t, saga.PhaseCompensation, inst.History[len(inst.History)-3].Phase)
	assert.Equal(t, 1, e.callsOf("refund"))

	var keys, ids int
	require.NoError(t, e.db.SQL.QueryRow(`SELECT count(DISTINCT metadata->>'idempotency_key'), count(DISTINCT uuid) FROM `+archived(e.topics["pay"])).Scan(&keys, &ids))
	assert.Equal(t, 1, keys, "every re-send carries the same key")
	assert.Equal(t, 3, ids, "three sends")
}

// Two sweepers race over many overdue instances: no attempt of any command
// is ever sent twice.
func TestTwoSweepersNeverDoubleSend(t *testing.T) {
	t.Parallel()
	e := newEnv(t, options{deadline: time.Millisecond, maxAttempts: 1000, silent: []string{"book"}})
	other, err := saga.NewEngine(saga.Config{DB: testdb.Open(t, e.db.URL, 4).SQL, Transport: e.tr, Logger: logger()})
	require.NoError(t, err)
	require.NoError(t, other.Register(e.def))
	var ids []uuid.UUID
	for i := range 30 {
		ids = append(ids, e.start(fmt.Sprintf("trip-%d", i)))
	}
	for _, id := range ids {
		e.wait(id, "the first command", func(i saga.Instance) bool { return i.Attempt >= 1 })
	}
	var (
		wg     sync.WaitGroup
		resent atomic.Int32
	)
	for _, eng := range []*saga.Engine{e.engine, other} {
		wg.Go(func() {
			for range 20 {
				res, err := eng.Sweep(context.Background())
				assert.NoError(t, err)
				resent.Add(int32(res.Resent))
			}
		})
	}
	wg.Wait()
	var total, distinct int
	require.NoError(t, e.db.SQL.QueryRow(`SELECT count(*), count(DISTINCT uuid) FROM `+archived(e.topics["book"])).Scan(&total, &distinct))
	assert.Equal(t, distinct, total, "no send of the same attempt twice")
	assert.Equal(t, 30+int(resent.Load()), total, "every sweep's re-send, and only those")
	var sent int
	require.NoError(t, e.db.SQL.QueryRow(`SELECT count(*) FROM saga_history h JOIN saga_instances s ON s.id = h.saga_id
		WHERE s.saga_type = $1 AND h.kind IN ('sent', 'resent')`, e.def.Name).Scan(&sent))
	assert.Equal(t, total, sent, "the timeline records each send once")
	assert.Greater(t, resent.Load(), int32(30), "both sweepers did work")
}

// A compensation that keeps failing parks the saga as failed with its
// cause; once the fault is gone, an operator retry completes it.
func TestFailingCompensationParksThenOperatorRetry(t *testing.T) {
	t.Parallel()
	// book's compensation never answers: its deadline decides when the saga
	// is parked.
	e := newEnv(t, options{compDeadlines: map[string]time.Duration{"book": 500 * time.Millisecond}, maxAttempts: 2})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() { _ = e.engine.RunSweeper(ctx) }()
	e.set("pay", refuse)
	e.set("cancel", breakDown)
	id := e.start("rio")
	inst := e.terminal(id)
	require.Equal(t, saga.StatusFailed, inst.Status, "%s: %v", inst.FailureReason, kinds(inst.History))
	assert.Equal(t, "pay: pay refused; then compensation of book got no reply after 2 attempts", inst.FailureReason)
	assert.Equal(t, "book", inst.Step)
	assert.Equal(t, saga.PhaseCompensation, inst.Phase)

	failed, err := e.engine.List(context.Background(), saga.Filter{Statuses: []saga.Status{saga.StatusFailed}, Type: e.def.Name})
	require.NoError(t, err)
	require.Len(t, failed, 1)
	assert.Equal(t, id, failed[0].ID)

	// The fault is gone; the sweeper stops so that the retry's outcome does
	// not race its deadline on a loaded machine.
	cancel()
	e.set("cancel", succeed)
	require.NoError(t, e.engine.Retry(context.Background(), id))
	inst = e.terminal(id)
	assert.Equal(t, saga.StatusCompensated, inst.Status)
	assert.Equal(t, "pay: pay refused", inst.FailureReason)
	assert.Equal(t, 1, inst.Generation)
	assert.Contains(t, kinds(inst.History), "retried:book")
	require.ErrorIs(t, e.engine.Retry(context.Background(), id), saga.ErrNotRetryable)
}

// A compensation refused as a business failure parks the saga at once; a
// retry under a fresh key runs it again.
func TestRefusedCompensationRetriedUnderFreshKey(t *testing.T) {
	t.Parallel()
	e := newEnv(t, options{})
	e.set("pay", refuse)
	e.set("cancel", refuse)
	id := e.start("cork")
	inst := e.terminal(id)
	require.Equal(t, saga.StatusFailed, inst.Status)
	assert.Equal(t, "pay: pay refused; then compensation of book failed: cancel refused", inst.FailureReason)
	e.set("cancel", succeed)
	require.NoError(t, e.engine.Retry(context.Background(), id))
	inst = e.terminal(id)
	assert.Equal(t, saga.StatusCompensated, inst.Status)
	assert.Equal(t, 2, e.callsOf("cancel"), "the fresh key ran the compensation again")
}

// Instances of a definition version this process does not know are reported
// and left alone, never dropped.
func TestUnknownDefinitionVersionIsReported(t *testing.T) {
	t.Parallel()
	e := newEnv(t, options{silent: []string{"book"}})
	id := e.start("faro")
	e.wait(id, "the first command", func(i saga.Instance) bool { return i.Attempt >= 1 })
	_, err := e.db.SQL.Exec(`UPDATE saga_instances SET definition_version = 99, deadline_at = now() - interval '1 hour' WHERE id = $1`, id)
	require.NoError(t, err)
	unknown, err := e.engine.UnknownDefinitions(context.Background())
	require.NoError(t, err)
	assert.Contains(t, unknown, saga.UnknownDefinition{Name: e.def.Name, Version: 99, Instances: 1})
	res, err := e.engine.Sweep(context.Background())
	require.NoError(t, err)
	assert.Zero(t, res.Resent+res.GaveUp+res.Parked, "the sweeper leaves it alone")
	inst, err := e.engine.Get(context.Background(), id)
	require.NoError(t, err)
	assert.Equal(t, saga.StatusRunning, inst.Status)
	assert.Equal(t, "book", inst.Step, "the definition is unknown: the step is named as its timeline named it")
	_, err = e.db.SQL.Exec(`DELETE FROM saga_history WHERE saga_id = $1`, id)
	require.NoError(t, err)
	inst, err = e.engine.Get(context.Background(), id)
	require.NoError(t, err)
	assert.Equal(t, "#0", inst.Step, "no definition and no timeline: the step is named by its index")
	require.ErrorIs(t, e.engine.Retry(context.Background(), id), saga.ErrUnknownDefinition)
}

func TestDefineValidates(t *testing.T) {
	t.Parallel()
	trigger := saga.On("t", func(started) (string, tripData, error) { return "k", tripData{}, nil })
	build := func(tripData) tripCmd { return tripCmd{} }
	cmd := saga.Send(steps.Define[tripCmd]("c", "c", nil), build)
	for name, spec := range map[string]saga.Spec[tripData]{
		"no name":         {Trigger: trigger, Steps: []saga.Step[tripData]{{Name: "a", Action: cmd}}},
		"no steps":        {Name: "s", Trigger: trigger},
		"no start":        {Name: "s", Trigger: saga.On[started, tripData]("t", nil), Steps: []saga.Step[tripData]{{Name: "a", Action: cmd}}},
		"no trigger":      {Name: "s", Steps: []saga.Step[tripData]{{Name: "a", Action: cmd}}},
		"duplicate steps": {Name: "s", Trigger: trigger, Steps: []saga.Step[tripData]{{Name: "a", Action: cmd}, {Name: "a", Action: cmd}}},
		"no action":       {Name: "s", Trigger: trigger, Steps: []saga.Step[tripData]{{Name: "a", Compensation: cmd}}},
		"bad topic":       {Name: "s", Trigger: trigger, Steps: []saga.Step[tripData]{{Name: "a", Action: saga.Send(steps.Define[tripCmd]("c", "bad topic", nil), build)}}},
		"no build":        {Name: "s", Trigger: trigger, Steps: []saga.Step[tripData]{{Name: "a", Action: saga.Send[tripData](steps.Define[tripCmd]("c", "c", nil), nil)}}},
		"no step":         {Name: "s", Trigger: trigger, Steps: []saga.Step[tripData]{{Name: "a", Action: saga.Send(steps.Step[tripCmd]{}, build)}}},
		"reply of no command": {Name: "s", Trigger: trigger, Steps: []saga.Step[tripData]{{Name: "a",
			Action: saga.OnReply(nil, func(*tripData, tripReply) error { return nil })}}},
		"reply with no update": {Name: "s", Trigger: trigger, Steps: []saga.Step[tripData]{{Name: "a",
			Action: saga.OnReply[tripData, tripReply](saga.Send(steps.Define[tripCmd]("c", "c", nil), build), nil)}}},
	} {
		_, err := saga.Define(spec)
		require.Error(t, err, name)
	}
}

// While pay is in flight, book's reply arrives again (a duplicate, or a late
// answer to a re-send): it is not the reply the saga waits for, so nothing
// changes; in particular it does not complete the pay step.
func TestEarlierStepReplyWhileLaterStepInFlight(t *testing.T) {
	t.Parallel()
	e := newEnv(t, options{silent: []string{"pay"}})
	id := e.start("graz")
	inst := e.wait(id, "pay in flight", func(i saga.Instance) bool { return i.Step == "pay" && i.Attempt == 1 })
	var u, meta string
	var payload []byte
	require.NoError(t, e.db.SQL.QueryRow(`SELECT uuid, payload, metadata::text FROM `+archived(e.def.ReplyTopic)+
		` WHERE metadata->>'saga_id' = $1 AND metadata->>'step' = 'book'`, id.String()).Scan(&u, &payload, &meta))
	reply := message.NewMessage(u, payload)
	require.NoError(t, json.Unmarshal([]byte(meta), &reply.Metadata))
	require.NoError(t, e.tr.Publisher(e.db.SQL).Publish(e.def.ReplyTopic, reply, reply.Copy()))
	e.waitConsumed(e.def.ReplyTopic, "saga."+e.def.Name+".replies")
	after, err := e.engine.Get(context.Background(), id)
	require.NoError(t, err)
	assert.Equal(t, saga.StatusRunning, after.Status)
	assert.Equal(t, "pay", after.Step)
	assert.Equal(t, inst.Version, after.Version)
}

// A reply that is not for the command in flight takes no lock on the
// instance, so a batch that handled one and is still open does not hold
// up another consumer's batch holding the reply the saga waits for. (It
// did: copies of one reply, claimed by concurrent batches, waited for each
// other's commits and deadlocked, and under load the reply queue backed up
// until a compensation's reply outlived its five deadlines and the saga
// was parked as failed.)
func TestStaleReplyDoesNotHoldUpTheReplyInFlight(t *testing.T) {
	t.Parallel()
	e := newEnv(t, options{silent: []string{"pay"}})
	id := e.start("linz")
	e.wait(id, "pay in flight", func(i saga.Instance) bool { return i.Step == "pay" && i.Attempt == 1 })
	var u, meta string
	var payload []byte
	require.NoError(t, e.db.SQL.QueryRow(`SELECT uuid, payload, metadata::text FROM `+archived(e.def.ReplyTopic)+
		` WHERE metadata->>'saga_id' = $1 AND metadata->>'step' = 'book'`, id.String()).Scan(&u, &payload, &meta))
	stale := message.NewMessage(u, payload) // book's reply again
	require.NoError(t, json.Unmarshal([]byte(meta), &stale.Metadata))
	payKey, token := e.sent(id, "pay")
	answer, err := steps.NewMessage(tripReply{Op: "pay"}, steps.Envelope{SagaID: id.String(), Step: "pay", Key: payKey, Outcome: steps.OutcomeOK,
		ReplyToken: token})
	require.NoError(t, err)

	ctx := context.Background()
	// One consumer's batch has handled the stale reply and is still open.
	busy, err := e.db.SQL.BeginTx(ctx, nil)
	require.NoError(t, err)
	defer busy.Rollback() //nolint:errcheck // the batch never commits here
	stale.SetContext(transport.ContextWithTx(ctx, busy))
	require.NoError(t, e.engine.HandleReply(stale))

	// Another consumer's batch applies the reply in flight meanwhile.
	other, err := e.db.SQL.BeginTx(ctx, nil)
	require.NoError(t, err)
	defer other.Rollback() //nolint:errcheck // no-op after Commit
	_, err = other.ExecContext(ctx, `SET LOCAL lock_timeout = '2s'`)
	require.NoError(t, err)
	answer.SetContext(transport.ContextWithTx(ctx, other))
	require.NoError(t, e.engine.HandleReply(answer), "the reply in flight waited for the batch of a stale reply")
	require.NoError(t, other.Commit())
	assert.Equal(t, saga.StatusCompleted, e.terminal(id).Status)
}

// An instance whose command cannot be built is parked with the cause; it
// does not stop the sweeper from handling the others.
func TestBrokenInstanceDoesNotBlockTheSweeper(t *testing.T) {
	t.Parallel()
	e := newEnv(t, options{deadlines: map[string]time.Duration{"pay": 50 * time.Millisecond}, maxAttempts: 2, silent: []string{"pay"},
		timeout: 2 * time.Second})
	broken := uuid.New()
	_, err := e.db.SQL.Exec(`INSERT INTO saga_instances (id, saga_type, definition_version, status, data, current_step, phase, attempt, deadline_at)
		VALUES ($1, $2, 1, 'running', '{"trip": 5}', 1, 'action', 1, now() - interval '1 hour')`, broken, e.def.Name)
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() { _ = e.engine.RunSweeper(ctx) }()
	good := e.terminal(e.start("bern"))
	assert.Equal(t, saga.StatusCompensated, good.Status, "the healthy saga was swept on time")
	parked := e.terminal(broken)
	assert.Equal(t, saga.StatusFailed, parked.Status)
	assert.Contains(t, parked.FailureReason, "cannot send the action of pay")
}

// Pruning deletes the timelines, then the instances, of sagas that
// completed or compensated long enough ago; failed sagas and recent ones
// stay.
func TestPruneFinishedSagas(t *testing.T) {
	t.Parallel()
	e := newEnv(t, options{})
	done := e.start("old-done")
	assert.Equal(t, saga.StatusCompleted, e.terminal(done).Status)
	e.set("pay", refuse)
	undone := e.start("old-undone")
	assert.Equal(t, saga.StatusCompensated, e.terminal(undone).Status)
	e.set("pay", succeed)
	recent := e.start("recent")
	assert.Equal(t, saga.StatusCompleted, e.terminal(recent).Status)
	failed := uuid.New()
	_, err := e.db.SQL.Exec(`INSERT INTO saga_instances (id, saga_type, definition_version, status, data, current_step, finished_at)
		VALUES ($1, $2, 1, 'failed', '{}', 0, clock_timestamp() - interval '2 days')`, failed, e.def.Name)
	require.NoError(t, err)
	_, err = e.db.SQL.Exec(`UPDATE saga_instances SET finished_at = finished_at - interval '2 days' WHERE id = ANY ($1::uuid[])`,
		[]string{done.String(), undone.String()})
	require.NoError(t, err)
	historyOf := func(id uuid.UUID) int {
		var n int
		require.NoError(t, e.db.SQL.QueryRow(`SELECT count(*) FROM saga_history WHERE saga_id = $1`, id).Scan(&n))
		return n
	}
	doneHistory := historyOf(done)
	require.Positive(t, doneHistory)

	res, err := e.engine.Prune(context.Background(), saga.PruneConfig{History: 24 * time.Hour, BatchSize: 2})
	require.NoError(t, err)
	assert.GreaterOrEqual(t, res.HistoryEntries, doneHistory)
	assert.Zero(t, historyOf(done))
	assert.Zero(t, historyOf(undone))
	assert.Positive(t, historyOf(recent), "recent timelines stay")
	assert.Zero(t, res.Instances)
	_, err = e.engine.Get(context.Background(), done)
	require.NoError(t, err, "the instance stays")

	res, err = e.engine.Prune(context.Background(), saga.PruneConfig{Instances: 24 * time.Hour})
	require.NoError(t, err)
	_, err = e.engine.Get(context.Background(), done)
	assert.ErrorIs(t, err, saga.ErrNoSuchSaga)
	_, err = e.engine.Get(context.Background(), undone)
	assert.ErrorIs(t, err, saga.ErrNoSuchSaga)
	_, err = e.engine.Get(context.Background(), recent)
	assert.NoError(t, err)
	_, err = e.engine.Get(context.Background(), failed)
	assert.NoError(t, err, "failed sagas wait for an operator")
	assert.GreaterOrEqual(t, res.Instances, 2)

	_, err = e.engine.Prune(context.Background(), saga.PruneConfig{History: -time.Second})
	assert.Error(t, err)
}

// A step's successful reply of another type than its OnReply reads does
// not move the saga on: it fails as a permanent error (the reply is
// dead-lettered, saying why) and the instance stays where it was.
func TestAReplyOfAnotherTypeIsNotApplied(t *testing.T) {
	t.Parallel()
	e := newEnv(t, options{silent: []string{"book"}})
	id := e.start("graz")
	inst := e.wait(id, "book in flight", func(i saga.Instance) bool { return i.Step == "book" && i.Attempt == 1 })
	bookKey, token := e.sent(id, "book")
	answer, err := steps.NewMessage(steps.DoneReply{}, steps.Envelope{SagaID: id.String(), Step: "book", Key: bookKey, Outcome: steps.OutcomeOK,
		ReplyToken: token})
	require.NoError(t, err)
	ctx := context.Background()
	tx, err := e.db.SQL.BeginTx(ctx, nil)
	require.NoError(t, err)
	defer tx.Rollback() //nolint:errcheck
	answer.SetContext(transport.ContextWithTx(ctx, tx))
	err = e.engine.HandleReply(answer)
	require.Error(t, err)
	assert.True(t, transport.IsPermanent(err), "dead-lettered at once: %v", err)
	assert.Contains(t, err.Error(), "reading reply")
	assert.Contains(t, err.Error(), "test.TripReply")
	require.NoError(t, tx.Commit())
	after, err := e.engine.Get(ctx, id)
	require.NoError(t, err)
	assert.Equal(t, "book", after.Step)
	assert.Equal(t, inst.Version, after.Version)
}
