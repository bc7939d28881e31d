// Package orderpayment is the sample saga: OrderCreated → charge the
// customer's payment (compensation: refund) → confirm the order
// (compensation: cancel it), with the order itself as a step done by the
// trigger whose compensation cancels it. So insufficient funds cancels the
// order with nothing charged, and a customer's cancellation that wins the
// race against confirmation is answered with a refund, then a cancel.
//
// App wires the whole sample (transport, idempotency, events, the orders and
// payments domains, the saga engine) over one database, for the demo, the
// benchmark and tests; extend the saga by adding steps to Steps().
package orderpayment

import (
	"time"

	"github.com/google/uuid"

	"github.com/pgsaga/pgsaga/orders"
	"github.com/pgsaga/pgsaga/payments"
	"github.com/pgsaga/pgsaga/payments/fakegateway"
	"github.com/pgsaga/pgsaga/saga"
)

// Name of the saga type.
const Name = "order-payment"

// Data is the saga's state.
type Data struct {
	OrderID     uuid.UUID `json:"order_id"`
	AccountID   string    `json:"account_id"`
	AmountCents int64     `json:"amount_cents"`
	ChargeID    string    `json:"charge_id,omitempty"`
}

// StepTimeouts sets the deadline and attempts of every step.
type StepTimeouts struct {
	// Deadline to wait for a reply before sending again. Default: 10s.
	Deadline time.Duration
	// MaxAttempts of a command before giving up on it. Default: 3.
	MaxAttempts int
	// CompensationDeadline and CompensationAttempts of compensations, which
	// may wait for a slow action to finish first (a refund waits for its
	// charge). Defaults: 30s and 5.
	CompensationDeadline time.Duration
	CompensationAttempts int
	// Saga is the saga's own deadline (saga.Spec.Timeout): its actions'
	// commands carry it as their not-after, past which the payment service
	// refuses a charge unrun, and the saga gives up on an action only a
	// deadline after it. So a participant down for less than this delays
	// sagas and refunds nothing. Default: saga.TimeoutDefault (24h).
	Saga time.Duration
}

// Steps returns the saga's steps, in order: order (done by the trigger;
// compensation: cancel), charge (compensation: refund), confirm
// (compensation: cancel). Append steps to extend the saga.
func Steps(t StepTimeouts) []saga.Step[Data] {
	t = applyDefaults(t)
	cancel := saga.Send(orders.Cancel, func(d Data) orders.CancelOrder {
		return orders.CancelOrder{OrderID: d.OrderID, Reason: "the payment saga compensated"}
	})
	return []saga.Step[Data]{
		{
			Name:                 "order",
			Compensation:         cancel,
			CompensationDeadline: t.CompensationDeadline,
			CompensationAttempts: t.CompensationAttempts,
		},
		{
			Name: "charge",
			Action: saga.OnReply(saga.Send(payments.Charge, func(d Data) payments.ChargePayment {
				return payments.ChargePayment{OrderID: d.OrderID, AccountID: d.AccountID, AmountCents: d.AmountCents}
			}), func(d *Data, charged payments.PaymentCharged) error {
				d.ChargeID = charged.ChargeID
				return nil
			}),
			Compensation: saga.Send(payments.Refund, func(d Data) payments.RefundPayment {
				return payments.RefundPayment{OrderID: d.OrderID, AccountID: d.AccountID}
			}),
			Deadline:             t.Deadline,
			MaxAttempts:          t.MaxAttempts,
			CompensationDeadline: t.CompensationDeadline,
			CompensationAttempts: t.CompensationAttempts,
		},
		{
			Name:                 "confirm",
			Action:               saga.Send(orders.Confirm, func(d Data) orders.ConfirmOrder { return orders.ConfirmOrder{OrderID: d.OrderID} }),
			Compensation:         cancel,
			Deadline:             t.Deadline,
			MaxAttempts:          t.MaxAttempts,
			CompensationDeadline: t.CompensationDeadline,
			CompensationAttempts: t.CompensationAttempts,
		},
	}
}

// Spec is the saga's specification with the given steps (Steps(), maybe
// extended).
func Spec(s []saga.Step[Data]) saga.Spec[Data] {
	return saga.Spec[Data]{
		Name:    Name,
		Version: 1,
		// A customer pays from the account with the customer's id.
		Trigger: saga.On(orders.CreatedTopic, func(created orders.OrderCreated) (string, Data, error) {
			return created.OrderID.String(), Data{OrderID: created.OrderID, AccountID: created.CustomerID, AmountCents: created.AmountCents}, nil
		}),
		Steps: s,
	}
}

// GatewayFaults returns fake-gateway faults for chaos runs of the sample: a
// share rate of calls is slow, unavailable, or loses its answer after
// acting, and charges may be declined. Refunds are never declined: a
// declined refund is a business dead end that parks the saga for a person,
// not a fault to recover from.
func GatewayFaults(seed uint64, rate float64) func(fakegateway.Call) fakegateway.Fault {
	random := fakegateway.RandomFaults(seed, rate, fakegateway.Slow, fakegateway.Unavailable, fakegateway.Lost, fakegateway.Decline)
	return func(c fakegateway.Call) fakegateway.Fault {
		f := random(c)
		if f == fakegateway.Decline && c.Op != "charge" {
			return fakegateway.Unavailable
		}
		return f
	}
}

func applyDefaults(t StepTimeouts) StepTimeouts {
	if t.Deadline == 0 {
		t.Deadline = 10 * time.Second
	}
	if t.MaxAttempts == 0 {
		t.MaxAttempts = 3
	}
	if t.CompensationDeadline == 0 {
		t.CompensationDeadline = 30 * time.Second
	}
	if t.CompensationAttempts == 0 {
		t.CompensationAttempts = 5
	}
	return t
}
