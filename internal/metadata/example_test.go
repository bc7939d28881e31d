package metadata_test

import (
	"fmt"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/pgsaga/pgsaga/internal/metadata"
	"github.com/pgsaga/pgsaga/steps"
)

// ShipParcel is a command a saga sends to a shipping service.
type ShipParcel struct {
	Parcel string `json:"parcel"`
}

func (ShipParcel) MessageType() string { return "shipping.ShipParcel" }

// A Watermill middleware of your own that says which saga, step and
// command every message belongs to, read from the keys pgsaga writes.
// It works on any handler, pgsaga's or not.
func Example() {
	withSaga := func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			md := msg.Metadata
			fmt.Printf("%s: saga %s, step %s, key %s, reply to %s\n",
				md.Get(metadata.Type), md.Get(metadata.SagaID), md.Get(metadata.Step),
				md.Get(metadata.Key), md.Get(metadata.ReplyTo))
			return h(msg)
		}
	}
	handler := withSaga(func(msg *message.Message) ([]*message.Message, error) {
		return nil, nil // ship the parcel
	})

	// A command as the saga engine sends it.
	cmd, err := steps.NewMessage(ShipParcel{Parcel: "p-17"}, steps.Envelope{
		SagaID: "order-42", Step: "ship", Key: "order-42:ship", ReplyTo: "shipping.replies",
	})
	if err != nil {
		panic(err)
	}
	if _, err := handler(cmd); err != nil {
		panic(err)
	}
	// Output:
	// shipping.ShipParcel: saga order-42, step ship, key order-42:ship, reply to shipping.replies
}

// A producer that does not use pgsaga's Go packages (another language, a
// script, a bridge from another broker) sends a command a step accepts by
// setting these keys itself: the type, an idempotency key that stays the
// same when the command is sent again, and where the reply goes.
func Example_foreignProducer() {
	msg := message.NewMessage("4b0c6a3e-5a8e-4d5e-9f6a-2f1d8c0b7e21", []byte(`{"parcel":"p-18"}`))
	msg.Metadata.Set(metadata.Type, ShipParcel{}.MessageType())
	msg.Metadata.Set(metadata.Key, "warehouse-batch-9:p-18")
	msg.Metadata.Set(metadata.ReplyTo, "warehouse.replies")
	msg.Metadata.Set(metadata.CorrelationID, "warehouse-batch-9")

	// What the step runtime reads from it.
	env := steps.EnvelopeOf(msg)
	cmd, err := steps.Decode[ShipParcel](msg)
	if err != nil {
		panic(err)
	}
	fmt.Println("command:", env.Type, cmd.Parcel)
	fmt.Println("key:", env.Key)
	fmt.Println("reply to:", env.ReplyTo)
	fmt.Println("correlation:", env.CorrelationID)
	// Output:
	// command: shipping.ShipParcel p-18
	// key: warehouse-batch-9:p-18
	// reply to: warehouse.replies
	// correlation: warehouse-batch-9
}
