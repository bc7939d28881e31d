package payments

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/google/uuid"

	"github.com/pgsaga/pgsaga/idempotency"
	"github.com/pgsaga/pgsaga/steps"
	"github.com/pgsaga/pgsaga/steps/transport"
)

// charge takes an order's amount from an account: the ledger first (lock the
// account, check the balance), then the gateway under a lease, then the
// posting, its event and the lease's completion in the step's transaction.
func (s *Service) charge(ctx context.Context, tx *steps.Tx, cmd ChargePayment) (_ steps.Message, err error) {
	fail := func(reason string) error {
		return steps.Fail(PaymentFailed{OrderID: cmd.OrderID, Reason: reason}, reason)
	}
	if cmd.AmountCents <= 0 || cmd.OrderID == uuid.Nil || !accountIDPattern.MatchString(cmd.AccountID) {
		return nil, fail(ReasonInvalidCharge)
	}
	version, err := lockAccount(ctx, tx, s.cfg.Events, cmd.AccountID)
	if errors.Is(err, ErrUnknownAccount) {
		return nil, fail(ReasonUnknownAccount)
	}
	if err != nil {
		return nil, err
	}
	// Charged already, under another key: the ledger allows one charge per
	// order, so answer with that one.
	if delta, ref, found, err := orderPosting(ctx, tx, cmd.AccountID, cmd.OrderID, "charge"); err != nil || found {
		return PaymentCharged{OrderID: cmd.OrderID, AmountCents: -delta, ChargeID: ref}, err
	}
	var balance int64
	if err := tx.QueryRowContext(ctx, balanceSQL, cmd.AccountID).Scan(&balance); err != nil {
		return nil, fmt.Errorf("payments: balance of %s: %w", cmd.AccountID, err)
	}
	if balance < cmd.AmountCents {
		return nil, fail(ReasonInsufficientFunds)
	}

	chargeID, err := s.gatewayCall(ctx, "charge", tx.Key(), cmd.AccountID, cmd.OrderID, cmd.AmountCents,
		func(ctx context.Context) (string, error) {
			return s.cfg.Gateway.Charge(ctx, tx.Key(), cmd.AccountID, cmd.AmountCents)
		})
	if errors.Is(err, ErrDeclined) {
		return nil, fail(ReasonDeclined)
	}
	if err != nil {
		return nil, err
	}
	recs, err := tx.Append(ctx, Stream(cmd.AccountID), version, Charged{OrderID: cmd.OrderID, AmountCents: cmd.AmountCents, ChargeID: chargeID})
	if err != nil {
		return nil, err
	}
	if _, err := tx.ExecContext(ctx, insertPostingSQL, cmd.AccountID, recs[0].ID, -cmd.AmountCents, cmd.OrderID, "charge", chargeID); err != nil {
		return nil, fmt.Errorf("payments: posting charge of %s: %w", cmd.OrderID, err)
	}
	return PaymentCharged{OrderID: cmd.OrderID, AmountCents: cmd.AmountCents, ChargeID: chargeID}, nil
}

// refund returns what was charged for an order, once. An order that was
// never charged (or an unknown account) is a no-op success.
func (s *Service) refund(ctx context.Context, tx *steps.Tx, cmd RefundPayment) (_ steps.Message, err error) {
	nothing := PaymentRefunded{OrderID: cmd.OrderID}
	if cmd.OrderID == uuid.Nil || !accountIDPattern.MatchString(cmd.AccountID) {
		return nothing, nil
	}
	version, err := lockAccount(ctx, tx, s.cfg.Events, cmd.AccountID)
	if errors.Is(err, ErrUnknownAccount) {
		return nothing, nil
	}
	if err != nil {
		return nil, err
	}
	charged, chargeID, found, err := orderPosting(ctx, tx, cmd.AccountID, cmd.OrderID, "charge")
	if err != nil || !found {
		return nothing, err
	}
	amount := -charged
	if refunded, refundID, found, err := orderPosting(ctx, tx, cmd.AccountID, cmd.OrderID, "refund"); err != nil || found {
		return PaymentRefunded{OrderID: cmd.OrderID, AmountCents: refunded, RefundID: refundID, Already: true}, err
	}

	refundID, err := s.gatewayCall(ctx, "refund", tx.Key(), cmd.AccountID, cmd.OrderID, amount,
		func(ctx context.Context) (string, error) {
			return s.cfg.Gateway.Refund(ctx, tx.Key(), cmd.AccountID, chargeID, amount)
		})
	if err != nil {
		// A refund the gateway declines needs a person: retried, then
		// dead-lettered, and the saga reports it.
		return nil, err
	}
	recs, err := tx.Append(ctx, Stream(cmd.AccountID), version, Refunded{OrderID: cmd.OrderID, AmountCents: amount, RefundID: refundID})
	if err != nil {
		return nil, err
	}
	if _, err := tx.ExecContext(ctx, insertPostingSQL, cmd.AccountID, recs[0].ID, amount, cmd.OrderID, "refund", refundID); err != nil {
		return nil, fmt.Errorf("payments: posting refund of %s: %w", cmd.OrderID, err)
	}
	return PaymentRefunded{OrderID: cmd.OrderID, AmountCents: amount, RefundID: refundID}, nil
}

func orderPosting(ctx context.Context, tx *steps.Tx, account string, order uuid.UUID, kind string) (delta int64, ref string, found bool, err error) {
	var r sql.NullString
	err = tx.QueryRowContext(ctx, orderPostingSQL, account, order, kind).Scan(&delta, &r)
	if errors.Is(err, sql.ErrNoRows) {
		return 0, "", false, nil
	}
	if err != nil {
		return 0, "", false, fmt.Errorf("payments: reading %s of %s: %w", kind, order, err)
	}
	return delta, r.String, true, nil
}

// gatewayCall runs call at most once per (op, key) at the gateway's end and
// returns the gateway's operation id. Phase one commits a lease before the
// call, with the step's key passed downstream; phase two records the
// gateway's answer at once, in a transaction of its own fenced on the lease.
//
// Phase two cannot wait for the step's transaction: a subscriber's batch
// runs at REPEATABLE READ and cannot see a lease committed after its
// snapshot. Nor does it need to: the record says what the gateway did, which
// stays true if the step's transaction rolls back; the step's retry then
// replays it and posts it.
//
// A lease left by a worker that died after calling is waited out (at most
// GatewayLease) and taken over: the call is repeated with the same key and
// the gateway answers with its first result. An unknown outcome (a timeout,
// a 5xx) is never recorded: the lease is released, so the step's next
// attempt calls again at once.
func (s *Service) gatewayCall(ctx context.Context, op, key, account string, order uuid.UUID, amount int64,
	call func(context.Context) (string, error)) (string, error) {
	req := GatewayRequest(op, key, account, order, amount)
	giveUp := time.Now().Add(2 * s.cfg.GatewayLease)
	for {
		acq, err := s.cfg.Idempotency.AcquireFor(ctx, req, s.cfg.GatewayLease)
		var busy *idempotency.InProgressError
		if errors.As(err, &busy) {
			wait := 50 * time.Millisecond
			if !busy.LockedUntil.IsZero() {
				wait = max(time.Until(busy.LockedUntil)+20*time.Millisecond, 5*time.Millisecond)
			}
			if time.Now().Add(wait).After(giveUp) {
				return "", err
			}
			s.cfg.Logger.Info("waiting for the lease of an earlier gateway call", "op", op, "key", key, "wait", wait)
			select {
			case <-time.After(wait):
				continue
			case <-ctx.Done():
				return "", ctx.Err()
			}
		}
		if err != nil {
			return "", err
		}
		if rec := acq.Record; rec != nil {
			if rec.Status == idempotency.StatusFailed {
				return "", fmt.Errorf("%w (recorded earlier)", ErrDeclined)
			}
			return string(rec.Response.Body), nil
		}
		id, err := call(ctx)
		switch {
		case err == nil:
			if err := s.cfg.Idempotency.CompleteLease(ctx, acq.Lease, idempotency.StatusCompleted, idempotency.Response{Code: 200, Body: []byte(id)}); err != nil {
				// Lost to a takeover (this call outlived its lease) or a
				// database error: the next attempt replays or calls again.
				return "", fmt.Errorf("payments: recording gateway %s %s: %w", op, id, err)
			}
			return id, nil
		case errors.Is(err, ErrDeclined):
			if cerr := s.cfg.Idempotency.CompleteLease(ctx, acq.Lease, idempotency.StatusFailed, idempotency.Response{Body: []byte(err.Error())}); cerr != nil {
				s.cfg.Logger.Warn("recording a declined gateway call", "op", op, "key", key, "err", cerr)
			}
			return "", err
		default:
			if rerr := s.cfg.Idempotency.ReleaseLease(ctx, acq.Lease); rerr != nil {
				s.cfg.Logger.Warn("releasing the lease of a failed gateway call", "op", op, "key", key, "err", rerr)
			}
			if errors.Is(err, ErrBadGatewayRequest) {
				return "", transport.Permanent(err)
			}
			return "", err
		}
	}
}

// GatewayRequest is the idempotency claim of one gateway call: op is
// "charge" or "refund", key the step's key (also the gateway's
// Idempotency-Key). Operators use it to find a call's lease.
func GatewayRequest(op, key, account string, order uuid.UUID, amount int64) idempotency.Request {
	return idempotency.Request{
		Scope: "payments.gateway." + op,
		Key:   key,
		Hash:  idempotency.Fingerprint([]byte(op), []byte(account), []byte(order.String()), []byte(strconv.FormatInt(amount, 10))),
	}
}
