package transport_test

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"

	"github.com/pgsaga/pgsaga/internal/testdb"
	"github.com/pgsaga/pgsaga/internal/transport"
)

// A handler that calls a slow service does not hold its delivery's
// transaction across the call: it returns Await, the call runs outside any
// transaction while the batch goes on, and the handler runs again once the
// call has recorded its answer.
func ExampleAwait() {
	ctx := context.Background()
	db := testdb.ForExample().SQL
	tr, err := transport.New(transport.Config{DB: db})
	if err != nil {
		panic(err)
	}
	topic := "shipments_" + uuid.NewString()[:8]

	var mu sync.Mutex
	labels := map[string]string{} // what the carrier answered, by message (a table, in real life)
	label := func(id string) string { mu.Lock(); defer mu.Unlock(); return labels[id] }

	router, err := tr.NewRouter()
	if err != nil {
		panic(err)
	}
	done := make(chan string, 1)
	if err := router.AddHandler("shipper", topic, "", func(msg *message.Message) error {
		if l := label(msg.UUID); l != "" {
			fmt.Println("after the call:", transport.AwaitedFromContext(msg.Context()))
			done <- l // reply, write, publish: in the delivery's transaction
			return nil
		}
		fmt.Println("first run:", transport.AwaitedFromContext(msg.Context()))
		return transport.Await(10*time.Second, func(ctx context.Context) error {
			// The carrier's API, which may take seconds: no transaction open.
			mu.Lock()
			defer mu.Unlock()
			labels[msg.UUID] = "label for " + string(msg.Payload)
			return nil
		})
	}); err != nil {
		panic(err)
	}
	if err := router.Start(ctx); err != nil {
		panic(err)
	}
	if err := tr.Publisher(db).Publish(topic, message.NewMessage(uuid.NewString(), []byte("parcel 1"))); err != nil {
		panic(err)
	}
	fmt.Println(<-done)
	if err := router.Stop(); err != nil {
		panic(err)
	}
	// Output:
	// first run: false
	// after the call: true
	// label for parcel 1
}
