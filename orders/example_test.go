package orders_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"

	"github.com/google/uuid"

	"github.com/pgsaga/pgsaga/internal/testdb"
	"github.com/pgsaga/pgsaga/orders"
	"github.com/pgsaga/pgsaga/saga"
	"github.com/pgsaga/pgsaga/steps/events"
)

// Place an order the way a checkout handler does: the client's key makes a
// retried request return the same order instead of placing a second one.
// The order's state is the fold of its events.
func ExampleService_Place() {
	ctx := context.Background()
	db := testdb.ForExample().SQL
	quiet := slog.New(slog.NewTextHandler(io.Discard, nil))
	client, err := saga.NewClientFromDB(db, saga.ClientConfig{
		RegisterEvents: []func(*events.Registry) error{orders.RegisterEvents}, Logger: quiet})
	if err != nil {
		panic(err)
	}
	svc, err := orders.New(orders.Config{DB: db, Publish: client.PublishTx, Idempotency: client.Idempotency(),
		Events: client.Events(), Logger: quiet})
	if err != nil {
		panic(err)
	}
	customer := "ada-" + uuid.NewString()[:8] // keeps this example apart in a shared database
	if err := svc.AddCustomer(ctx, customer, "Ada"); err != nil {
		panic(err)
	}

	req := orders.PlaceRequest{Key: "checkout-1", CustomerID: customer, AmountCents: 4_250, Note: "two books"}
	first, err := svc.Place(ctx, req)
	if err != nil {
		panic(err)
	}
	retry, err := svc.Place(ctx, req) // the client timed out and sent it again
	if err != nil {
		panic(err)
	}
	fmt.Println("retry replayed:", retry.Replayed, "same order:", retry.OrderID == first.OrderID)

	req.AmountCents = 9_999 // the same key for another order is refused
	_, err = svc.Place(ctx, req)
	fmt.Println("key reused:", errors.Is(err, orders.ErrKeyReused))

	if err := svc.CancelByCustomer(ctx, first.OrderID, "changed my mind"); err != nil {
		panic(err)
	}
	o, err := svc.Order(ctx, first.OrderID)
	if err != nil {
		panic(err)
	}
	fmt.Printf("%d cents, %s by %s (%s), version %d\n", o.AmountCents, o.Status, o.CancelledBy, o.CancelReason, o.Version)
	// Output:
	// retry replayed: true same order: true
	// key reused: true
	// 4250 cents, cancelled by customer (changed my mind), version 2
}
