package transport

import (
	"context"
	"encoding/json"
	"fmt"

	"github.com/pgsaga/pgsaga/internal/dbtx"
)

// Batched writes (see dbtx.Batched): what an attempt queues with
// QueueBatched is held by the attempt until it is kept, then by its batch,
// and written, one statement per kind for the whole batch, right before
// the batch may commit. A transaction of the transport's own (HandleInTx,
// a request's) writes them with the attempt that keeps them.

// batchedRow is one queued row of a batched write.
type batchedRow struct {
	w      *dbtx.Batched
	values []any
}

var _ dbtx.BatchQueuer = (*attemptTx)(nil)

// QueueBatched queues one row of w; see dbtx.BatchQueuer.
func (a *attemptTx) QueueBatched(w *dbtx.Batched, row ...any) error {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.over {
		return ErrAttemptOver
	}
	a.batched = append(a.batched, batchedRow{w: w, values: cloneArgs(row)})
	return nil
}

// BatchedPending reports whether kept attempts of the batch left rows
// unwritten; see dbtx.BatchQueuer.
func (a *attemptTx) BatchedPending() bool { return a.d != nil && len(a.d.batched) > 0 }

// batchedStatements returns the statements that write rows: one a kind,
// in the order each kind was first queued. A write whose statement cannot
// be built (a row of the wrong shape: a bug) is an error, not a panic.
func batchedStatements(rows []batchedRow) (stmts []stmt, err error) {
	if len(rows) == 0 {
		return nil, nil
	}
	defer func() {
		if p := recover(); p != nil {
			err = Recovered("building a batched write", p)
		}
	}()
	var order []*dbtx.Batched
	byKind := map[*dbtx.Batched][][]any{}
	for _, r := range rows {
		if _, ok := byKind[r.w]; !ok {
			order = append(order, r.w)
		}
		byKind[r.w] = append(byKind[r.w], r.values)
	}
	for _, w := range order {
		q, args := w.Statement(byKind[w])
		stmts = append(stmts, stmt{name: w.Name, query: q, args: args})
	}
	return stmts, nil
}

// writeBatched writes the rows the batch's kept attempts queued, in the
// transaction (a savepoint opened ahead for an attempt that will not come
// is released first: what is written belongs to the transaction), and
// appends after (statements to send in the same round trip).
func (d *deliveryTx) writeBatched(ctx context.Context, after ...stmt) error {
	stmts, err := batchedStatements(d.batched)
	if err != nil {
		return err
	}
	d.batched = nil
	if d.spOpen {
		stmts = append([]stmt{{"closing the unused attempt", releaseAttemptSQL, nil}}, stmts...)
		d.spOpen = false
	}
	return d.c.send(ctx, append(stmts, after...)...)
}

// ackWrite deletes delivered messages from their queue.
var ackWrite = &dbtx.Batched{
	Name: "removing delivered messages from their queue",
	Statement: func(rows [][]any) (string, []any) {
		return ackManySQL, []any{dbtx.Column[int64](rows, 0)}
	},
}

// parkWrite hands messages back while their handlers' calls run, or
// untouched (HandBack): a row is the queue id, the park in seconds, the
// count of awaits or hand-backs (text), the reason and the metadata key
// the count goes under (metaAwaited, metaHandedBack).
var parkWrite = &dbtx.Batched{
	Name: "handing messages back",
	Statement: func(rows [][]any) (string, []any) {
		return parkManySQL, []any{dbtx.Column[int64](rows, 0), dbtx.Column[float64](rows, 1),
			dbtx.Column[string](rows, 2), dbtx.Column[string](rows, 3), dbtx.Column[string](rows, 4)}
	},
}

// publishWrite queues published messages for their topics' groups: a row
// is topic, uuid, payload, metadata (JSON text) and the groups that
// handled it in process (a JSON array).
var publishWrite = &dbtx.Batched{
	Name: "publishing",
	Statement: func(rows [][]any) (string, []any) {
		return publishManySQL, []any{dbtx.Column[string](rows, 0), dbtx.Column[string](rows, 1), dbtx.Column[[]byte](rows, 2),
			dbtx.Column[string](rows, 3), dbtx.Column[string](rows, 4), dbtx.Column[string](rows, 5)}
	},
}

// queuePublishQuery queues the rows of a publish whose statement
// InsertQuery made (args: topic, uuids, payloads, metadata, wake-up
// channel, groups that handled them), for every group but skip (nil: as
// args say).
func (a *attemptTx) queuePublishQuery(args []any, skip []string) error {
	topic, _ := args[0].(string)
	uuids, ok1 := args[1].([]string)
	payloads, ok2 := args[2].([][]byte)
	metadata, ok3 := args[3].([]string)
	channel, ok4 := args[4].(string)
	if skip == nil {
		skip, _ = args[5].([]string)
	}
	if !ok1 || !ok2 || !ok3 || !ok4 || len(payloads) != len(uuids) || len(metadata) != len(uuids) {
		return fmt.Errorf("transport: publishing to %s: the publish statement's arguments are not InsertQuery's", topic)
	}
	if skip == nil {
		skip = []string{}
	}
	skipped, err := json.Marshal(skip)
	if err != nil {
		return fmt.Errorf("transport: publishing to %s: %w", topic, err)
	}
	for i := range uuids {
		if err := a.QueueBatched(publishWrite, topic, uuids[i], payloads[i], metadata[i], string(skipped), channel); err != nil {
			return fmt.Errorf("transport: publishing to %s: %w", topic, err)
		}
	}
	return nil
}

// PendingBatched returns the newest row of w for which match reports true
// among those queued in the transaction of tx and not written yet: by the
// attempt running on tx, by the attempts it is delivered in process from,
// and by the kept attempts of its batch. It is how a handler reads back
// what its own transaction will write, such as a saga instance saved by
// an earlier reaction of the same chain: a row taken back (its attempt or
// savepoint rolled back) is gone, and one written early (see
// ErrBatchedPending) is in the database and no longer pending. ok is
// false outside a delivery attempt.
func PendingBatched(tx Tx, w *dbtx.Batched, match func(row []any) bool) (row []any, ok bool) {
	a, isAttempt := tx.(*attemptTx)
	if !isAttempt {
		return nil, false
	}
	for at := a; at != nil; at = at.parent {
		if row, ok := at.pendingRow(w, match); ok {
			return row, true
		}
	}
	if a.d == nil {
		return nil, false
	}
	return newestRow(a.d.batched, w, match)
}

// pendingRow is the newest row of w matching match that a queued.
func (a *attemptTx) pendingRow(w *dbtx.Batched, match func(row []any) bool) ([]any, bool) {
	a.mu.Lock()
	defer a.mu.Unlock()
	return newestRow(a.batched, w, match)
}

func newestRow(rows []batchedRow, w *dbtx.Batched, match func(row []any) bool) ([]any, bool) {
	for i := len(rows) - 1; i >= 0; i-- {
		if rows[i].w == w && match(rows[i].values) {
			return rows[i].values, true
		}
	}
	return nil, false
}
