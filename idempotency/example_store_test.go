package idempotency_test

import (
	"context"
	"fmt"

	"github.com/google/uuid"

	"github.com/pgsaga/pgsaga/idempotency"
	"github.com/pgsaga/pgsaga/internal/testdb"
	"github.com/pgsaga/pgsaga/saga/delivery"
)

// Do runs a request at most once per key; a second call with the same key
// replays the stored response.
func ExampleStore_Do() {
	db := testdb.ForExample().SQL // your *sql.DB (pgx stdlib over your pool)
	ctx := context.Background()
	store, err := idempotency.NewStore(idempotency.Config{DB: db})
	if err != nil {
		panic(err)
	}
	req := idempotency.Request{
		Scope: "charge-card",
		Key:   "order-" + uuid.NewString(), // the client's key
		Hash:  idempotency.Fingerprint([]byte("charge 4200 cents")),
	}
	for range 2 {
		res, err := store.Do(ctx, req, func(ctx context.Context, tx delivery.DBTX) (idempotency.Response, error) {
			// Writes through tx commit with the stored response, or not at all.
			fmt.Println("charging")
			return idempotency.Response{Code: 201, Body: []byte("charged 4200")}, nil
		})
		if err != nil {
			panic(err)
		}
		fmt.Println(res.Status, res.Response.Code, string(res.Response.Body), "replayed:", res.Replayed)
	}
	// Output:
	// charging
	// completed 201 charged 4200 replayed: false
	// completed 201 charged 4200 replayed: true
}

// The two-phase form for a call to an external service: commit a pending
// claim with a lease, call out with the stable key, then complete fenced on
// the lease.
func ExampleStore_Acquire() {
	db := testdb.ForExample().SQL
	ctx := context.Background()
	store, err := idempotency.NewStore(idempotency.Config{DB: db})
	if err != nil {
		panic(err)
	}
	req := idempotency.Request{Scope: "gateway", Key: uuid.NewString(), Hash: idempotency.Fingerprint([]byte("charge 100"))}

	acq, err := store.Acquire(ctx, req)
	if err != nil {
		panic(err)
	}
	if acq.Lease != nil {
		// Call the gateway here, passing req.Key as its idempotency key.
		// On a timeout: return, and let the lease expire; never complete.
		err = store.CompleteLease(ctx, acq.Lease, idempotency.StatusCompleted, idempotency.Response{Code: 200, Body: []byte("ch_1")})
		fmt.Println("executed, attempt", acq.Lease.Attempt, "err:", err)
	}
	again, err := store.Acquire(ctx, req)
	if err != nil {
		panic(err)
	}
	fmt.Println("second time replays:", string(again.Record.Response.Body))
	// Output:
	// executed, attempt 1 err: <nil>
	// second time replays: ch_1
}
