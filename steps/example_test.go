package steps_test

import (
	"context"
	"fmt"
	"log/slog"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"

	"github.com/pgsaga/pgsaga/internal/testdb"
	"github.com/pgsaga/pgsaga/saga"
	"github.com/pgsaga/pgsaga/saga/delivery"
	"github.com/pgsaga/pgsaga/steps"
	"github.com/pgsaga/pgsaga/steps/events"
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
// handler in the delivery's transaction, and publishes the reply. A
// duplicate of the command is answered with the stored reply.
func ExampleDefine() {
	db := testdb.ForExample().SQL
	ctx := context.Background()
	client, err := saga.NewClientFromDB(db, saga.ClientConfig{Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		panic(err)
	}

	suffix := uuid.NewString()[:8] // keeps this example apart in a shared database
	reserve := steps.Define("reserve-seat-"+suffix, "seats_"+suffix,
		func(ctx context.Context, tx *steps.Tx, cmd ReserveSeat) (steps.Message, error) {
			// Business writes go through tx, in the same transaction.
			if cmd.Seat == "" {
				return nil, steps.Fail(nil, "no seat given") // final: stored as failed
			}
			return SeatReserved(cmd), nil
		})
	if err := client.AddSteps(reserve); err != nil {
		panic(err)
	}
	// Whoever sent the command reads the replies (here, a handler of the
	// reply topic, in its delivery's transaction).
	replies := "seat_replies_" + suffix
	got := make(chan string, 2)
	if err := client.AddProjections(events.Projection{Name: "reader-" + suffix, Topic: replies,
		Handle: func(_ context.Context, _ delivery.DBTX, msg *message.Message) error {
			got <- fmt.Sprintf("%s replayed=%t", msg.Payload, msg.Metadata.Get(steps.MetaReplayed) == "true")
			return nil
		}}); err != nil {
		panic(err)
	}
	if err := client.Start(ctx); err != nil {
		panic(err)
	}
	defer client.Stop(context.Background()) //nolint:errcheck

	cmd, err := steps.NewMessage(ReserveSeat{Seat: "12A"}, steps.Envelope{Key: "booking-7:reserve", ReplyTo: replies})
	if err != nil {
		panic(err)
	}
	if err := client.PublishTx(ctx, db, reserve.Topic(), cmd); err != nil {
		panic(err)
	}
	fmt.Println(<-got)
	// The same command again: answered from the store, not run again.
	if err := client.PublishTx(ctx, db, reserve.Topic(), cmd); err != nil {
		panic(err)
	}
	fmt.Println(<-got)
	// Output:
	// {"seat":"12A"} replayed=false
	// {"seat":"12A"} replayed=true
}
