package steps

import (
	"context"
	"database/sql"
	"time"

	"github.com/pgsaga/pgsaga/internal/dbtx"
	"github.com/pgsaga/pgsaga/internal/transport"
	"github.com/pgsaga/pgsaga/saga/delivery"
)

// What a step's handler touches of delivery. Delivery itself (queues,
// consumers, attempts, dead letters) is the client's, behind its config
// (saga.ClientConfig.Transport).

// Queue runs a write that nothing reads back in tx's transaction (a view
// row, an audit line) the cheapest way tx allows: in a step's or a
// delivery's transaction, and in the transaction of idempotency.Store.Do
// on a pgx pool, it is queued and sent with the transaction's next
// statement or its end, in the same round trip; on any other DBTX it runs
// at once. Either way it commits with the transaction or not at all, and
// its failure fails the transaction (a Savepoint's, if it was queued in
// one). name says what the write does, in its error.
func Queue(ctx context.Context, tx delivery.DBTX, name, query string, args ...any) error {
	return dbtx.Queue(ctx, tx, name, query, args...)
}

// InTx runs fn in a READ COMMITTED transaction of its own on db, and
// commits it if fn returns nil; fn's error, or that of a write it queued,
// rolls it back and is returned. It is for a participant's writes that
// must commit apart from its step's transaction: a reservation committed
// before an external call, the call's answer recorded after it. On a pgx
// pool (pgx's database/sql driver, as pgsaga opens pools) BEGIN goes with
// fn's first statement and what fn queues (Queue) with its next statement
// or the commit, each group in one round trip. A queued statement's row
// count is never read: queue only what nothing decides on, and check
// what a queued lock took in the statement after it (the sample's
// ledger reads the locked row back). Its own errors (beginning,
// committing) start with "steps: ".
func InTx(ctx context.Context, db *sql.DB, fn func(tx delivery.DBTX) error) error {
	return dbtx.InTx(ctx, db, "steps", fn)
}

// Permanent marks err as permanent: the command is dead-lettered at once
// instead of retried. Permanent(nil) is nil. For a refusal the sender must
// hear of (insufficient funds), use Fail: a business failure is answered.
func Permanent(err error) error { return transport.Permanent(err) }

// IsPermanent reports whether no retry can change how err ended a
// delivery: a permanent error (Permanent), a business failure (Fail), a
// command that cannot be decoded, a key reused for another command, or
// bytes PostgreSQL can never store.
func IsPermanent(err error) bool { return transport.IsPermanent(err) }

// Await is what a handler returns when its work must wait on something
// outside the database, such as a call to a payment gateway, that must not
// hold a transaction open. The step's writes so far are rolled back, call
// runs outside any transaction within the given bound, and then the
// handler runs again (Awaited reports true) and finds what call recorded.
//
// A queued command's batch goes on meanwhile, and runs the handler again
// before it commits if the call returned within its hold
// (delivery.Config.AwaitHold); else it is handed back; a call
// that fails counts as a failed attempt (retried, then dead-lettered); if
// the process dies the command comes back after within. A command awaited
// more times than its retry policy's attempts ends in a dead letter. A
// call with no function or no positive bound is a permanent failure.
func Await(within time.Duration, call func(ctx context.Context) error) error {
	return transport.Await(within, call)
}

// Awaited reports whether the handler runs right after its awaited call
// returned (see Await): what the call recorded is there to read, and the
// handler can answer from it without doing again what led to the call.
func Awaited(ctx context.Context) bool { return transport.AwaitedFromContext(ctx) }
