package orders

import (
	"errors"

	"github.com/pgsaga/pgsaga/idempotency"
)

// The errors Place returns, each wrapped with details, for errors.Is.
var (
	// ErrMissingKey is returned by Place for a request without an
	// idempotency key.
	ErrMissingKey = errors.New("orders: missing idempotency key")
	// ErrKeyTooLong is returned by Place for a key longer than 255 bytes.
	ErrKeyTooLong = errors.New("orders: idempotency key longer than 255 bytes")
	// ErrInvalidCustomerID is returned by Place (and AddCustomer) for an id
	// that is not 1 to 64 letters, digits, '_', '.' or '-'.
	ErrInvalidCustomerID = errors.New("orders: invalid customer id")
	// ErrUnknownCustomer is returned by Place for a customer never added.
	ErrUnknownCustomer = errors.New("orders: unknown customer")
	// ErrInvalidAmount is returned by Place for an amount that is not
	// positive.
	ErrInvalidAmount = errors.New("orders: amount must be positive")
	// ErrAmountTooLarge is returned by Place for an amount over
	// MaxAmountCents.
	ErrAmountTooLarge = errors.New("orders: amount too large")
	// ErrNoteTooLong is returned by Place for a note over MaxNoteBytes.
	ErrNoteTooLong = errors.New("orders: note too long")
	// ErrMalformedRequest is returned by DecodePlaceRequest for bytes that
	// are not one JSON PlaceRequest, and by Place for a key or note that is
	// not printable UTF-8.
	ErrMalformedRequest = errors.New("orders: malformed request")
	// ErrRequestTooLarge is returned by DecodePlaceRequest for a request
	// over MaxRequestSize bytes.
	ErrRequestTooLarge = errors.New("orders: request too large")
	// ErrKeyReused is returned by Place when the key was used for a
	// different order (it is idempotency.ErrKeyReused).
	ErrKeyReused = idempotency.ErrKeyReused
)

// The errors of CancelByCustomer and Order.
var (
	// ErrOrderNotFound is returned when no order (or, for View, no view of
	// it yet) has the id asked for.
	ErrOrderNotFound = errors.New("orders: order not found")
	// ErrAlreadyConfirmed is returned by CancelByCustomer for an order that
	// was confirmed: it can no longer be cancelled.
	ErrAlreadyConfirmed = errors.New("orders: order already confirmed; it can no longer be cancelled")
)
