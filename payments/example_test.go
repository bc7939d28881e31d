package payments_test

import (
	"context"
	"fmt"
	"io"
	"log/slog"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"

	"github.com/pgsaga/pgsaga/internal/testdb"
	"github.com/pgsaga/pgsaga/payments"
	"github.com/pgsaga/pgsaga/payments/fakegateway"
	"github.com/pgsaga/pgsaga/saga"
	"github.com/pgsaga/pgsaga/saga/delivery"
	"github.com/pgsaga/pgsaga/steps"
	"github.com/pgsaga/pgsaga/steps/events"
)

// Charge an order with the charge step, as the saga does: the command's
// idempotency key goes to the gateway too, so the same command sent again
// is answered from the store and charges nothing. The refund step gives
// the money back.
func Example() {
	ctx := context.Background()
	db := testdb.ForExample().SQL
	quiet := slog.New(slog.NewTextHandler(io.Discard, nil))
	gateway, err := fakegateway.Start(ctx, fakegateway.Config{DB: db, Logger: quiet})
	if err != nil {
		panic(err)
	}
	defer gateway.Close()
	client, err := saga.NewClientFromDB(db, saga.ClientConfig{
		RegisterEvents: []func(*events.Registry) error{payments.RegisterEvents}, Logger: quiet})
	if err != nil {
		panic(err)
	}
	pay, err := payments.New(payments.Config{DB: db, Events: client.Events(), Idempotency: client.Idempotency(),
		Gateway: &payments.GatewayClient{BaseURL: gateway.URL()}, Logger: quiet})
	if err != nil {
		panic(err)
	}
	account := "ada-" + uuid.NewString()[:8] // keeps this example apart in a shared database
	if err := pay.OpenAccount(ctx, account); err != nil {
		panic(err)
	}
	if err := pay.Deposit(ctx, account, 10_000, "opening deposit"); err != nil {
		panic(err)
	}

	// The client serves the steps; the replies go to a topic this example
	// reads, as a saga reads its own.
	replies := "payment_replies_" + account
	answered := make(chan struct{}, 1)
	if err := client.AddSteps(pay.ChargeStep(), pay.RefundStep()); err != nil {
		panic(err)
	}
	if err := client.AddProjections(events.Projection{Name: "reader-" + account, Topic: replies,
		Handle: func(context.Context, delivery.DBTX, *message.Message) error { answered <- struct{}{}; return nil }}); err != nil {
		panic(err)
	}
	if err := client.Start(ctx); err != nil {
		panic(err)
	}
	defer client.Stop(context.Background()) //nolint:errcheck

	// run sends cmd to step under key, waits for the answer, and prints the
	// balance after it.
	run := func(what string, step steps.AnyStep, cmd steps.Message, key string) {
		msg, err := steps.NewMessage(cmd, steps.Envelope{Key: key, ReplyTo: replies})
		if err != nil {
			panic(err)
		}
		if err := client.PublishTx(ctx, db, step.Topic(), msg); err != nil {
			panic(err)
		}
		<-answered
		balance, err := pay.Balance(ctx, account)
		if err != nil {
			panic(err)
		}
		fmt.Printf("%s: balance %d\n", what, balance)
	}
	order := uuid.New()
	cmd := payments.ChargePayment{OrderID: order, AccountID: account, AmountCents: 2_500}
	chargeKey := "order-" + order.String() + ":charge" // the same for every re-send
	run("charged", pay.ChargeStep(), cmd, chargeKey)
	run("charged again, same key", pay.ChargeStep(), cmd, chargeKey)
	op, _, err := gateway.Operation(ctx, chargeKey)
	if err != nil {
		panic(err)
	}
	fmt.Printf("the gateway charged %d cents once, for %d call\n", op.AmountCents, op.Calls)
	run("refunded", pay.RefundStep(), payments.RefundPayment{OrderID: order, AccountID: account}, "order-"+order.String()+":refund")
	// Output:
	// charged: balance 7500
	// charged again, same key: balance 7500
	// the gateway charged 2500 cents once, for 1 call
	// refunded: balance 10000
}
