package steps

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/pgsaga/pgsaga/idempotency"
)

// CallTimeout bounds one outside call made with Call: its context ends
// then, and its outcome counts as unknown.
const CallTimeout = 30 * time.Second

// callLease is how long a Call's claim of its key lasts: past the call's
// bound by enough to record its answer, so that nobody takes the key over
// from a call that is still recording. A worker that dies mid-call leaves
// it to expire; the command's next delivery then calls again, with the same
// key.
const callLease = CallTimeout + 10*time.Second

// callWithin bounds the awaited work of a Call: waiting out another
// worker's claim of the key (at most callLease), then the call and its
// record.
const callWithin = callLease + CallTimeout + 5*time.Second

// callScope prefixes the scope of a step's calls in idempotency_keys.
const callScope = "steps.call:"

// Call calls an outside service (a payment gateway, a hotel's booking
// API) exactly once for the command being handled, and returns its
// answer: call gets the command's idempotency key (Tx.Key) to send along,
// and its answer is recorded, so that a redelivered command is answered
// from the record without calling again.
//
// Use it as a handler's first act, and return its error as it is:
//
//	booking, err := steps.Call(ctx, tx, func(ctx context.Context, key string) (Booking, error) {
//		return hotel.Book(ctx, key, cmd.Room) // Idempotency-Key: key
//	})
//	if err != nil {
//		return nil, err
//	}
//
// The call runs outside the step's transaction (see Await), at most
// CallTimeout, under a lease on the key in idempotency_keys (scope
// "steps.call:" and the step's name) that commits before it starts; its
// answer, encoded as JSON, is recorded when it returns, and the handler
// runs again and gets it. A second delivery of the command while the call
// runs waits for it; one after a worker died mid-call takes the key over
// once the lease ends and calls again with the same key, which the
// service must deduplicate (as idempotent APIs do with an
// Idempotency-Key).
//
// Return in R whatever the service decided, a refusal included (a
// declined card): it is recorded and answered from, and the handler turns
// it into its reply or a Fail. Return an error only when the outcome is
// unknown (a timeout, a 5xx): nothing is recorded, and the command is
// retried after its backoff, calling again with the same key; mark it
// Permanent for a request the service can never take (dead-lettered at
// once). R must survive a JSON round trip.
func Call[R any](ctx context.Context, tx *Tx, call func(ctx context.Context, key string) (R, error)) (R, error) {
	var zero R
	if call == nil {
		return zero, Permanent(errors.New("steps: Call needs a function"))
	}
	store := tx.rt.store
	req := idempotency.Request{Scope: callScope + tx.step.Name, Key: tx.key, Hash: idempotency.Fingerprint(tx.payload)}
	rec, err := store.GetTx(ctx, tx.DBTX, req.Scope, req.Key)
	switch {
	case err == nil && rec.Status == idempotency.StatusCompleted:
		var r R
		if err := json.Unmarshal(rec.Response.Body, &r); err != nil {
			return zero, Permanent(fmt.Errorf("steps: decoding the recorded answer of %s's call (key %s): %w", tx.step.Name, tx.key, err))
		}
		return r, nil
	case err != nil && !errors.Is(err, idempotency.ErrNoSuchKey):
		return zero, err
	}
	return zero, Await(callWithin, func(ctx context.Context) error { return callOnce(ctx, store, req, call) })
}

// callOnce is a Call's awaited work: claim req's key with a lease (after
// any other worker's lease of it), call, record the answer. A key already
// answered is left as it is: the handler's next run reads the answer.
func callOnce[R any](ctx context.Context, store *idempotency.Store, req idempotency.Request, call func(ctx context.Context, key string) (R, error)) error {
	poll := 50 * time.Millisecond
	for {
		acq, err := store.AcquireFor(ctx, req, callLease)
		var busy *idempotency.InProgressError
		if errors.As(err, &busy) {
			// Look again when the lease ends, or sooner: a holder that is
			// alive records its answer before then.
			if err := waitOut(ctx, busy, poll); err != nil {
				return err
			}
			poll = min(2*poll, time.Second)
			continue
		}
		if err != nil {
			return err
		}
		if acq.Record != nil {
			return nil
		}
		return callUnder(ctx, store, acq.Lease, call)
	}
}

// callUnder calls under lease and records the answer; an unknown outcome
// releases the lease, for the command's retry to call again at once.
func callUnder[R any](ctx context.Context, store *idempotency.Store, lease *idempotency.Lease, call func(ctx context.Context, key string) (R, error)) error {
	callCtx, cancel := context.WithTimeout(ctx, CallTimeout)
	r, err := call(callCtx, lease.Key)
	cancel()
	if err == nil {
		var body []byte
		if body, err = json.Marshal(r); err != nil {
			err = Permanent(fmt.Errorf("steps: encoding the answer of the call (key %s): %w", lease.Key, err))
		} else {
			err = store.CompleteLease(ctx, lease, idempotency.StatusCompleted, idempotency.Response{Code: 200, Body: body})
			if err == nil {
				return nil
			}
			// Lost to a takeover (the holder then records), or not
			// recorded: the next delivery reads or calls again.
			return fmt.Errorf("steps: recording the answer of the call (key %s): %w", lease.Key, err)
		}
	}
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer cancel()
	if rerr := store.ReleaseLease(rctx, lease); rerr != nil && !errors.Is(rerr, idempotency.ErrLeaseLost) {
		err = errors.Join(err, fmt.Errorf("steps: releasing the lease of a call whose outcome is unknown: %w", rerr))
	}
	return err
}

// waitOut waits until busy's lease has ended (its RetryAfter, on the
// database's clock), or poll if that is sooner, or a moment when an open
// transaction holds the key.
func waitOut(ctx context.Context, busy *idempotency.InProgressError, poll time.Duration) error {
	wait := 50 * time.Millisecond
	if busy.RetryAfter > 0 {
		wait = min(busy.RetryAfter+20*time.Millisecond, poll)
	}
	t := time.NewTimer(wait)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return fmt.Errorf("steps: waiting out another worker's call (key %s): %w", busy.Key, ctx.Err())
	}
}
