// Package outcome is pgsaga's one vocabulary for how handling a message or
// a request ended, shared by the idempotency store, the step runtime, the
// transport and the saga engine:
//
//   - Completed: done; its effects commit with it.
//   - BusinessFailure: understood and refused for good (insufficient
//     funds, an order already cancelled): the refusal is stored and
//     answered, the handler's writes are rolled back, and it is never
//     retried.
//   - Transient: it may succeed later (a lock timeout, a lost
//     connection, a version conflict): everything is rolled back and it is
//     retried with backoff, then dead-lettered.
//   - Permanent: no retry can fix it (a message that cannot be decoded, a
//     key reused for another request): dead-lettered at once.
//
// Errors say which by implementing Classifier; each package's constructors
// (steps.Fail, idempotency.Reject, transport.Permanent, …) return such
// errors. Of classifies any error.
package outcome

import (
	"errors"

	"github.com/pgsaga/pgsaga/saga/delivery"
)

// Kind is how handling ended: delivery.Outcome, where users name it.
type Kind = delivery.Outcome

// Kinds.
const (
	Completed       = delivery.Completed
	BusinessFailure = delivery.BusinessFailure
	Transient       = delivery.Transient
	Permanent       = delivery.Permanent
)

// Classifier is an error that knows its outcome.
type Classifier interface {
	error
	Outcome() Kind
}

// Of returns the outcome of err: Completed for nil, else that of the first
// error in its chain that is a Classifier, else Transient.
func Of(err error) Kind {
	if err == nil {
		return Completed
	}
	var c Classifier
	if errors.As(err, &c) {
		return c.Outcome()
	}
	return Transient
}

// Final reports whether err ends handling for good: a business failure or
// a permanent error, which no retry changes.
func Final(err error) bool {
	k := Of(err)
	return k == BusinessFailure || k == Permanent
}

// New returns an error with message msg and outcome kind, for sentinel
// errors (compare them with errors.Is).
func New(kind Kind, msg string) error { return &kindError{kind: kind, msg: msg} }

type kindError struct {
	kind Kind
	msg  string
}

func (e *kindError) Error() string { return e.msg }

// Outcome implements Classifier.
func (e *kindError) Outcome() Kind { return e.kind }
