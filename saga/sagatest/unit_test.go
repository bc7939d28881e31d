package sagatest_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/saga"
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

func count(t *testing.T, q steps.DBTX, query string) int {
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
	res := sagatest.Step(t, client, seatStep(&calls), reserveSeat{Seat: "12A"}, func(tx steps.DBTX) error {
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
	res := sagatest.Step(t, client, seatStep(&calls), reserveSeat{Seat: "taken"}, func(tx steps.DBTX) error {
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
		res := sagatest.Step(t, client, seatStep(&calls), reserveSeat{Seat: seat}, func(steps.DBTX) error {
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
