package events_test

import (
	"context"
	"errors"
	"fmt"

	"github.com/google/uuid"

	"github.com/pgsaga/pgsaga/internal/testdb"
	"github.com/pgsaga/pgsaga/saga/delivery"
	"github.com/pgsaga/pgsaga/steps"
	"github.com/pgsaga/pgsaga/steps/events"
)

type Deposited struct {
	Cents int64 `json:"cents"`
}

func (Deposited) EventType() string { return "example.Deposited" }

type Withdrawn struct {
	Cents int64 `json:"cents"`
}

func (Withdrawn) EventType() string { return "example.Withdrawn" }

// wallet is an aggregate: the state folded from its stream.
type wallet struct{ balance int64 }

func (a *wallet) Apply(r events.Recorded) error {
	switch e := r.Data.(type) {
	case Deposited:
		a.balance += e.Cents
	case Withdrawn:
		a.balance -= e.Cents
	}
	return nil
}

// Append events to a stream at the version you read, in your transaction,
// and fold them back into state. A writer that read an older version is
// refused (ErrVersionConflict): it retries on fresh state.
func Example() {
	ctx := context.Background()
	db := testdb.ForExample().SQL
	reg := events.NewRegistry()
	events.MustRegister[Deposited](reg)
	events.MustRegister[Withdrawn](reg)
	store, err := events.NewStore(events.Config{Registry: reg})
	if err != nil {
		panic(err)
	}
	stream := "account-" + uuid.NewString()

	if _, err := store.AppendTx(ctx, db, stream, 0, events.Metadata{}, Deposited{Cents: 10_000}); err != nil {
		panic(err)
	}
	var acc wallet
	version, err := store.FoldTx(ctx, db, stream, 0, &acc)
	if err != nil {
		panic(err)
	}
	fmt.Println("balance", acc.balance, "at version", version)

	if _, err := store.AppendTx(ctx, db, stream, version, events.Metadata{}, Withdrawn{Cents: 2_500}); err != nil {
		panic(err)
	}
	// A second writer that also read version 1 is refused.
	_, err = store.AppendTx(ctx, db, stream, version, events.Metadata{}, Withdrawn{Cents: 9_000})
	fmt.Println("stale writer refused:", errors.Is(err, events.ErrVersionConflict))

	acc = wallet{}
	version, err = store.FoldTx(ctx, db, stream, 0, &acc)
	if err != nil {
		panic(err)
	}
	fmt.Println("balance", acc.balance, "at version", version)
	// Output:
	// balance 10000 at version 1
	// stale writer refused: true
	// balance 7500 at version 2
}

// Append without reading anything back when a lock serializes the
// stream's writers: in a transaction of steps.InTx, the append is sent
// with the commit, in the same round trip.
func ExampleStore_QueueAppendTx() {
	ctx := context.Background()
	db := testdb.ForExample().SQL
	reg := events.NewRegistry()
	events.MustRegister[Deposited](reg)
	events.MustRegister[Withdrawn](reg)
	store, err := events.NewStore(events.Config{Registry: reg})
	if err != nil {
		panic(err)
	}
	stream := "account-" + uuid.NewString()

	err = steps.InTx(ctx, db, func(tx delivery.DBTX) error {
		// Every writer of the stream takes this lock first (the sample's
		// ledger locks the account's row).
		if _, err := tx.ExecContext(ctx, `SELECT pg_advisory_xact_lock(hashtext($1))`, stream); err != nil {
			return err
		}
		ids, err := store.QueueAppendTx(ctx, tx, stream, events.Metadata{}, Deposited{Cents: 10_000}, Withdrawn{Cents: 2_500})
		fmt.Println("queued", len(ids), "events")
		return err
	})
	if err != nil {
		panic(err)
	}
	var acc wallet
	version, err := store.FoldTx(ctx, db, stream, 0, &acc)
	if err != nil {
		panic(err)
	}
	fmt.Println("balance", acc.balance, "at version", version)
	// Output:
	// queued 2 events
	// balance 7500 at version 2
}
