package sagatest_test

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/saga"
	"github.com/pgsaga/pgsaga/saga/delivery"
	"github.com/pgsaga/pgsaga/saga/sagatest"
	"github.com/pgsaga/pgsaga/steps"
)

type reserveSeat struct {
	Seat string `json:"seat"`
}

func (reserveSeat) MessageType() string { return "test.ReserveSeat" }

type seatReserved struct {
	Seat string `json:"seat"`
}

func (seatReserved) MessageType() string { return "test.SeatReserved" }

// seatStep reserves a seat (a row of kit_notes, id = len(seat)) and
// answers; "taken" is refused, "flaky" fails transiently, "broken"
// permanently. calls counts its runs.
func seatStep(calls *atomic.Int32) steps.Step[reserveSeat] {
	return steps.Define("seats.reserve", "seats.reserve", func(ctx context.Context, tx *steps.Tx, cmd reserveSeat) (steps.Message, error) {
		calls.Add(1)
		if _, err := tx.ExecContext(ctx, `INSERT INTO kit_notes VALUES ($1)`, len(cmd.Seat)); err != nil {
			return nil, err
		}
		switch cmd.Seat {
		case "taken":
			return nil, steps.Fail(nil, "the seat is taken")
		case "flaky":
			return nil, errors.New("the seat map is busy")
		case "broken":
			return nil, steps.Permanent(errors.New("no such seat"))
		}
		return seatReserved(cmd), nil
	})
}

func unitClient(t *testing.T) (*saga.Client, *sagatest.Database) {
	t.Helper()
	db := sagatest.DB(t)
	client, err := saga.NewClientFromDB(db.SQL, saga.ClientConfig{Logger: quiet})
	require.NoError(t, err)
	return client, db
}

func count(t *testing.T, q delivery.DBTX, query string) int {
	t.Helper()
	var n int
	require.NoError(t, q.QueryRowContext(context.Background(), query).Scan(&n))
	return n
}

// A step that answers: its reply and its writes are there in its
// transaction, and nothing of it stays.
func TestStepRunsOnceAndLeavesNothing(t *testing.T) {
	t.Parallel()
	client, db := unitClient(t)
	var calls atomic.Int32
	res := sagatest.Step(t, client, seatStep(&calls), reserveSeat{Seat: "12A"}, func(tx delivery.DBTX) error {
		assert.Equal(t, 1, count(t, tx, `SELECT count(*) FROM kit_notes WHERE id = 3`), "the step's write, seen in its transaction")
		assert.Equal(t, 1, count(t, tx, `SELECT count(*) FROM idempotency_keys WHERE scope = 'seats.reserve' AND status = 'completed'`),
			"the key is stored completed")
		return nil
	})
	require.NoError(t, res.Err)
	assert.False(t, res.Failed())
	assert.Equal(t, steps.OutcomeOK, res.Envelope.Outcome)
	reply, err := steps.Decode[seatReserved](res.Reply)
	require.NoError(t, err)
	assert.Equal(t, seatReserved{Seat: "12A"}, reply)
	assert.Empty(t, res.Reply.Metadata.Get("dead_letter_reason"), "the reply is as a saga would receive it")
	assert.Equal(t, int32(1), calls.Load())

	assert.Zero(t, count(t, db.SQL, `SELECT count(*) FROM kit_notes`), "rolled back: the write is gone")
	assert.Zero(t, count(t, db.SQL, `SELECT count(*) FROM idempotency_keys`), "rolled back: the key is gone")
	assert.Zero(t, count(t, db.SQL, `SELECT count(*) FROM pgsaga_dead_letters`), "rolled back: the reply is gone")
}

// A refusal is answered with the reason; the handler's writes are not
// kept, the key is stored failed.
func TestStepReportsABusinessFailure(t *testing.T) {
	t.Parallel()
	client, db := unitClient(t)
	var calls atomic.Int32
	res := sagatest.Step(t, client, seatStep(&calls), reserveSeat{Seat: "taken"}, func(tx delivery.DBTX) error {
		assert.Zero(t, count(t, tx, `SELECT count(*) FROM kit_notes`), "a refusal keeps none of the handler's writes")
		assert.Equal(t, 1, count(t, tx, `SELECT count(*) FROM idempotency_keys WHERE status = 'failed'`), "the key is stored failed")
		return nil
	})
	require.NoError(t, res.Err)
	assert.True(t, res.Failed())
	assert.Equal(t, "the seat is taken", res.Envelope.Reason)
	assert.Zero(t, count(t, db.SQL, `SELECT count(*) FROM idempotency_keys`))
}

// An error is the result's, once: not retried, not dead-lettered, and
// inspect is not called.
func TestStepReportsAnErrorWithoutRetrying(t *testing.T) {
	t.Parallel()
	client, db := unitClient(t)
	for seat, permanent := range map[string]bool{"flaky": false, "broken": true} {
		var calls atomic.Int32
		res := sagatest.Step(t, client, seatStep(&calls), reserveSeat{Seat: seat}, func(delivery.DBTX) error {
			t.Errorf("%s: inspect called after a failed attempt", seat)
			return nil
		})
		require.Error(t, res.Err, seat)
		assert.Equal(t, permanent, steps.IsPermanent(res.Err), "%s: %v", seat, res.Err)
		assert.Nil(t, res.Reply, seat)
		assert.Equal(t, int32(1), calls.Load(), "%s: run once", seat)
	}
	assert.Zero(t, count(t, db.SQL, `SELECT (SELECT count(*) FROM kit_notes) + (SELECT count(*) FROM pgsaga_dead_letters) + (SELECT count(*) FROM idempotency_keys)`))
}

type tripBooked struct {
	Trip string `json:"trip"`
	Seat string `json:"seat"`
}

func (tripBooked) MessageType() string { return "test.TripBooked" }

type chargeCard struct {
	Trip string `json:"trip"`
}

func (chargeCard) MessageType() string { return "test.ChargeCard" }

type releaseSeat struct {
	Seat string `json:"seat"`
}

func (releaseSeat) MessageType() string { return "test.ReleaseSeat" }

type trip struct {
	Trip, Seat, Reserved string
}

// tripClient has the trip saga: reserve a seat (released if the card is
// declined), then charge the card. No step runs.
func tripClient(t *testing.T) (*saga.Client, *sagatest.Database) {
	t.Helper()
	client, db := unitClient(t)
	require.NoError(t, client.Register(tripDef()))
	return client, db
}

func tripDef() *saga.Definition {
	reserve := steps.Define[reserveSeat]("trip.reserve", "trip.reserve", nil)
	release := steps.Define[releaseSeat]("trip.release", "trip.release", nil)
	charge := steps.Define[chargeCard]("trip.charge", "trip.charge", nil)
	def := saga.MustDefine(saga.Spec[trip]{Name: "trip",
		Trigger: saga.On("trips", func(b tripBooked) (string, trip, error) { return b.Trip, trip{Trip: b.Trip, Seat: b.Seat}, nil }),
		Steps: []saga.Step[trip]{
			{Name: "reserve",
				Action: saga.OnReply(saga.Send(reserve, func(d trip) reserveSeat { return reserveSeat{Seat: d.Seat} }),
					func(d *trip, r seatReserved) error { d.Reserved = r.Seat; return nil }),
				Compensation: saga.Send(release, func(d trip) releaseSeat { return releaseSeat{Seat: d.Seat} })},
			{Name: "charge", Action: saga.Send(charge, func(d trip) chargeCard { return chargeCard{Trip: d.Trip} })},
		}})
	return def
}

// The start: the instance and its first command, then nothing left.
func TestTransitionsStartASaga(t *testing.T) {
	t.Parallel()
	client, db := tripClient(t)
	calls := 0
	res := sagatest.Transitions(t, client, "trip", tripBooked{Trip: "t-1", Seat: "3C"}, func(tx delivery.DBTX, tr sagatest.Transition) error {
		calls++
		assert.Equal(t, 1, count(t, tx, `SELECT count(*) FROM saga_instances`), "the instance, in the transaction")
		return nil
	})
	require.NoError(t, res.Err)
	require.Len(t, res.Transitions, 1)
	assert.Equal(t, 1, calls)
	first := res.Last()
	assert.Equal(t, saga.StatusRunning, first.Instance.Status)
	assert.Equal(t, "reserve", first.Instance.Step)
	assert.Equal(t, saga.ID("trip", "t-1"), first.Instance.ID)
	require.NotNil(t, first.Command)
	cmd, err := steps.Decode[reserveSeat](first.Command)
	require.NoError(t, err)
	assert.Equal(t, reserveSeat{Seat: "3C"}, cmd)
	assert.Equal(t, "reserve", steps.EnvelopeOf(first.Command).Step)
	assert.Empty(t, first.Command.Metadata.Get("dead_letter_reason"), "the command as the step would receive it")
	assert.Zero(t, count(t, db.SQL, `SELECT (SELECT count(*) FROM saga_instances) + (SELECT count(*) FROM pgsaga_dead_letters) + (SELECT count(*) FROM pgsaga_queue)`),
		"rolled back: nothing stays")
}

// Each reply is one reaction: the data it brings, the next command, the
// end.
func TestTransitionsFollowTheReplies(t *testing.T) {
	t.Parallel()
	client, _ := tripClient(t)
	res := sagatest.Transitions(t, client, "trip", tripBooked{Trip: "t-2", Seat: "4D"}, nil,
		sagatest.Answer(seatReserved{Seat: "4D"}), sagatest.Answer(nil))
	require.NoError(t, res.Err)
	require.Len(t, res.Transitions, 3)
	second := res.Transitions[1]
	assert.Equal(t, "charge", second.Instance.Step)
	assert.JSONEq(t, `{"Trip":"t-2","Seat":"4D","Reserved":"4D"}`, string(second.Instance.Data), "OnReply read the reply")
	charge, err := steps.Decode[chargeCard](second.Command)
	require.NoError(t, err)
	assert.Equal(t, chargeCard{Trip: "t-2"}, charge)
	last := res.Last()
	assert.Equal(t, saga.StatusCompleted, last.Instance.Status)
	assert.Nil(t, last.Command, "a completed saga sends nothing")
}

// A refusal compensates the steps before it; an answer of another type
// than the step's stops the run with the engine's error.
func TestTransitionsCompensateARefusal(t *testing.T) {
	t.Parallel()
	client, _ := tripClient(t)
	res := sagatest.Transitions(t, client, "trip", tripBooked{Trip: "t-3", Seat: "5E"}, nil,
		sagatest.Answer(seatReserved{Seat: "5E"}), sagatest.Refuse(nil, "card declined"), sagatest.Answer(nil))
	require.NoError(t, res.Err)
	require.Len(t, res.Transitions, 4)
	declined := res.Transitions[2]
	assert.Equal(t, saga.StatusCompensating, declined.Instance.Status)
	assert.Equal(t, "charge: card declined", declined.Instance.FailureReason)
	release, err := steps.Decode[releaseSeat](declined.Command)
	require.NoError(t, err, "the reservation is released")
	assert.Equal(t, releaseSeat{Seat: "5E"}, release)
	assert.Equal(t, saga.StatusCompensated, res.Last().Instance.Status)

	wrong := sagatest.Transitions(t, client, "trip", tripBooked{Trip: "t-4", Seat: "6F"}, nil, sagatest.Answer(chargeCard{Trip: "t-4"}))
	require.Error(t, wrong.Err, "a reply of another type than the step's")
	assert.True(t, steps.IsPermanent(wrong.Err), "%v", wrong.Err)
	require.Len(t, wrong.Transitions, 1, "the saga as it was before the reply")
}

// A step that awaits a call: the call runs, the step runs again and
// answers from what it recorded, all in one Step.
func TestStepRunsAnAwaitedCall(t *testing.T) {
	t.Parallel()
	client, _ := unitClient(t)
	var calls, runs atomic.Int32
	step := steps.Define("seats.hold", "seats.hold", func(ctx context.Context, tx *steps.Tx, cmd reserveSeat) (steps.Message, error) {
		runs.Add(1)
		if !steps.Awaited(ctx) {
			return nil, steps.Await(time.Second, func(context.Context) error { calls.Add(1); return nil })
		}
		return seatReserved(cmd), nil
	})
	res := sagatest.Step(t, client, step, reserveSeat{Seat: "7G"}, nil)
	require.NoError(t, res.Err)
	reply, err := steps.Decode[seatReserved](res.Reply)
	require.NoError(t, err)
	assert.Equal(t, seatReserved{Seat: "7G"}, reply)
	assert.Equal(t, int32(1), calls.Load(), "the call ran once")
	assert.Equal(t, int32(2), runs.Load(), "the step ran, awaited, and ran again")
}

// fatals records a test's Fatalf instead of failing it, and stops the
// goroutine as Fatalf does: run the call in run.
type fatals struct {
	testing.TB
	mu  sync.Mutex
	msg string
}

func (f *fatals) Helper() {}

func (f *fatals) Fatalf(format string, args ...any) {
	f.mu.Lock()
	f.msg = fmt.Sprintf(format, args...)
	f.mu.Unlock()
	runtime.Goexit()
}

// run calls fn with f as its test and returns what it failed with ("" if
// nothing).
func (f *fatals) run(fn func(testing.TB)) string {
	done := make(chan struct{})
	go func() {
		defer close(done)
		fn(f)
	}()
	<-done
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.msg
}

// A saga of the trigger's key committed in the database is not reported
// as the run's start: the run fails the test, saying why.
func TestTransitionsRefuseAKeyCommittedAlready(t *testing.T) {
	t.Parallel()
	client, db := tripClient(t)
	// A worker's client, which starts sagas in the caller's transaction.
	worker, err := saga.NewClientFromDB(db.SQL, saga.ClientConfig{InProcessEngine: true, Logger: quiet})
	require.NoError(t, err)
	require.NoError(t, worker.Register(tripDef()))
	tx, err := db.SQL.Begin()
	require.NoError(t, err)
	_, err = worker.StartTx(context.Background(), tx, "trip", tripBooked{Trip: "t-10", Seat: "1A"})
	require.NoError(t, err)
	require.NoError(t, tx.Commit())

	f := &fatals{TB: t}
	msg := f.run(func(tb testing.TB) {
		sagatest.Transitions(tb, client, "trip", tripBooked{Trip: "t-10", Seat: "2B"}, nil, sagatest.Answer(seatReserved{Seat: "2B"}))
	})
	assert.Contains(t, msg, "exists in the database already")
}

// Two runs of one key at once: the second fails the test at once, saying
// so, instead of waiting on the first's row and failing as the engine.
func TestTransitionsRefuseASecondRunOfOneKey(t *testing.T) {
	t.Parallel()
	client, _ := tripClient(t)
	firstIn, secondDone := make(chan struct{}), make(chan struct{})
	first := make(chan sagatest.TransitionsResult, 1)
	go func() {
		first <- sagatest.Transitions(t, client, "trip", tripBooked{Trip: "t-11", Seat: "3C"}, func(delivery.DBTX, sagatest.Transition) error {
			close(firstIn)
			<-secondDone // holds its transaction while the second runs
			return nil
		})
	}()
	<-firstIn
	f := &fatals{TB: t}
	msg := f.run(func(tb testing.TB) {
		sagatest.Transitions(tb, client, "trip", tripBooked{Trip: "t-11", Seat: "3C"}, nil)
	})
	close(secondDone)
	assert.Contains(t, msg, "another run of saga trip with this key is under way")
	require.NoError(t, (<-first).Err, "the first run is not disturbed")
}

// What is not the step's or the engine's doing fails the test: a database
// that cannot be reached, a reply with no command left to answer.
func TestKitFailuresFailTheTest(t *testing.T) {
	t.Parallel()
	cfg, err := pgx.ParseConfig("postgres://nobody@127.0.0.1:1/none?connect_timeout=1")
	require.NoError(t, err)
	gone := stdlib.OpenDB(*cfg)
	t.Cleanup(func() { _ = gone.Close() })
	nowhere, err := saga.NewClientFromDB(gone, saga.ClientConfig{Logger: quiet})
	require.NoError(t, err)
	var calls atomic.Int32
	f := &fatals{TB: t}
	msg := f.run(func(tb testing.TB) { sagatest.Step(tb, nowhere, seatStep(&calls), reserveSeat{Seat: "1A"}, nil) })
	assert.NotEmpty(t, msg, "an unreachable database fails the test; it is not the step's error")
	assert.Zero(t, calls.Load())

	client, _ := tripClient(t)
	f = &fatals{TB: t}
	msg = f.run(func(tb testing.TB) {
		sagatest.Transitions(tb, client, "trip", tripBooked{Trip: "t-12", Seat: "4D"}, nil,
			sagatest.Answer(seatReserved{Seat: "4D"}), sagatest.Answer(nil), sagatest.Answer(nil))
	})
	assert.Contains(t, msg, "no command is in flight", "a reply too many is the test's mistake")
}
