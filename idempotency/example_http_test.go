package idempotency_test

import (
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"

	"github.com/google/uuid"

	"github.com/pgsaga/pgsaga/idempotency"
	"github.com/pgsaga/pgsaga/internal/testdb"
)

// The HTTP middleware answers a retried POST with the first response.
func ExampleStore_HTTPMiddleware() {
	db := testdb.ForExample().SQL
	store, err := idempotency.NewStore(idempotency.Config{DB: db})
	if err != nil {
		panic(err)
	}
	protect, err := store.HTTPMiddleware(idempotency.HTTPConfig{
		Scope:    "POST /payments",
		Required: true,
		// Who is calling: here an API key header; use your authentication.
		Caller: func(r *http.Request) (string, error) { return r.Header.Get("X-Api-Key"), nil },
	})
	if err != nil {
		panic(err)
	}
	payments := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		// idempotency.TxFromContext(r.Context()) is the transaction to write in.
		w.WriteHeader(http.StatusCreated)
		fmt.Fprint(w, `{"payment":"p-1"}`)
	})
	srv := httptest.NewServer(protect(payments))
	defer srv.Close()

	key := uuid.NewString()
	for range 2 {
		req, err := http.NewRequest(http.MethodPost, srv.URL, strings.NewReader(`{"amount":100}`))
		if err != nil {
			panic(err)
		}
		req.Header.Set("X-Api-Key", "client-1")
		req.Header.Set(idempotency.KeyHeader, key)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			panic(err)
		}
		resp.Body.Close()
		fmt.Println(resp.StatusCode, "replayed:", resp.Header.Get(idempotency.ReplayedHeader) == "true")
	}
	// Output:
	// 201 replayed: false
	// 201 replayed: true
}
