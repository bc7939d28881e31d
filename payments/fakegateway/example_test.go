package fakegateway_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"strings"
	"time"

	"github.com/google/uuid"

	"github.com/pgsaga/pgsaga/internal/testdb"
	"github.com/pgsaga/pgsaga/payments"
	"github.com/pgsaga/pgsaga/payments/fakegateway"
)

// Test how your code copes with a failing gateway: plan a fault per call,
// then see what the caller gets. Here the first call with a key finds the
// gateway down, the second charges but its answer never comes, and keys
// that start with "declined-" are declined.
func Example() {
	ctx := context.Background()
	db := testdb.ForExample().SQL
	gateway, err := fakegateway.Start(ctx, fakegateway.Config{
		DB:       db,
		LostHang: time.Minute, // longer than the client waits
		Logger:   slog.New(slog.NewTextHandler(io.Discard, nil)),
		Faults: func(c fakegateway.Call) fakegateway.Fault {
			switch {
			case strings.HasPrefix(c.Key, "declined-"):
				return fakegateway.Decline
			case c.Attempt == 1:
				return fakegateway.Unavailable
			case c.Attempt == 2:
				return fakegateway.Lost
			}
			return fakegateway.None
		},
	})
	if err != nil {
		panic(err)
	}
	defer gateway.Close()
	client := &payments.GatewayClient{BaseURL: gateway.URL(), HTTP: &http.Client{Timeout: time.Second}}

	order := uuid.New()
	key := "charge-" + order.String() // one key for every retry of one charge
	var chargeID string
	for attempt := 1; chargeID == ""; attempt++ {
		chargeID, err = client.Charge(ctx, key, "acct-1", order, 2_500)
		var transient *payments.GatewayError
		switch {
		case err == nil:
			fmt.Printf("attempt %d: charged\n", attempt)
		case errors.As(err, &transient):
			fmt.Printf("attempt %d: the gateway answered %d; retry with the same key\n", attempt, transient.Status)
		case errors.Is(err, payments.ErrDeclined), errors.Is(err, payments.ErrBadGatewayRequest):
			panic(err) // final, and not in this plan
		default:
			fmt.Printf("attempt %d: no answer, outcome unknown; retry with the same key\n", attempt)
		}
	}
	op, _, err := gateway.Operation(ctx, key)
	if err != nil {
		panic(err)
	}
	fmt.Printf("the gateway made one %s of %d cents for %d calls; the caller got its id: %t\n",
		op.Op, op.AmountCents, op.Calls, op.ID == chargeID)

	_, err = client.Charge(ctx, "declined-"+uuid.NewString(), "acct-1", uuid.New(), 2_500)
	fmt.Println("declined:", errors.Is(err, payments.ErrDeclined))
	// Output:
	// attempt 1: the gateway answered 503; retry with the same key
	// attempt 2: no answer, outcome unknown; retry with the same key
	// attempt 3: charged
	// the gateway made one charge of 2500 cents for 3 calls; the caller got its id: true
	// declined: true
}
