// A saga step that sends the charge step a command of another type: it
// must not compile (TestASagaSendsAStepOnlyItsCommandType).
package main

import (
	"github.com/pgsaga/pgsaga/orders"
	"github.com/pgsaga/pgsaga/payments"
	"github.com/pgsaga/pgsaga/saga"
)

type data struct{ Order orders.ConfirmOrder }

func main() {
	_ = saga.Send(payments.Charge, func(d data) orders.ConfirmOrder { return d.Order })
}
