package transport_test

import (
	"context"
	"errors"
	"fmt"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"

	"github.com/pgsaga/pgsaga/internal/testdb"
	"github.com/pgsaga/pgsaga/internal/transport"
)

// Publish from your own transaction (the outbox: a message exists if, and
// only if, its transaction commits), handle each delivery in a transaction
// of its own, and find what could never be handled in the dead letters.
func Example() {
	ctx := context.Background()
	db := testdb.ForExample().SQL
	tr, err := transport.New(transport.Config{DB: db})
	if err != nil {
		panic(err)
	}
	topic := "invoices_" + uuid.NewString()[:8] // apart from other examples in a shared database

	router, err := tr.NewRouter()
	if err != nil {
		panic(err)
	}
	handled := make(chan string, 3)
	if err := router.AddHandler("mailer", topic, "", func(msg *message.Message) error {
		if string(msg.Payload) == "garbage" {
			return transport.Permanent(errors.New("not an invoice")) // no retry: dead-lettered at once
		}
		// Writes through the delivery's transaction commit with its ack.
		tx, _ := transport.TxFromContext(msg.Context())
		if _, err := tx.ExecContext(msg.Context(), `SELECT 1`); err != nil {
			return err // retried with backoff, then dead-lettered
		}
		handled <- string(msg.Payload)
		return nil
	}); err != nil {
		panic(err)
	}
	if err := router.Start(ctx); err != nil {
		panic(err)
	}

	publishIn := func(commit bool, payload string) {
		tx, err := db.BeginTx(ctx, nil)
		if err != nil {
			panic(err)
		}
		if err := tr.Publisher(tx).Publish(topic, message.NewMessage(uuid.NewString(), []byte(payload))); err != nil {
			panic(err)
		}
		if commit {
			err = tx.Commit()
		} else {
			err = tx.Rollback()
		}
		if err != nil {
			panic(err)
		}
	}
	publishIn(false, "invoice 1 (rolled back)")
	publishIn(true, "garbage")
	publishIn(true, "invoice 2")

	fmt.Println("handled:", <-handled)
	if err := router.Stop(); err != nil { // drains: what was handled commits
		panic(err)
	}
	dead, err := tr.DeadLetters(ctx, transport.DeadLetterFilter{Topic: topic})
	if err != nil {
		panic(err)
	}
	for _, d := range dead {
		fmt.Printf("dead letter: %s after %d attempt(s)\n", d.PayloadPreview, d.Attempts)
	}
	// Output:
	// handled: invoice 2
	// dead letter: garbage after 1 attempt(s)
}
