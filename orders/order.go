// Package orders is the sample order domain: an event-sourced order (placed,
// confirmed, cancelled), the Place entry point for clients, the confirm and
// cancel steps the saga drives, a customer's own cancellation, and the
// order_views read model.
//
// An order is the stream "order-<id>" in the event store. Its state is only
// ever the fold of that stream; order_views is a projection of it that can be
// rebuilt from scratch.
package orders

import (
	"errors"
	"fmt"
	"time"

	"github.com/google/uuid"

	"github.com/pgsaga/pgsaga/steps/events"
)

// Status of an order.
type Status string

// Statuses, as stored in order_views.status.
const (
	StatusPlaced    Status = "placed"
	StatusConfirmed Status = "confirmed"
	StatusCancelled Status = "cancelled"
)

// Who cancelled an order.
const (
	ByCustomer = "customer"
	BySaga     = "saga"
)

// Topics of the domain.
const (
	// CreatedTopic carries OrderCreated, the saga's trigger.
	CreatedTopic = "orders.created"
	// ConfirmTopic and CancelTopic carry the saga's commands.
	ConfirmTopic = "orders.confirm"
	CancelTopic  = "orders.cancel"
	// EventsTopic carries the order streams' events, for the projection.
	EventsTopic = "orders.events"
)

// Names of the steps (their idempotency scopes and consumer groups).
const (
	ConfirmStepName = "orders.confirm"
	CancelStepName  = "orders.cancel"
)

// Events of an order stream.

// Placed starts an order's stream.
type Placed struct {
	OrderID     uuid.UUID `json:"order_id"`
	CustomerID  string    `json:"customer_id"`
	AmountCents int64     `json:"amount_cents"`
	Note        string    `json:"note,omitempty"`
}

// EventType implements events.Event: the type name in the event store.
func (Placed) EventType() string { return "orders.placed" }

// Confirmed: the order was paid for and is final.
type Confirmed struct{}

// EventType implements events.Event: the type name in the event store.
func (Confirmed) EventType() string { return "orders.confirmed" }

// Cancelled: by the customer, or by the saga's compensation.
type Cancelled struct {
	By     string `json:"by"`
	Reason string `json:"reason,omitempty"`
}

// EventType implements events.Event: the type name in the event store.
func (Cancelled) EventType() string { return "orders.cancelled" }

// RegisterEvents adds the order events to reg.
func RegisterEvents(reg *events.Registry) error {
	return errors.Join(
		events.Register[Placed](reg),
		events.Register[Confirmed](reg),
		events.Register[Cancelled](reg),
	)
}

// Stream is the event stream of an order.
func Stream(id uuid.UUID) string { return "order-" + id.String() }

// StreamTopic routes order streams' events to EventsTopic, for
// events.Config.Topic; it returns "" for other streams.
func StreamTopic(stream string) string {
	if len(stream) > len("order-") && stream[:len("order-")] == "order-" {
		return EventsTopic
	}
	return ""
}

// Order is the state of an order: the fold of its stream.
type Order struct {
	ID           uuid.UUID
	CustomerID   string
	AmountCents  int64
	Note         string
	Status       Status
	Version      int
	PlacedAt     time.Time
	ConfirmedAt  time.Time
	CancelledAt  time.Time
	CancelledBy  string
	CancelReason string
	UpdatedAt    time.Time
}

// Apply folds one event into the order.
func (o *Order) Apply(r events.Recorded) error {
	switch e := r.Data.(type) {
	case Placed:
		if o.Version != 0 {
			return fmt.Errorf("order placed twice")
		}
		o.ID, o.CustomerID, o.AmountCents, o.Note = e.OrderID, e.CustomerID, e.AmountCents, e.Note
		o.Status, o.PlacedAt = StatusPlaced, r.RecordedAt
	case Confirmed:
		if o.Status != StatusPlaced {
			return fmt.Errorf("confirming an order that is %s", o.Status)
		}
		o.Status, o.ConfirmedAt = StatusConfirmed, r.RecordedAt
	case Cancelled:
		if o.Status == StatusCancelled {
			return fmt.Errorf("cancelling an order twice")
		}
		o.Status, o.CancelledAt, o.CancelledBy, o.CancelReason = StatusCancelled, r.RecordedAt, e.By, e.Reason
	default:
		return fmt.Errorf("unexpected event %s in an order stream", r.Type)
	}
	o.Version, o.UpdatedAt = r.Version, r.RecordedAt
	return nil
}

// Messages the domain sends and answers.

// OrderCreated is published when an order is placed: the saga's trigger.
type OrderCreated struct {
	OrderID     uuid.UUID `json:"order_id"`
	CustomerID  string    `json:"customer_id"`
	AmountCents int64     `json:"amount_cents"`
}

// MessageType implements steps.Message: the type name on the wire.
func (OrderCreated) MessageType() string { return "orders.OrderCreated" }

// ConfirmOrder asks to confirm a placed order.
type ConfirmOrder struct {
	OrderID uuid.UUID `json:"order_id"`
}

// MessageType implements steps.Message: the type name on the wire.
func (ConfirmOrder) MessageType() string { return "orders.ConfirmOrder" }

// OrderConfirmed answers ConfirmOrder.
type OrderConfirmed struct {
	OrderID uuid.UUID `json:"order_id"`
}

// MessageType implements steps.Message: the type name on the wire.
func (OrderConfirmed) MessageType() string { return "orders.OrderConfirmed" }

// ConfirmRejected answers ConfirmOrder when the order cannot be confirmed
// (the customer cancelled it first, or it does not exist).
type ConfirmRejected struct {
	OrderID uuid.UUID `json:"order_id"`
	Reason  string    `json:"reason"`
}

// MessageType implements steps.Message: the type name on the wire.
func (ConfirmRejected) MessageType() string { return "orders.ConfirmRejected" }

// CancelOrder asks to cancel an order (the saga's compensation).
type CancelOrder struct {
	OrderID uuid.UUID `json:"order_id"`
	Reason  string    `json:"reason,omitempty"`
}

// MessageType implements steps.Message: the type name on the wire.
func (CancelOrder) MessageType() string { return "orders.CancelOrder" }

// OrderCancelled answers CancelOrder; AlreadyCancelled when it was.
type OrderCancelled struct {
	OrderID          uuid.UUID `json:"order_id"`
	AlreadyCancelled bool      `json:"already_cancelled,omitempty"`
}

// MessageType implements steps.Message: the type name on the wire.
func (OrderCancelled) MessageType() string { return "orders.OrderCancelled" }

// CancelRejected answers CancelOrder for an order that does not exist.
type CancelRejected struct {
	OrderID uuid.UUID `json:"order_id"`
	Reason  string    `json:"reason"`
}

// MessageType implements steps.Message: the type name on the wire.
func (CancelRejected) MessageType() string { return "orders.CancelRejected" }
