package idempotency_test

import (
	"context"
	"database/sql"
	"fmt"

	"github.com/ThreeDotsLabs/watermill"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v3/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"

	"github.com/pgsaga/pgsaga/idempotency"
	"github.com/pgsaga/pgsaga/internal/testdb"
	"github.com/pgsaga/pgsaga/saga/delivery"
	"github.com/pgsaga/pgsaga/steps"
)

// The Watermill middleware runs a handler of your own Watermill router
// once per key, in the watermill-sql subscriber's transaction, and
// answers a duplicate with the stored reply, same UUID.
func ExampleStore_Middleware() {
	db := testdb.ForExample().SQL
	ctx := context.Background()
	logger := watermill.NopLogger{}
	suffix := uuid.NewString()[:8]
	commands, replies := "greet_"+suffix, "greeted_"+suffix
	schema := wsql.DefaultPostgreSQLSchema{}
	sub, err := wsql.NewSubscriber(db, wsql.SubscriberConfig{ConsumerGroup: "greeter", SchemaAdapter: schema,
		OffsetsAdapter: wsql.DefaultPostgreSQLOffsetsAdapter{}, InitializeSchema: true}, logger)
	if err != nil {
		panic(err)
	}
	for _, topic := range []string{commands, replies} {
		if err := sub.SubscribeInitialize(topic); err != nil {
			panic(err)
		}
	}
	store, err := idempotency.NewStore(idempotency.Config{DB: db})
	if err != nil {
		panic(err)
	}
	once, err := store.Middleware(idempotency.MiddlewareConfig{
		Scope: "greeter",
		// Replies go out through the subscriber's transaction: the outbox.
		Publisher: func(tx delivery.DBTX) message.Publisher {
			pub, err := wsql.NewPublisher(tx.(*sql.Tx), wsql.PublisherConfig{SchemaAdapter: schema}, logger)
			if err != nil {
				panic(err)
			}
			return pub
		},
	})
	if err != nil {
		panic(err)
	}
	greet := once(func(msg *message.Message) ([]*message.Message, error) {
		fmt.Println("greeting", string(msg.Payload))
		return []*message.Message{message.NewMessage(uuid.NewString(), []byte(`"hello"`))}, nil
	})

	router, err := message.NewRouter(message.RouterConfig{}, logger)
	if err != nil {
		panic(err)
	}
	router.AddConsumerHandler("greeter", commands, sub, func(msg *message.Message) error {
		_, err := greet(msg)
		return err
	})
	// Whoever sent the command reads the replies, once they are committed.
	readerSub, err := wsql.NewSubscriber(db, wsql.SubscriberConfig{ConsumerGroup: "reader", SchemaAdapter: schema,
		OffsetsAdapter: wsql.DefaultPostgreSQLOffsetsAdapter{}, InitializeSchema: true}, logger)
	if err != nil {
		panic(err)
	}
	got := make(chan string, 2)
	router.AddConsumerHandler("reader", replies, readerSub, func(msg *message.Message) error {
		got <- msg.UUID
		return nil
	})
	go func() { _ = router.Run(ctx) }()
	<-router.Running()

	pub, err := wsql.NewPublisher(db, wsql.PublisherConfig{SchemaAdapter: schema}, logger)
	if err != nil {
		panic(err)
	}
	cmd := message.NewMessage(uuid.NewString(), []byte(`"world"`))
	cmd.Metadata.Set(steps.MetaReplyTo, replies)
	if err := pub.Publish(commands, cmd, cmd); err != nil { // delivered twice
		panic(err)
	}
	first, second := <-got, <-got
	if err := router.Close(); err != nil {
		panic(err)
	}
	fmt.Println("2 replies, the same id:", first == second)
	// Output:
	// greeting "world"
	// 2 replies, the same id: true
}
