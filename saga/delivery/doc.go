// Package delivery holds what users touch of how pgsaga delivers
// messages, shared by every other package of the module, as River keeps
// rivertype: the delivery settings (Config, RetryPolicy), the database
// interface steps and stores take (DBTX), how handling a message ended
// (Outcome), dead letters and their filters, consumer groups and
// subscriptions, and the errors the delivery returns (errors.go).
//
// It has no behaviour of its own: the saga client (package saga), the
// participants' steps (package steps) and the stores (idempotency,
// steps/events) take and return these types.
package delivery
