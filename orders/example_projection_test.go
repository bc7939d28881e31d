package orders_test

import (
	"context"
	"fmt"
	"io"
	"log/slog"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"

	"github.com/pgsaga/pgsaga/internal/testdb"
	"github.com/pgsaga/pgsaga/orders"
	"github.com/pgsaga/pgsaga/saga"
	"github.com/pgsaga/pgsaga/saga/delivery"
	"github.com/pgsaga/pgsaga/steps/events"
)

// Serve order pages from order_views, the read model the projection keeps
// from the orders' events in your workers. To act once a change is in the
// view, follow the projection with a message of your own: published in the
// projection's transaction, it is delivered only once the view committed.
func ExampleService_Projection() {
	ctx := context.Background()
	db := testdb.ForExample().SQL
	quiet := slog.New(slog.NewTextHandler(io.Discard, nil))
	client, err := saga.NewClientFromDB(db, saga.ClientConfig{
		RegisterEvents: []func(*events.Registry) error{orders.RegisterEvents},
		EventsTopic:    orders.StreamTopic, // publishes the order events for the projection
		Logger:         quiet})
	if err != nil {
		panic(err)
	}
	svc, err := orders.New(orders.Config{DB: db, Publish: client.PublishTx, Idempotency: client.Idempotency(),
		Events: client.Events(), Logger: quiet})
	if err != nil {
		panic(err)
	}
	run := uuid.NewString()[:8] // keeps this example apart in a shared database
	projection, inView := svc.Projection(), "order_views_updated_"+run
	project := projection.Handle
	projection.Handle = func(ctx context.Context, tx delivery.DBTX, msg *message.Message) error {
		if err := project(ctx, tx, msg); err != nil {
			return err
		}
		inViewNow := msg.Copy() // the event, with its stream and version
		inViewNow.UUID = uuid.NewString()
		return client.PublishTx(ctx, tx, inView, inViewNow)
	}
	var stream string               // the order to watch, set before the workers start
	updated := make(chan string, 8) // room for redeliveries
	if err := client.AddProjections(projection, events.Projection{Name: "order-pages-" + run, Topic: inView,
		Handle: func(_ context.Context, _ delivery.DBTX, msg *message.Message) error {
			if msg.Metadata.Get(events.MetaStreamID) == stream {
				updated <- msg.Metadata.Get(events.MetaVersion)
			}
			return nil
		}}); err != nil {
		panic(err)
	}
	if err := client.Setup(ctx); err != nil { // events published from now on wait for the workers
		panic(err)
	}

	customer := "ada-" + run
	if err := svc.AddCustomer(ctx, customer, "Ada"); err != nil {
		panic(err)
	}
	placed, err := svc.Place(ctx, orders.PlaceRequest{Key: "checkout-1", CustomerID: customer, AmountCents: 4_250})
	if err != nil {
		panic(err)
	}
	if err := svc.CancelByCustomer(ctx, placed.OrderID, "changed my mind"); err != nil {
		panic(err)
	}
	stream = orders.Stream(placed.OrderID)

	if err := client.Start(ctx); err != nil {
		panic(err)
	}
	defer client.Stop(context.Background()) //nolint:errcheck
	for version := range updated {
		if version == "2" { // the cancellation
			break
		}
	}
	view, err := svc.View(ctx, placed.OrderID)
	if err != nil {
		panic(err)
	}
	fmt.Printf("%d cents, %s by %s, version %d\n", view.AmountCents, view.Status, *view.CancelledBy, view.Version)
	// Output:
	// 4250 cents, cancelled by customer, version 2
}
