package idempotency

import (
	"errors"

	"github.com/pgsaga/pgsaga/internal/outcome"
)

// The errors the package returns, for errors.Is.
var (
	// ErrInProgress is returned by a claim when another transaction holds
	// the key beyond lock_timeout, or a two-phase claim's lease is still
	// running (an *InProgressError says until when).
	ErrInProgress = errors.New("idempotency: a request with this key is in progress")
	// ErrKeyReused is returned by a claim when the key was first used with
	// a different request; it is permanent: no retry can change it.
	ErrKeyReused = outcome.New(outcome.Permanent, "idempotency: key reused with a different request")
	// ErrConflict is returned by a claim when, under REPEATABLE READ or
	// SERIALIZABLE, it raced a concurrent claim (or the key vanished under
	// it): retry the transaction from the start.
	ErrConflict = errors.New("idempotency: claim raced a concurrent claim; retry in a new transaction")
	// ErrLeaseLost is returned by CompleteLease (and CompleteLeaseTx) when
	// the lease was taken over by another worker: its outcome stands, not
	// this one's.
	ErrLeaseLost = errors.New("idempotency: lease lost; another worker took the key over")
	// ErrNotClaimed is returned when completing a key that has no pending
	// claim of this transaction to complete (claimed in another one, or
	// never).
	ErrNotClaimed = errors.New("idempotency: key has no pending claim to complete")
	// ErrNothingToFinish is returned by FinishTx for a claim that does not
	// run (a duplicate: its outcome is stored already) or that was
	// finished already.
	ErrNothingToFinish = errors.New("idempotency: the claim's outcome is stored already")
	// ErrNoSuchKey is returned by Get when no key has the scope and key
	// asked for.
	ErrNoSuchKey = errors.New("idempotency: key not found")
	// ErrInvalidRequest is returned for a request or a configuration the
	// store cannot take: a scope or key of the wrong length, a missing
	// hash, a negative bound, an HTTPConfig without its Caller.
	ErrInvalidRequest = errors.New("idempotency: invalid request")
	// ErrInvalidKey is the reason a request's Idempotency-Key is refused
	// with 400 by the HTTP middleware (see ParseKey).
	ErrInvalidKey = errors.New("idempotency: invalid " + KeyHeader)
	// ErrResponseTooLarge is returned by ResponseWriter.Write to a handler
	// behind HTTPMiddleware once its response body outgrows
	// HTTPConfig.MaxResponseBytes.
	ErrResponseTooLarge = errors.New("idempotency: response body larger than HTTPConfig.MaxResponseBytes")
)
