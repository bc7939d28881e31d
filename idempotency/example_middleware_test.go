package idempotency_test

import (
	"context"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"

	"github.com/pgsaga/pgsaga/idempotency"
	"github.com/pgsaga/pgsaga/internal/testdb"
	"github.com/pgsaga/pgsaga/steps/transport"
)

// The Watermill middleware runs a handler once per key, in the subscriber's
// transaction, and answers a duplicate with the stored reply, same UUID.
func ExampleStore_Middleware() {
	db := testdb.ForExample().SQL
	ctx := context.Background()
	tr, _ := transport.New(transport.Config{DB: db, PollInterval: 20 * time.Millisecond})
	suffix := uuid.NewString()[:8]
	commands, replies := "greet_"+suffix, "greeted_"+suffix
	// Replies stay queued for a reader that does not run here.
	if err := tr.Subscribe(ctx, transport.Subscription{Topic: replies, ConsumerGroup: "reader"}); err != nil {
		panic(err)
	}
	store, _ := idempotency.NewStore(idempotency.Config{DB: db})
	once, err := store.Middleware(idempotency.MiddlewareConfig{
		Scope:         "greeter",
		TxFromContext: func(ctx context.Context) (idempotency.DBTX, bool) { return transport.TxFromContext(ctx) },
		Publisher:     func(tx idempotency.DBTX) message.Publisher { return tr.Publisher(tx) },
	})
	if err != nil {
		panic(err)
	}
	greet := once(func(msg *message.Message) ([]*message.Message, error) {
		fmt.Println("greeting", string(msg.Payload))
		return []*message.Message{message.NewMessage(uuid.NewString(), []byte(`"hello"`))}, nil
	})

	router, _ := tr.NewRouter()
	handled := make(chan struct{}, 2)
	_ = router.AddHandler("greeter", commands, "", func(msg *message.Message) error {
		_, err := greet(msg)
		handled <- struct{}{}
		return err
	})
	if err := router.Start(ctx); err != nil {
		panic(err)
	}

	cmd := message.NewMessage(uuid.NewString(), []byte(`"world"`))
	cmd.Metadata.Set(idempotency.ReplyToMetadata, replies)
	_ = tr.Publisher(db).Publish(commands, cmd, cmd) // delivered twice
	<-handled
	<-handled
	if err := router.Stop(); err != nil {
		panic(err)
	}

	var n, ids int
	_ = db.QueryRow(`SELECT count(*), count(DISTINCT uuid) FROM pgsaga_queue WHERE topic = $1`, replies).Scan(&n, &ids)
	fmt.Println(n, "replies,", ids, "distinct id")
	// Output:
	// greeting "world"
	// 2 replies, 1 distinct id
}
