// Package dbtx is the plumbing around the one database interface pgsaga's
// packages take (delivery.DBTX, where users name it): batched writes,
// pipelines, batch key claims.
package dbtx

import (
	"context"
	"errors"
	"fmt"

	"github.com/pgsaga/pgsaga/saga/delivery"
)

// DBTX runs statements: a transaction, a connection or a pool.
type DBTX = delivery.DBTX

// Batched is a kind of write whose rows, queued by the attempts of one
// delivery batch, are written together, in one statement, when the batch
// ends (right before its commit). It is for writes nothing in the batch
// reads back: what the rows change is not visible before then.
type Batched struct {
	// Name says what the write does, in errors.
	Name string
	// Statement returns the one statement that writes rows, each the
	// values of one QueueBatched call, in the order they were queued.
	Statement func(rows [][]any) (query string, args []any)
}

// BatchQueuer is offered by the transaction of a delivery attempt (see
// QueueBatched).
type BatchQueuer interface {
	// QueueBatched queues one row of w. It commits with the attempt or
	// not at all: a rolled-back attempt or savepoint drops its rows, and a
	// failure to write them fails the batch, whose messages are then
	// delivered one a batch.
	QueueBatched(w *Batched, row ...any) error
	// BatchedPending reports whether rows kept attempts of the batch
	// queued are still unwritten: a row of theirs this attempt reads would
	// look as it did before them (see ErrBatchedPending).
	BatchedPending() bool
}

// ErrBatchedPending is returned by a handler that found a row an earlier
// attempt of its batch changed with a batched write not written yet (an
// idempotency key claimed but its completion queued): the transport writes
// the batch's rows and runs the attempt again, once. It never reaches
// users: only an attempt of a delivery batch can see such a row, and the
// transport takes the error.
var ErrBatchedPending = errors.New("rows an earlier attempt of the batch queued are not written yet")

// WriteBatched queues rows of w on tx if tx is a BatchQueuer, and writes
// them in one statement otherwise: queued, if tx is a Queuer, else at
// once.
func WriteBatched(ctx context.Context, tx DBTX, w *Batched, rows ...[]any) error {
	if len(rows) == 0 {
		return nil
	}
	if q, ok := tx.(BatchQueuer); ok {
		for _, row := range rows {
			if err := q.QueueBatched(w, row...); err != nil {
				return fmt.Errorf("%s: %w", w.Name, err)
			}
		}
		return nil
	}
	query, args := w.Statement(rows)
	return Queue(ctx, tx, w.Name, query, args...)
}

// Column returns column i of rows as a []T. A value of another type is a
// mistake of the write's caller: it panics, saying which.
func Column[T any](rows [][]any, i int) []T {
	out := make([]T, len(rows))
	for r, row := range rows {
		v, ok := row[i].(T)
		if !ok {
			panic(fmt.Sprintf("dbtx: column %d of row %d is a %T, not a %T", i, r, row[i], v))
		}
		out[r] = v
	}
	return out
}

// KeyClaims are the statements that claim the idempotency keys of a whole
// delivery batch up front, in one statement, and give back, when the batch
// ends, the claims no attempt completed.
type KeyClaims struct {
	// Claim returns the statement that claims keys (scopes[i], keys[i]
	// with hashes[i]), skipping those that exist, and returns the scope
	// and key of each it claimed.
	Claim func(scopes, keys []string, hashes [][]byte) (query string, args []any)
	// GiveBack returns the statement that deletes the claims among
	// (scopes[i], keys[i]) that are still pending.
	GiveBack func(scopes, keys []string) (query string, args []any)
}

// BatchClaimer is offered by the transaction of a delivery attempt whose
// batch claimed keys up front (see KeyClaims).
type BatchClaimer interface {
	// ClaimedInBatch reports whether the batch claimed key of scope for
	// the attempt's message, or holds a claim of it nobody holds now (its
	// attempt failed): the claim is then the attempt's, with no statement.
	// rehash: the claim was made with another request hash than hash (a
	// middleware changed the message, or another message's claim was
	// freed), which the caller must store.
	ClaimedInBatch(scope, key string, hash []byte) (claimed, rehash bool)
}
