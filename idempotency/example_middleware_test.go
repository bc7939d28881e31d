package idempotency_test

import (
	"context"
	"fmt"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"

	"github.com/pgsaga/pgsaga/idempotency"
	"github.com/pgsaga/pgsaga/internal/testdb"
	"github.com/pgsaga/pgsaga/internal/transport"
	"github.com/pgsaga/pgsaga/steps"
)

// The Watermill middleware runs a handler once per key, in the subscriber's
// transaction, and answers a duplicate with the stored reply, same UUID.
func ExampleStore_Middleware() {
	db := testdb.ForExample().SQL
	ctx := context.Background()
	tr, err := transport.New(transport.Config{DB: db})
	if err != nil {
		panic(err)
	}
	suffix := uuid.NewString()[:8]
	commands, replies := "greet_"+suffix, "greeted_"+suffix
	// Replies stay queued for a reader that does not run here.
	if err := tr.Subscribe(ctx, transport.Subscription{Topic: replies, ConsumerGroup: "reader"}); err != nil {
		panic(err)
	}
	store, err := idempotency.NewStore(idempotency.Config{DB: db})
	if err != nil {
		panic(err)
	}
	once, err := store.Middleware(idempotency.MiddlewareConfig{
		Scope:         "greeter",
		TxFromContext: func(ctx context.Context) (steps.DBTX, bool) { return transport.TxFromContext(ctx) },
		Publisher:     func(tx steps.DBTX) message.Publisher { return tr.Publisher(tx) },
	})
	if err != nil {
		panic(err)
	}
	greet := once(func(msg *message.Message) ([]*message.Message, error) {
		fmt.Println("greeting", string(msg.Payload))
		return []*message.Message{message.NewMessage(uuid.NewString(), []byte(`"hello"`))}, nil
	})

	router, err := tr.NewRouter()
	if err != nil {
		panic(err)
	}
	handled := make(chan struct{}, 2)
	if err := router.AddHandler("greeter", commands, "", func(msg *message.Message) error {
		_, err := greet(msg)
		if err == nil { // a delivery may be attempted more than once
			handled <- struct{}{}
		}
		return err
	}); err != nil {
		panic(err)
	}
	if err := router.Start(ctx); err != nil {
		panic(err)
	}

	cmd := message.NewMessage(uuid.NewString(), []byte(`"world"`))
	cmd.Metadata.Set(steps.MetaReplyTo, replies)
	if err := tr.Publisher(db).Publish(commands, cmd, cmd); err != nil { // delivered twice
		panic(err)
	}
	<-handled
	<-handled
	if err := router.Stop(); err != nil {
		panic(err)
	}

	var n, ids int
	if err := db.QueryRow(`SELECT count(*), count(DISTINCT uuid) FROM pgsaga_queue WHERE topic = $1`, replies).Scan(&n, &ids); err != nil {
		panic(err)
	}
	fmt.Println(n, "replies,", ids, "distinct id")
	// Output:
	// greeting "world"
	// 2 replies, 1 distinct id
}
