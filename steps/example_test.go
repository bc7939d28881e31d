package steps_test

import (
	"context"
	"fmt"
	"time"

	"github.com/google/uuid"

	"github.com/pgsaga/pgsaga/idempotency"
	"github.com/pgsaga/pgsaga/internal/testdb"
	"github.com/pgsaga/pgsaga/steps"
	"github.com/pgsaga/pgsaga/steps/transport"
)

// ReserveSeat and SeatReserved are a command and its reply.
type ReserveSeat struct {
	Seat string `json:"seat"`
}

func (ReserveSeat) MessageType() string { return "example.ReserveSeat" }

type SeatReserved struct {
	Seat string `json:"seat"`
}

func (SeatReserved) MessageType() string { return "example.SeatReserved" }

// A step is a typed handler; the runtime claims the command's key, runs the
// handler in the subscriber's transaction, and publishes the reply.
func ExampleDefine() {
	db := testdb.ForExample().SQL
	ctx := context.Background()
	tr, _ := transport.New(transport.Config{DB: db, PollInterval: 20 * time.Millisecond})
	store, _ := idempotency.NewStore(idempotency.Config{DB: db})
	rt, _ := steps.New(steps.Config{Transport: tr, Store: store})

	suffix := uuid.NewString()[:8]
	reserve := steps.Define("reserve-seat-"+suffix, "seats_"+suffix,
		func(ctx context.Context, tx *steps.Tx, cmd ReserveSeat) (steps.Message, error) {
			// Business writes go through tx, in the same transaction.
			if cmd.Seat == "" {
				return nil, steps.Fail(nil, "no seat given") // final: stored as failed
			}
			return SeatReserved(cmd), nil
		})
	replies := "seat_replies_" + suffix
	// Replies stay queued for a reader that does not run here.
	if err := tr.Subscribe(ctx, transport.Subscription{Topic: replies, ConsumerGroup: "reader"}); err != nil {
		panic(err)
	}

	router, _ := tr.NewRouter()
	if err := rt.Register(router, reserve); err != nil {
		panic(err)
	}
	go func() { _ = router.Run(ctx) }()
	<-router.Running()
	defer router.Close()

	cmd, _ := steps.NewMessage(ReserveSeat{Seat: "12A"}, steps.Envelope{Key: "booking-7:reserve", ReplyTo: replies})
	_ = tr.Publisher(db).Publish(reserve.Topic, cmd)

	var payload string
	for range 500 {
		if db.QueryRow(`SELECT convert_from(payload, 'UTF8') FROM pgsaga_queue WHERE topic = $1`, replies).Scan(&payload) == nil {
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	fmt.Println(payload)
	// Output: {"seat":"12A"}
}
