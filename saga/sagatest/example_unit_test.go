package sagatest_test

import (
	"context"
	"fmt"
	"testing"

	"github.com/pgsaga/pgsaga/internal/testdb"
	"github.com/pgsaga/pgsaga/saga"
	"github.com/pgsaga/pgsaga/saga/delivery"
	"github.com/pgsaga/pgsaga/saga/sagatest"
	"github.com/pgsaga/pgsaga/steps"
)

// The unit tier: one step, run once as a worker would run it, in a
// transaction rolled back at the end. In your test, pass its t.
func ExampleStep() {
	t := &testing.T{} // your test's
	client, err := saga.NewClientFromDB(testdb.ForExample().SQL, saga.ClientConfig{Logger: quiet})
	if err != nil {
		panic(err)
	}
	reserve := steps.Define("hotel.reserve", "hotel.reserve", func(ctx context.Context, tx *steps.Tx, cmd ReserveRoom) (steps.Message, error) {
		if cmd.Guest == "" {
			return nil, steps.Fail(nil, "who is the guest?")
		}
		return RoomReserved{}, nil
	})

	res := sagatest.Step(t, client, reserve, ReserveRoom{Guest: "ada"}, func(tx delivery.DBTX) error {
		var keys int
		err := tx.QueryRowContext(context.Background(), `SELECT count(*) FROM idempotency_keys WHERE scope = 'hotel.reserve'`).Scan(&keys)
		fmt.Println("keys stored, before the rollback:", keys)
		return err
	})
	fmt.Println(res.Envelope.Type, res.Envelope.Outcome)

	refused := sagatest.Step(t, client, reserve, ReserveRoom{}, nil)
	fmt.Println(refused.Failed(), refused.Envelope.Reason)
	// Output:
	// keys stored, before the rollback: 1
	// hotel.RoomReserved ok
	// true who is the guest?
}

// A saga's reactions, one at a time: its start, then the engine's answer
// to each reply, with no step running.
func ExampleTransitions() {
	t := &testing.T{} // your test's
	client, err := saga.NewClientFromDB(testdb.ForExample().SQL, saga.ClientConfig{Logger: quiet})
	if err != nil {
		panic(err)
	}
	reserve := steps.Define[ReserveRoom]("hotel.reserve", "hotel.reserve", nil) // served elsewhere
	def := saga.MustDefine(saga.Spec[booking]{Name: "stay",
		Trigger: saga.On("hotel.bookings", func(b Booked) (string, booking, error) { return b.Guest, booking(b), nil }),
		Steps: []saga.Step[booking]{{Name: "reserve",
			Action: saga.Send(reserve, func(b booking) ReserveRoom { return ReserveRoom(b) })}},
	})
	if err := client.Register(def); err != nil {
		panic(err)
	}

	res := sagatest.Transitions(t, client, "stay", Booked{Guest: "ada"}, nil, sagatest.Refuse(nil, "no room left"))
	for _, tr := range res.Transitions {
		sent := "nothing"
		if tr.Command != nil {
			sent = steps.EnvelopeOf(tr.Command).Type
		}
		fmt.Println(tr.Instance.Status, tr.Instance.Step, "sent", sent)
	}
	fmt.Println(res.Last().Instance.FailureReason)
	// Output:
	// running reserve sent hotel.ReserveRoom
	// compensated reserve sent nothing
	// reserve: no room left
}
