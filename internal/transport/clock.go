package transport

import (
	"context"
	"fmt"
	"time"
)

// dbClock is the database server's clock as a transaction read it once:
// db, at the local time local, whose monotonic reading measures what has
// elapsed since. The transport's transactions read it with their first
// statement (the claim, or the bounds of a transaction of its own), so
// that what is decided in them (a deadline, a command's not-after) is
// decided on the database's clock, whatever the worker's says, at no
// statement of its own.
type dbClock struct{ db, local time.Time }

// now is the database's time now, if the clock was read.
func (c dbClock) now() (time.Time, bool) {
	if c.db.IsZero() {
		return time.Time{}, false
	}
	return c.db.Add(time.Since(c.local)), true
}

// readClock is a dbClock read now from db, the server's time.
func readClock(db time.Time) dbClock { return dbClock{db: db, local: time.Now()} }

// DBNow returns the database server's time now, as the transaction of tx
// knows it, if tx is a delivery attempt's (or one of the transport's own
// transactions): the time the transaction read with its first statement
// and what has elapsed since, on this process's monotonic clock. It is
// false for any other transaction (a caller's own): use Now.
func DBNow(tx Tx) (time.Time, bool) {
	a, ok := tx.(*attemptTx)
	if !ok || a.d == nil {
		return time.Time{}, false
	}
	return a.d.clock.now()
}

// nowSQL reads the server's clock.
const nowSQL = `SELECT clock_timestamp()`

// Now returns the database server's time now for tx: DBNow where the
// transport knows it, else read in tx (one statement). Every deadline,
// timeout and cutoff pgsaga computes is on this clock, never the
// worker's: the two may differ by any amount.
func Now(ctx context.Context, tx Tx) (time.Time, error) {
	if t, ok := DBNow(tx); ok {
		return t, nil
	}
	var t time.Time
	if err := tx.QueryRowContext(ctx, nowSQL).Scan(&t); err != nil {
		return time.Time{}, fmt.Errorf("transport: reading the database's clock: %w", err)
	}
	return t, nil
}
