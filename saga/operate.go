package saga

import (
	"context"

	"github.com/google/uuid"
	"github.com/pgsaga/pgsaga/saga/delivery"
)

// What an operator does with sagas. A client need not be started, nor have
// a definition registered, to read them (Get, List, Counts) or ask the
// workers for a retry or cancellation (Ask): an operator's tool builds a
// client over the database and calls these. Retry and Cancel act here and
// now, and need the saga's definition (Register); Ask has a worker that
// has it act.

// Get returns saga id with its timeline; ErrNoSuchSaga if there is none. Its
// step is named by its definition if this client has it (Register), else
// as its timeline last named it.
func (c *Client) Get(ctx context.Context, id uuid.UUID) (Instance, error) {
	return c.engine.Get(ctx, id)
}

// List returns instances by status and age, least recently updated first.
func (c *Client) List(ctx context.Context, f Filter) ([]Instance, error) {
	return c.engine.List(ctx, f)
}

// Counts returns how many instances each saga type has in each status.
func (c *Client) Counts(ctx context.Context) (map[string]map[Status]int, error) {
	return c.engine.Counts(ctx)
}

// Retry gets a stuck or parked instance moving again:
//
//   - failed (a compensation could not be done): its compensation is sent
//     again under a fresh key (a new generation), so a participant that
//     stored a failure for the old key runs it anew; on success the saga
//     compensates on;
//   - running or compensating: the in-flight command is sent again now, with
//     its key, and its attempts start over (a running saga's own deadline,
//     Spec.Timeout, too).
//
// Completed and compensated instances are ErrNotRetryable, and so is an
// instance its definition cannot read (ErrDefinitionMismatch too).
func (c *Client) Retry(ctx context.Context, id uuid.UUID) error { return c.engine.Retry(ctx, id) }

// RetryTx is Retry in the caller's transaction.
func (c *Client) RetryTx(ctx context.Context, tx delivery.DBTX, id uuid.UUID) error {
	return c.engine.RetryTx(ctx, tx, id)
}

// Cancel compensates a running saga on purpose: the step in flight is
// compensated too (its action may have happened, or happen later: its
// compensation must be fenced, as after a deadline the engine gave up on),
// then the steps before it, last first; the saga ends compensated. The
// timeline says "cancelled" with reason. A saga compensating or
// compensated already is left as it is (nil); a completed or parked one is
// ErrNotCancellable, and so is one its definition cannot read
// (ErrDefinitionMismatch too).
func (c *Client) Cancel(ctx context.Context, id uuid.UUID, reason string) error {
	return c.engine.Cancel(ctx, id, reason)
}

// CancelTx is Cancel in the caller's transaction.
func (c *Client) CancelTx(ctx context.Context, tx delivery.DBTX, id uuid.UUID, reason string) error {
	return c.engine.CancelTx(ctx, tx, id, reason)
}

// Ask records an operator's request for saga id and publishes it to the
// workers, in one transaction: a worker whose engine knows the saga's
// definition carries it out at once (it is woken, not polled), in the
// delivery's transaction, and records the outcome (RequestStatuses). A
// client that runs no saga (an operator's tool) can ask. Asking again before the saga changed is the
// same request: it is carried out once. While its message is queued,
// asking again publishes nothing; once it is not (it was dead-lettered:
// no worker that knew the saga carried it out in its attempts), asking
// again publishes it again. A saga that does not exist is ErrNoSuchSaga.
func (c *Client) Ask(ctx context.Context, id uuid.UUID, kind RequestKind, reason string) (Request, error) {
	return ask(ctx, c.transport, c.db, id, kind, reason)
}

// RequestStatuses reads requests and their outcomes, by id, in one query;
// an id with no request is left out.
func (c *Client) RequestStatuses(ctx context.Context, ids []uuid.UUID) (map[uuid.UUID]Request, error) {
	return requestStatuses(ctx, c.db, ids)
}

// FixFilter returns f with its age (OlderThan) made a cutoff on the
// database's clock now (UpdatedBefore, the earlier of the two if f has
// one already), so that a selection paged through with SelectedIDs is
// the same sagas however long the paging takes: one started or moved on
// since is not in it.
func (c *Client) FixFilter(ctx context.Context, f Filter) (Filter, error) {
	return fixFilter(ctx, c.db, f)
}

// CountSelected counts the instances f selects, its Limit aside: those a
// request of each (Ask) would be asked of.
func (c *Client) CountSelected(ctx context.Context, f Filter) (int, error) {
	return countSelected(ctx, c.db, f)
}

// SelectedIDs lists the ids of the instances f selects that sort after
// after (uuid.Nil: from the first), in order, at most f.Limit (100 by
// default): the next batch of those to ask a request of.
func (c *Client) SelectedIDs(ctx context.Context, f Filter, after uuid.UUID) ([]uuid.UUID, error) {
	return selectedIDs(ctx, c.db, f, after)
}
