// The same saga step as testdata/mismatch, sending the charge step its own
// command type: it compiles (TestASagaSendsAStepOnlyItsCommandType).
package main

import (
	"github.com/pgsaga/pgsaga/payments"
	"github.com/pgsaga/pgsaga/saga"
)

type data struct{ Charge payments.ChargePayment }

func main() {
	_ = saga.Send(payments.Charge, func(d data) payments.ChargePayment { return d.Charge })
}
