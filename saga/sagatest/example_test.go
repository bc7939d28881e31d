package sagatest_test

import (
	"context"
	"database/sql"
	"fmt"
	"time"

	"github.com/google/uuid"

	"github.com/pgsaga/pgsaga/internal/testdb"
	"github.com/pgsaga/pgsaga/saga"
	"github.com/pgsaga/pgsaga/saga/delivery"
	"github.com/pgsaga/pgsaga/saga/sagatest"
	"github.com/pgsaga/pgsaga/steps"
)

// Your saga: reserve a room, then send a confirmation.

type Booked struct {
	Guest string `json:"guest"`
}

func (Booked) MessageType() string { return "hotel.Booked" }

type ReserveRoom struct {
	Guest string `json:"guest"`
}

func (ReserveRoom) MessageType() string { return "hotel.ReserveRoom" }

type RoomReserved struct{}

func (RoomReserved) MessageType() string { return "hotel.RoomReserved" }

type booking struct {
	Guest string `json:"guest"`
}

// Testing your own saga's failure recovery: build your app with the
// Injector as the transport's Intercept, run it on churning workers, wait
// for the sagas, and check the invariants, yours included.
func Example() {
	ctx := context.Background()
	db := testdb.ForExample().SQL
	suffix := uuid.NewString()[:8]
	rooms := "rooms_" + suffix
	if _, err := db.Exec(`CREATE TABLE ` + rooms + ` (guest text NOT NULL)`); err != nil {
		panic(err)
	}

	// 1. Faults: duplicates, crashes at both commit boundaries, killed
	// connections; reproducible from the seed.
	injector, err := sagatest.NewInjector(db, sagatest.Faults{
		Seed: 42, DuplicateRate: 0.5, CrashBeforeCommitRate: 0.1, CrashAfterCommitRate: 0.1, KillConnectionRate: 0.05,
	}, quiet)
	if err != nil {
		panic(err)
	}

	// 2. Your app, as you build it, with the injector installed.
	client, err := saga.NewClientFromDB(db, saga.ClientConfig{
		Transport: delivery.Config{Intercept: injector.Intercept}, Logger: quiet})
	if err != nil {
		panic(err)
	}
	reserve := steps.Define("hotel.reserve-"+suffix, "hotel.reserve."+suffix, func(ctx context.Context, tx *steps.Tx, cmd ReserveRoom) (steps.Message, error) {
		_, err := tx.ExecContext(ctx, `INSERT INTO `+rooms+` VALUES ($1)`, cmd.Guest)
		return RoomReserved{}, err
	})
	def := saga.MustDefine(saga.Spec[booking]{
		Name:    "hotel-" + suffix,
		Trigger: saga.On("hotel.booked."+suffix, func(b Booked) (string, booking, error) { return b.Guest, booking(b), nil }),
		Steps:   []saga.Step[booking]{{Name: "reserve", Action: saga.Send(reserve, func(b booking) ReserveRoom { return ReserveRoom(b) })}},
	})
	if err := client.Register(def); err != nil {
		panic(err)
	}
	if err := client.AddSteps(reserve); err != nil {
		panic(err)
	}
	// Record who consumes what before anything is published; the churn
	// below runs the client's workers instead of Start.
	if err := client.Setup(ctx); err != nil {
		panic(err)
	}
	newWorker := func() (sagatest.Worker, error) { return client.NewWorker() }

	// 3. Two workers, stopped and replaced at random.
	churn, err := sagatest.StartChurn(sagatest.ChurnConfig{Workers: 2, New: newWorker, Seed: 42, Logger: quiet})
	if err != nil {
		panic(err)
	}
	var ids []uuid.UUID
	for _, guest := range []string{"ada", "bob", "cy"} {
		msg, err := steps.NewMessage(Booked{Guest: guest}, steps.Envelope{})
		if err != nil {
			panic(err)
		}
		if err := client.PublishTx(context.Background(), db, def.Trigger, msg); err != nil {
			panic(err)
		}
		ids = append(ids, saga.ID(def.Name, guest))
	}

	// 4. Wait for every saga, stop, and check.
	counts, err := sagatest.WaitTerminal(ctx, db, ids, time.Minute)
	if err != nil {
		panic(err)
	}
	churn.Calm()
	if err := churn.Stop(); err != nil {
		panic(err)
	}
	if err := injector.Close(); err != nil {
		panic(err)
	}
	violations, err := sagatest.Checker{
		DB: db, Definitions: []*saga.Definition{def},
		Domain: []sagatest.Invariant{{
			Name: "one room per guest",
			Check: func(ctx context.Context, db *sql.DB) ([]string, error) {
				return sagatest.Rows(ctx, db, `SELECT guest FROM `+rooms+` GROUP BY guest HAVING count(*) <> 1`)
			},
		}},
	}.Check(ctx)
	if err != nil {
		panic(err)
	}
	fmt.Println("completed:", counts[saga.StatusCompleted])
	fmt.Println("violations:", violations)
	// Output:
	// completed: 3
	// violations: []
}
