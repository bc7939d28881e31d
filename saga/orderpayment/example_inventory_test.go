package orderpayment_test

import (
	"context"
	"database/sql"
	"fmt"
	"strings"
	"time"

	"github.com/google/uuid"

	"github.com/pgsaga/pgsaga/internal/testdb"
	"github.com/pgsaga/pgsaga/orders"
	"github.com/pgsaga/pgsaga/payments/fakegateway"
	"github.com/pgsaga/pgsaga/saga"
	"github.com/pgsaga/pgsaga/saga/orderpayment"
	"github.com/pgsaga/pgsaga/steps"
)

// The inventory participant's messages.

type ReserveStock struct {
	OrderID uuid.UUID `json:"order_id"`
	SKU     string    `json:"sku"`
}

func (ReserveStock) MessageType() string { return "inventory.ReserveStock" }

type StockReserved struct {
	OrderID uuid.UUID `json:"order_id"`
}

func (StockReserved) MessageType() string { return "inventory.StockReserved" }

type OutOfStock struct {
	SKU string `json:"sku"`
}

func (OutOfStock) MessageType() string { return "inventory.OutOfStock" }

type ReleaseStock struct {
	OrderID uuid.UUID `json:"order_id"`
	SKU     string    `json:"sku"`
}

func (ReleaseStock) MessageType() string { return "inventory.ReleaseStock" }

type StockReleased struct {
	OrderID uuid.UUID `json:"order_id"`
}

func (StockReleased) MessageType() string { return "inventory.StockReleased" }

// inventory is the new participant: two steps over a stock table. The step
// runtime makes each command run once per key, in the step's transaction.
type inventory struct{ table string }

func (inv inventory) reserve(ctx context.Context, tx *steps.Tx, cmd ReserveStock) (steps.Message, error) {
	res, err := tx.ExecContext(ctx, `UPDATE `+inv.table+` SET on_hand = on_hand - 1 WHERE sku = $1 AND on_hand > 0`, cmd.SKU)
	if err != nil {
		return nil, err // transient: retried
	}
	if n, _ := res.RowsAffected(); n == 0 {
		return nil, steps.Fail(OutOfStock{SKU: cmd.SKU}, "out of stock") // final: the saga compensates
	}
	return StockReserved{OrderID: cmd.OrderID}, nil
}

func (inv inventory) release(ctx context.Context, tx *steps.Tx, cmd ReleaseStock) (steps.Message, error) {
	if _, err := tx.ExecContext(ctx, `UPDATE `+inv.table+` SET on_hand = on_hand + 1 WHERE sku = $1`, cmd.SKU); err != nil {
		return nil, err
	}
	return StockReleased{OrderID: cmd.OrderID}, nil
}

// Adding a third step, reserve inventory (compensation: release it), to the
// order-payment saga: a participant, a step appended to the saga's steps,
// and a new definition version. Nothing in saga/, steps/ or idempotency/
// changes.
func Example_addInventoryStep() {
	ctx := context.Background()
	db := testdb.ForExample().SQL
	suffix := uuid.NewString()[:8]
	inv := inventory{table: "stock_" + suffix}
	mustExec(db, `CREATE TABLE `+inv.table+` (sku text PRIMARY KEY, on_hand int NOT NULL)`)
	mustExec(db, `INSERT INTO `+inv.table+` VALUES ('the-book', 1)`) // one copy left

	// 1. The participant's steps, on topics of their own.
	reserveTopic, releaseTopic := "inventory.reserve."+suffix, "inventory.release."+suffix
	reserveStock := steps.Define("inventory.reserve", reserveTopic, inv.reserve)
	releaseStock := steps.Define("inventory.release", releaseTopic, inv.release)

	// 2. The saga's steps, with reserve inserted before confirm.
	base := orderpayment.Steps(orderpayment.StepTimeouts{})
	reserve := saga.Step[orderpayment.Data]{
		Name: "reserve",
		Action: saga.Send(reserveStock, func(d orderpayment.Data) ReserveStock {
			return ReserveStock{OrderID: d.OrderID, SKU: "the-book"}
		}),
		Compensation: saga.Send(releaseStock, func(d orderpayment.Data) ReleaseStock {
			return ReleaseStock{OrderID: d.OrderID, SKU: "the-book"}
		}),
	}
	extended := append(append(base[:2:2], reserve), base[2:]...) // order, charge, reserve, confirm

	// 3. The app with the new steps, and the participants on its Client.
	gateway, err := fakegateway.Start(ctx, fakegateway.Config{DB: db})
	if err != nil {
		panic(err)
	}
	defer gateway.Close()
	app, err := orderpayment.New(orderpayment.Config{
		DB: db, GatewayURL: gateway.URL(),
		Steps:           extended,
		Version:         2,                              // the steps changed
		FinishedChannel: "inventory_finished_" + suffix, // for WaitFinished
	})
	if err != nil {
		panic(err)
	}
	if err := app.Client.AddSteps(reserveStock, releaseStock); err != nil {
		panic(err)
	}
	if err := app.Client.Start(ctx); err != nil {
		panic(err)
	}
	defer app.Client.Stop(context.Background()) //nolint:errcheck

	customer := "reader-" + suffix
	if err := app.Orders.AddCustomer(ctx, customer, "A Reader"); err != nil {
		panic(err)
	}
	if err := app.Payments.OpenAccount(ctx, customer); err != nil {
		panic(err)
	}
	if err := app.Payments.Deposit(ctx, customer, 10_000, "seed"); err != nil {
		panic(err)
	}

	for _, name := range []string{"first order", "second order"} {
		placed, err := app.Orders.Place(ctx, orders.PlaceRequest{Key: name, CustomerID: customer, AmountCents: 2_000})
		if err != nil {
			panic(err)
		}
		waitCtx, cancel := context.WithTimeout(ctx, 30*time.Second)
		inst, err := app.Client.WaitFinished(waitCtx, saga.ID(orderpayment.Name, placed.OrderID.String()))
		cancel()
		if err != nil {
			panic(err)
		}
		fmt.Println(strings.TrimSpace(fmt.Sprintf("%s: %s %s", name, inst.Status, inst.FailureReason)))
	}
	var onHand int
	if err := db.QueryRow(`SELECT on_hand FROM ` + inv.table).Scan(&onHand); err != nil {
		panic(err)
	}
	balance, err := app.Payments.Balance(ctx, customer)
	if err != nil {
		panic(err)
	}
	fmt.Printf("copies left: %d; balance: $%.2f (one book paid for, the other refunded)\n", onHand, float64(balance)/100)
	// Output:
	// first order: completed
	// second order: compensated reserve: out of stock
	// copies left: 0; balance: $80.00 (one book paid for, the other refunded)
}

func mustExec(db *sql.DB, q string) {
	if _, err := db.Exec(q); err != nil {
		panic(err)
	}
}
