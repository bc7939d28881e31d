package payments

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgerrcode"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/pgsaga/pgsaga/idempotency"
	"github.com/pgsaga/pgsaga/saga/delivery"
	"github.com/pgsaga/pgsaga/steps"
	"github.com/pgsaga/pgsaga/steps/events"
)

// refusal is a charge the ledger or the gateway refused: a business failure.
type refusal struct{ reason string }

func (r *refusal) Error() string { return r.reason }

// errBusy: the order is being charged under another key right now.
var errBusy = errors.New("payments: the order is being charged by another command")

// charge takes an order's amount from an account: reserve (claim the gateway
// call and post the charge, committed), call the gateway with the step's
// key, record the answer. The call and its record run outside the step's
// transaction (steps.Await): the step hands its command back while
// they run, and its next run finds the answer recorded and replies. The
// step's own transaction only carries the reply.
func (s *Service) charge(ctx context.Context, tx *steps.Tx, cmd ChargePayment) (steps.Message, error) {
	if cmd.AmountCents <= 0 || cmd.OrderID == uuid.Nil || !accountIDPattern.MatchString(cmd.AccountID) {
		return nil, steps.Fail(PaymentFailed{OrderID: cmd.OrderID, Reason: ReasonInvalidCharge}, ReasonInvalidCharge)
	}
	req := GatewayRequest("charge", tx.Key(), cmd.AccountID, cmd.OrderID, cmd.AmountCents)
	if steps.Awaited(ctx) {
		// The call this run awaited recorded the gateway's answer: reply
		// from it, kept by this process or read in the step's
		// transaction, without reserving again.
		if ans, ok := s.answers.take(keyHash{req.Key, req.Hash}); ok {
			return ans.reply(cmd)
		}
		if reply, found, err := s.recordedCharge(ctx, tx, req, cmd); found || err != nil {
			return reply, err
		}
	}
	lease, chargeID, err := s.reserve(ctx, req, cmd)
	if err == nil && lease != nil {
		return nil, steps.Await(s.cfg.GatewayLease, func(ctx context.Context) error {
			_, err := s.capture(ctx, lease, cmd)
			return answered(err)
		})
	}
	if busy := (*idempotency.InProgressError)(nil); errors.As(err, &busy) {
		return nil, s.afterLease(busy, "charge", func(ctx context.Context) error { return s.chargeCall(ctx, req, cmd) })
	}
	var ref *refusal
	if errors.As(err, &ref) {
		return nil, steps.Fail(PaymentFailed{OrderID: cmd.OrderID, Reason: ref.reason}, ref.reason)
	}
	if err != nil {
		return nil, err
	}
	return PaymentCharged{OrderID: cmd.OrderID, AmountCents: cmd.AmountCents, ChargeID: chargeID}, nil
}

// recordedCharge reads the finished gateway call of req, the charge's, if
// there is one (found), and answers from it: the charge, or its decline (a
// business failure). The step's claim has checked that the command is the
// key's (same payload, so same account, order and amount).
func (s *Service) recordedCharge(ctx context.Context, tx *steps.Tx, req idempotency.Request, cmd ChargePayment) (reply steps.Message, found bool, err error) {
	rec, err := s.cfg.Idempotency.GetTx(ctx, tx, req.Scope, req.Key)
	if errors.Is(err, idempotency.ErrNoSuchKey) || (err == nil && !rec.Finished()) {
		return nil, false, nil // reaped, or not finished: the usual way decides
	}
	if err != nil {
		return nil, false, err
	}
	body := string(rec.Response.Body)
	if rec.Status == idempotency.StatusFailed {
		return nil, true, steps.Fail(PaymentFailed{OrderID: cmd.OrderID, Reason: body}, body)
	}
	return PaymentCharged{OrderID: cmd.OrderID, AmountCents: cmd.AmountCents, ChargeID: body}, true, nil
}

// reply is the charge's reply from a recorded gateway call: charged, or
// declined (a business failure).
func (a answer) reply(cmd ChargePayment) (steps.Message, error) {
	if a.declined {
		return nil, steps.Fail(PaymentFailed{OrderID: cmd.OrderID, Reason: ReasonDeclined}, ReasonDeclined)
	}
	return PaymentCharged{OrderID: cmd.OrderID, AmountCents: cmd.AmountCents, ChargeID: a.chargeID}, nil
}

// chargeCall reserves the charge of req and, unless an earlier call
// finished it, calls the gateway under its lease and records the answer:
// the awaited call of a charge that found req's key leased (a refusal is
// nil: the handler's next run finds it again, or its record, and answers).
func (s *Service) chargeCall(ctx context.Context, req idempotency.Request, cmd ChargePayment) error {
	lease, _, err := s.reserve(ctx, req, cmd)
	if err == nil && lease != nil {
		_, err = s.capture(ctx, lease, cmd)
	}
	return answered(err)
}

// answered is the error an awaited gateway call ends with: nil once the
// gateway's decline is recorded (or the ledger refused), for the handler's
// next run to answer from; the failure otherwise.
func answered(err error) error {
	if errors.As(err, new(*refusal)) {
		return nil
	}
	return err
}

// afterLease is what a handler returns when the gateway call of its key is
// leased by another worker: one killed mid-call, or one still calling. The
// lease is waited out in an awaited call (steps.Await), outside the
// delivery's transaction, so the batch goes on with its other commands;
// then call runs in the same awaited call: it takes the key over, or finds
// its answer recorded, and the handler's next run answers from that.
func (s *Service) afterLease(busy *idempotency.InProgressError, op string, call func(ctx context.Context) error) error {
	wait := leaseWait(busy)
	s.cfg.Logger.Info("waiting for the lease of an earlier gateway call", "op", op, "key", busy.Key, "wait", wait)
	return steps.Await(wait+2*s.cfg.GatewayLease, func(ctx context.Context) error {
		return s.pastLeases(ctx, min(wait, leasePoll), call)
	})
}

// pastLeases runs call after wait, and again while it finds its key held
// by another worker's lease, until ctx ends. It looks again at most
// leasePoll after the last look (from 50 ms, doubling), however long the
// lease has left: a holder that is alive finishes early, and its answer is
// then taken at once instead of at the end of its lease. Only an awaited
// call waits so: nothing of a delivery batch waits on a lease.
func (s *Service) pastLeases(ctx context.Context, wait time.Duration, call func(ctx context.Context) error) error {
	poll := 50 * time.Millisecond
	for {
		t := time.NewTimer(wait)
		select {
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
			return fmt.Errorf("payments: waiting out the lease of an earlier gateway call: %w", ctx.Err())
		}
		err := call(ctx)
		var busy *idempotency.InProgressError
		if !errors.As(err, &busy) {
			return err
		}
		wait, poll = min(leaseWait(busy), poll), min(2*poll, leasePoll)
	}
}

// leasePoll bounds how long pastLeases waits between two looks at a key.
const leasePoll = time.Second

// leaseWait is how long to wait before claiming busy's key again: until its
// lease runs out, by the database's clock; a moment when an open
// transaction holds it.
func leaseWait(busy *idempotency.InProgressError) time.Duration {
	if busy.RetryAfter <= 0 {
		return 50 * time.Millisecond
	}
	return busy.RetryAfter + 20*time.Millisecond
}

// reserve is phase one, in a transaction of its own: claim the gateway call
// with a lease and post the charge, unless an earlier attempt did. It returns
// the lease to call under, or the charge id of a finished call.
func (s *Service) reserve(ctx context.Context, req idempotency.Request, cmd ChargePayment) (*idempotency.Lease, string, error) {
	var (
		lease    *idempotency.Lease
		chargeID string
	)
	err := s.inTx(ctx, func(tx delivery.DBTX) error {
		acq, err := s.cfg.Idempotency.AcquireTx(ctx, tx, req, s.cfg.GatewayLease)
		if err != nil {
			return err
		}
		if rec := acq.Record; rec != nil {
			if rec.Status == idempotency.StatusFailed {
				return &refusal{reason: string(rec.Response.Body)}
			}
			chargeID = string(rec.Response.Body)
			return nil
		}
		if err := queueLock(ctx, tx, cmd.AccountID); err != nil {
			return err
		}
		led, err := readReservation(ctx, tx, cmd.AccountID, cmd.OrderID)
		if err != nil {
			return err
		}
		if !led.account {
			return &refusal{reason: ReasonUnknownAccount}
		}
		if led.fenced {
			// The order's payment was compensated before this charge got
			// here: it must never happen.
			return &refusal{reason: ReasonAbandoned}
		}
		// A finished charge is final, whoever asks and under whatever key.
		// These cases come before "our own reservation" because a key can
		// come back after the idempotency reaper removed it (a late
		// redelivery), and the gateway may have forgotten it too: calling
		// it again would charge a second time.
		switch {
		case led.charged && led.voided:
			// Declined and given back: declined for good.
			return &refusal{reason: ReasonDeclined}
		case led.charged && led.ref != "":
			// Captured (under this key or another): the ledger allows one
			// charge per order; answer with it and call nobody.
			chargeID = led.ref
			return s.cfg.Idempotency.CompleteLeaseTx(ctx, tx, acq.Lease, idempotency.StatusCompleted, idempotency.Response{Code: 200, Body: []byte(led.ref)})
		case led.charged && led.owner == req.Key:
			// Reserved by an earlier attempt whose call did not finish: ask
			// the gateway again with the same key.
		case led.charged:
			return fmt.Errorf("%w (%s, reserved by %s, %d cents)", errBusy, cmd.OrderID, led.owner, -led.delta)
		default:
			if led.balance < cmd.AmountCents {
				return &refusal{reason: ReasonInsufficientFunds}
			}
			md := events.Metadata{CorrelationID: cmd.OrderID.String(), IdempotencyKey: req.Key}
			ids, err := s.cfg.Events.QueueAppendTx(ctx, tx, Stream(cmd.AccountID), md, Charged{OrderID: cmd.OrderID, AmountCents: cmd.AmountCents})
			if err != nil {
				return err
			}
			err = steps.Queue(ctx, tx, "payments: reserving the charge of "+cmd.OrderID.String(), insertPostingSQL,
				cmd.AccountID, ids[0], -cmd.AmountCents, cmd.OrderID, "charge", nil, req.Key)
			if err != nil {
				return err
			}
		}
		lease = acq.Lease
		return nil
	})
	if violates(err, oneChargeIndex) {
		// The order is charged to another account (the lookup above is per
		// account, as is the account's lock): a command that can never
		// succeed, so a business failure, not a retry. The posting is
		// queued: its violation comes with the commit.
		return nil, "", &refusal{reason: ReasonChargedElsewhere}
	}
	if err != nil {
		return nil, "", err
	}
	return lease, chargeID, nil
}

// capture calls the gateway under lease and records its answer: captured,
// voided on a decline, nothing on an unknown outcome.
func (s *Service) capture(ctx context.Context, lease *idempotency.Lease, cmd ChargePayment) (string, error) {
	id, err := s.cfg.Gateway.Charge(ctx, lease.Key, cmd.AccountID, cmd.OrderID, cmd.AmountCents)
	switch {
	case err == nil:
		var captured string // the reference the ledger held already
		err := s.inTx(ctx, func(tx delivery.DBTX) error {
			if err := s.cfg.Idempotency.CompleteLeaseTx(ctx, tx, lease, idempotency.StatusCompleted, idempotency.Response{Code: 200, Body: []byte(id)}); err != nil {
				return err
			}
			if err := queueLock(ctx, tx, cmd.AccountID); err != nil {
				return err
			}
			res, err := tx.ExecContext(ctx, captureSQL, cmd.AccountID, cmd.OrderID, id)
			if err != nil {
				return fmt.Errorf("payments: capturing the charge of %s: %w", cmd.OrderID, err)
			}
			n, err := res.RowsAffected()
			if err != nil {
				return fmt.Errorf("payments: capturing the charge of %s: %w", cmd.OrderID, err)
			}
			if n == 0 {
				if _, captured, _, _, err = orderPosting(ctx, tx, cmd.AccountID, cmd.OrderID, "charge"); err != nil {
					return err
				}
				switch captured {
				case id:
					return nil // recorded already: only the lease was left to complete
				case "":
					return fmt.Errorf("payments: capturing charge %s of %s: no reserved charge of the order on %s", id, cmd.OrderID, cmd.AccountID)
				}
				return fmt.Errorf("payments: the charge of %s was captured before as %q; the gateway's charge %s has no posting (orphaned: refund or reconcile it)",
					cmd.OrderID, captured, id)
			}
			md := events.Metadata{CorrelationID: cmd.OrderID.String(), IdempotencyKey: lease.Key}
			_, err = s.cfg.Events.QueueAppendTx(ctx, tx, Stream(cmd.AccountID), md, ChargeCaptured{OrderID: cmd.OrderID, ChargeID: id})
			return err
		})
		if err != nil && captured != "" && captured != id {
			// A second charge at the gateway for a captured order: the
			// ledger keeps its first. Free the claim, so that a retry
			// answers from the ledger at once instead of waiting out the
			// lease.
			s.cfg.Logger.Error("the gateway charged an order already captured", "order", cmd.OrderID, "captured", captured, "orphaned", id, "key", lease.Key)
			if rerr := s.cfg.Idempotency.ReleaseLease(ctx, lease); rerr != nil && !errors.Is(rerr, idempotency.ErrLeaseLost) {
				s.cfg.Logger.Warn("releasing the lease of a charge not recorded", "key", lease.Key, "err", rerr)
			}
		}
		if err != nil {
			// Lost to a takeover, or a database error: the next attempt
			// replays the gateway's answer or asks again with the same key.
			return "", fmt.Errorf("payments: recording charge %s of %s: %w", id, cmd.OrderID, err)
		}
		s.answers.keep(keyHash{lease.Key, lease.Hash}, answer{chargeID: id})
		return id, nil
	case errors.Is(err, ErrDeclined):
		err := s.inTx(ctx, func(tx delivery.DBTX) error {
			if err := s.cfg.Idempotency.CompleteLeaseTx(ctx, tx, lease, idempotency.StatusFailed, idempotency.Response{Body: []byte(ReasonDeclined)}); err != nil {
				return err
			}
			if err := queueLock(ctx, tx, cmd.AccountID); err != nil {
				return err
			}
			md := events.Metadata{CorrelationID: cmd.OrderID.String(), IdempotencyKey: lease.Key}
			ids, err := s.cfg.Events.QueueAppendTx(ctx, tx, Stream(cmd.AccountID), md, ChargeVoided{OrderID: cmd.OrderID, AmountCents: cmd.AmountCents, Reason: ReasonDeclined})
			if err != nil {
				return err
			}
			return steps.Queue(ctx, tx, "payments: voiding the charge of "+cmd.OrderID.String(), insertPostingSQL,
				cmd.AccountID, ids[0], cmd.AmountCents, cmd.OrderID, "void", nil, lease.Key)
		})
		if err != nil {
			return "", fmt.Errorf("payments: voiding the declined charge of %s: %w", cmd.OrderID, err)
		}
		s.answers.keep(keyHash{lease.Key, lease.Hash}, answer{declined: true})
		return "", &refusal{reason: ReasonDeclined}
	default:
		// The outcome is unknown: record nothing, let the next attempt ask
		// again with the same key at once.
		if rerr := s.cfg.Idempotency.ReleaseLease(ctx, lease); rerr != nil {
			s.cfg.Logger.Warn("releasing the lease of a failed gateway call", "key", lease.Key, "err", rerr)
		}
		if errors.Is(err, ErrBadGatewayRequest) {
			return "", steps.Permanent(err)
		}
		return "", err
	}
}

// refund returns what was charged for an order, once. It fences the order
// first, so a charge that arrives later (a retry, a re-sent command still
// queued when the saga gave up on it) is refused. An order never charged,
// voided, or of an unknown account is a no-op success. A charge still
// reserved (its gateway call never resolved) is finished first, with its own
// key, so the gateway's answer decides: captured then refunded, or declined
// and voided.
//
// Like a charge, the refund's ledger work runs in transactions of its own:
// claim the gateway refund with a lease (keyed by the order, so an operator's
// retry under a new command key cannot refund twice), call the gateway,
// then record the refund and its posting together. The step's transaction
// only carries the reply.
//
// A refund the gateway declines is final for the command that asked for it
// (RefundFailed: the saga parks). Another command for the order, as an
// operator's retry sends under a fresh key once the cause is fixed, asks the
// gateway again under the order's next refund key (RefundAttemptKey): a
// gateway keeps a declined key's answer, and a declined refund moved no
// money, so a new key cannot refund twice. A key is left behind only once
// its decline is recorded; an unknown outcome keeps its key.
func (s *Service) refund(ctx context.Context, tx *steps.Tx, cmd RefundPayment) (steps.Message, error) {
	if cmd.OrderID == uuid.Nil || !accountIDPattern.MatchString(cmd.AccountID) {
		return PaymentRefunded{OrderID: cmd.OrderID}, nil
	}
	refundCall := func(ctx context.Context) error { return s.refundCall(ctx, cmd, tx.Key()) }
	reserved, err := s.reservedCharge(ctx, cmd)
	if err != nil {
		return nil, err
	}
	if reserved != nil {
		// A charge reserved but never captured nor voided: its gateway
		// call is run to the end first, under the charge's own key, then
		// the refund's, both in one awaited call.
		return nil, steps.Await(4*s.cfg.GatewayLease, func(ctx context.Context) error {
			if err := s.pastLeases(ctx, 0, func(ctx context.Context) error { return s.chargeCall(ctx, reserved.req, reserved.cmd) }); err != nil {
				return err
			}
			return s.pastLeases(ctx, 0, refundCall)
		})
	}
	prep, err := s.prepareRefund(ctx, cmd, tx.Key())
	var ref *refusal
	if errors.As(err, &ref) {
		// Final: the saga parks and reports it; a person must act.
		return nil, steps.Fail(RefundFailed{OrderID: cmd.OrderID, Reason: ref.reason}, ref.reason)
	}
	if busy := (*idempotency.InProgressError)(nil); errors.As(err, &busy) {
		return nil, s.afterLease(busy, "refund", refundCall)
	}
	if err != nil {
		return nil, err
	}
	if prep.lease == nil {
		if steps.Awaited(ctx) {
			// The posting found is the one this command's awaited call
			// made, not an earlier command's.
			prep.result.Already = false
		}
		return prep.result, nil
	}
	// The gateway call, and the recording of its answer, run outside the
	// step's transaction (as the charge's do): the command is handed back
	// meanwhile, and its next run finds the refund posted, or its decline
	// recorded for this command.
	return nil, steps.Await(s.cfg.GatewayLease, func(ctx context.Context) error {
		_, err := s.callRefund(ctx, cmd, tx.Key(), prep)
		return answered(err)
	})
}

// refundCall prepares the refund of cmd for command and, unless what is
// recorded answers it, calls the gateway under its lease: the awaited call
// of a refund that had to wait (a refusal is nil: the handler's next run
// finds it, or its record, and answers).
func (s *Service) refundCall(ctx context.Context, cmd RefundPayment, command string) error {
	prep, err := s.prepareRefund(ctx, cmd, command)
	if err == nil && prep.lease != nil {
		_, err = s.callRefund(ctx, cmd, command, prep)
	}
	return answered(err)
}

// RefundKey is the gateway's idempotency key for an order's refund (its
// first attempt: RefundAttemptKey(order, 1)), and the request key of its
// posting whichever attempt refunded.
func RefundKey(order uuid.UUID) string { return "refund:" + order.String() }

// RefundAttemptKey is the gateway's idempotency key for the n-th attempt
// (from 1) to refund an order: attempt n+1 is made only after the gateway
// declined attempt n, for another command.
func RefundAttemptKey(order uuid.UUID, n int) string {
	if n <= 1 {
		return RefundKey(order)
	}
	return RefundKey(order) + "#" + strconv.Itoa(n)
}

// refundDeclined is what a declined refund attempt records with its answer
// (the idempotency record's Meta): the command it answered.
type refundDeclined struct {
	Command string `json:"command"`
}

// declinedFor is the command a declined refund attempt answered; "" when
// the record does not say (recorded by an earlier release).
func declinedFor(rec *idempotency.Record) string {
	var d refundDeclined
	if len(rec.Response.Meta) > 0 && json.Unmarshal(rec.Response.Meta, &d) == nil {
		return d.Command
	}
	return ""
}

// refundPrep is what prepareRefund decided: the answer (no lease), or the
// lease to call the gateway under, with the key, charge and amount.
type refundPrep struct {
	result   PaymentRefunded
	lease    *idempotency.Lease
	key      string
	chargeID string
	amount   int64
}

// prepareRefund is the refund's first phase, in a transaction of its own:
// fence the order, and either answer from what is recorded (nothing
// charged, refunded already, declined for this command) or claim the
// gateway call of the order's refund key with a lease, waiting out the
// lease of a worker that died mid-call.
func (s *Service) prepareRefund(ctx context.Context, cmd RefundPayment, command string) (refundPrep, error) {
	{
		var (
			result   = PaymentRefunded{OrderID: cmd.OrderID}
			lease    *idempotency.Lease
			key      string
			chargeID string
			amount   int64
		)
		err := s.inTx(ctx, func(tx delivery.DBTX) error {
			err := lockAccount(ctx, tx, cmd.AccountID)
			if errors.Is(err, ErrUnknownAccount) {
				return nil
			}
			if err != nil {
				return err
			}
			if _, err := tx.ExecContext(ctx, fenceSQL, cmd.OrderID, cmd.AccountID); err != nil {
				return fmt.Errorf("payments: fencing %s: %w", cmd.OrderID, err)
			}
			charged, ref, _, found, err := orderPosting(ctx, tx, cmd.AccountID, cmd.OrderID, "charge")
			if err != nil || !found {
				return err
			}
			if _, _, _, voided, err := orderPosting(ctx, tx, cmd.AccountID, cmd.OrderID, "void"); err != nil || voided {
				return err
			}
			if ref == "" {
				return fmt.Errorf("payments: refunding %s: its charge is still being captured", cmd.OrderID)
			}
			if refunded, refundID, _, found, err := orderPosting(ctx, tx, cmd.AccountID, cmd.OrderID, "refund"); err != nil || found {
				result = PaymentRefunded{OrderID: cmd.OrderID, AmountCents: refunded, RefundID: refundID, Already: true}
				return err
			}
			chargeID, amount = ref, -charged
			for n := 1; ; n++ {
				key = RefundAttemptKey(cmd.OrderID, n)
				acq, err := s.cfg.Idempotency.AcquireTx(ctx, tx, GatewayRequest("refund", key, cmd.AccountID, cmd.OrderID, amount), s.cfg.GatewayLease)
				if err != nil {
					return err
				}
				rec := acq.Record
				switch {
				case rec == nil:
					lease = acq.Lease
					return nil
				case rec.Status == idempotency.StatusFailed && declinedFor(rec) == command:
					return &refusal{reason: ReasonRefundDeclined}
				case rec.Status == idempotency.StatusFailed:
					continue // declined for another command: this one asks again
				}
				// Refunded at the gateway and recorded, yet not posted:
				// post it now.
				result = PaymentRefunded{OrderID: cmd.OrderID, AmountCents: amount, RefundID: string(rec.Response.Body)}
				return s.postRefund(ctx, tx, cmd, amount, result.RefundID)
			}
		})
		return refundPrep{result: result, lease: lease, key: key, chargeID: chargeID, amount: amount}, err
	}
}

// callRefund is the refund's second phase, under prep's lease: the
// gateway call, then its answer recorded and the refund posted (or the
// decline recorded, for command).
func (s *Service) callRefund(ctx context.Context, cmd RefundPayment, command string, prep refundPrep) (PaymentRefunded, error) {
	lease, key, chargeID, amount := prep.lease, prep.key, prep.chargeID, prep.amount
	id, err := s.cfg.Gateway.Refund(ctx, key, cmd.AccountID, chargeID, amount)
	if errors.Is(err, ErrDeclined) {
		// A final answer: record it, never leave the claim pending.
		meta, merr := json.Marshal(refundDeclined{Command: command})
		if merr != nil {
			return PaymentRefunded{}, merr
		}
		if cerr := s.cfg.Idempotency.CompleteLease(ctx, lease, idempotency.StatusFailed, idempotency.Response{Body: []byte(err.Error()), Meta: meta}); cerr != nil {
			return PaymentRefunded{}, fmt.Errorf("payments: recording the declined refund of %s: %w", cmd.OrderID, cerr)
		}
		return PaymentRefunded{}, &refusal{reason: ReasonRefundDeclined}
	}
	if err != nil {
		if rerr := s.cfg.Idempotency.ReleaseLease(ctx, lease); rerr != nil {
			s.cfg.Logger.Warn("releasing the lease of a failed gateway call", "key", key, "err", rerr)
		}
		if errors.Is(err, ErrBadGatewayRequest) {
			return PaymentRefunded{}, steps.Permanent(err)
		}
		return PaymentRefunded{}, err
	}
	err = s.inTx(ctx, func(tx delivery.DBTX) error {
		if err := s.cfg.Idempotency.CompleteLeaseTx(ctx, tx, lease, idempotency.StatusCompleted, idempotency.Response{Code: 200, Body: []byte(id)}); err != nil {
			return err
		}
		if err := lockAccount(ctx, tx, cmd.AccountID); err != nil {
			return err
		}
		return s.postRefund(ctx, tx, cmd, amount, id)
	})
	if err != nil {
		// The gateway refunded; the next attempt asks it again with the
		// same key and records its answer.
		if rerr := s.cfg.Idempotency.ReleaseLease(ctx, lease); rerr != nil && !errors.Is(rerr, idempotency.ErrLeaseLost) {
			s.cfg.Logger.Warn("releasing the lease of a refund not recorded", "key", key, "err", rerr)
		}
		return PaymentRefunded{}, fmt.Errorf("payments: recording refund %s of %s: %w", id, cmd.OrderID, err)
	}
	return PaymentRefunded{OrderID: cmd.OrderID, AmountCents: amount, RefundID: id}, nil
}

func (s *Service) postRefund(ctx context.Context, tx delivery.DBTX, cmd RefundPayment, amount int64, refundID string) error {
	md := events.Metadata{CorrelationID: cmd.OrderID.String(), IdempotencyKey: RefundKey(cmd.OrderID)}
	ids, err := s.cfg.Events.QueueAppendTx(ctx, tx, Stream(cmd.AccountID), md, Refunded{OrderID: cmd.OrderID, AmountCents: amount, RefundID: refundID})
	if err != nil {
		return err
	}
	return steps.Queue(ctx, tx, "payments: posting the refund of "+cmd.OrderID.String(), insertPostingSQL,
		cmd.AccountID, ids[0], amount, cmd.OrderID, "refund", refundID, RefundKey(cmd.OrderID))
}

// reservedChargeCall is a charge of an order that was reserved but never
// captured nor voided: its gateway request, under the charge's own key,
// and the command that reserved it.
type reservedChargeCall struct {
	req idempotency.Request
	cmd ChargePayment
}

// reservedCharge finds the charge of cmd's order that was reserved but
// never captured nor voided, if there is one: its gateway call must run to
// the end, so that the gateway's answer decides (captured then refunded,
// or declined and voided), before the order is refunded.
func (s *Service) reservedCharge(ctx context.Context, cmd RefundPayment) (*reservedChargeCall, error) {
	charged, ref, key, found, err := orderPosting(ctx, s.cfg.DB, cmd.AccountID, cmd.OrderID, "charge")
	if err != nil || !found || ref != "" {
		return nil, err
	}
	if _, _, _, voided, err := orderPosting(ctx, s.cfg.DB, cmd.AccountID, cmd.OrderID, "void"); err != nil || voided {
		return nil, err
	}
	s.cfg.Logger.Info("finishing a reserved charge before refunding it", "order", cmd.OrderID, "charge_key", key)
	charge := ChargePayment{OrderID: cmd.OrderID, AccountID: cmd.AccountID, AmountCents: -charged}
	return &reservedChargeCall{req: GatewayRequest("charge", key, charge.AccountID, charge.OrderID, charge.AmountCents), cmd: charge}, nil
}

// reservation is what a charge's reservation decides on, read in one
// statement after the account's lock (see reservationSQL).
type reservation struct {
	account bool   // the account exists
	fenced  bool   // the order's payment was compensated
	charged bool   // the order has a charge posting on the account
	delta   int64  // its amount (negative)
	ref     string // its gateway reference, "" until captured
	owner   string // the key that reserved it
	voided  bool   // the order has a void posting on the account
	balance int64  // the account's balance
}

func readReservation(ctx context.Context, q delivery.DBTX, account string, order uuid.UUID) (reservation, error) {
	var r reservation
	var delta sql.NullInt64
	err := q.QueryRowContext(ctx, reservationSQL, account, order).Scan(&r.account, &r.fenced, &delta, &r.ref, &r.owner, &r.voided, &r.balance)
	if err != nil {
		return r, fmt.Errorf("payments: reading the ledger of %s for %s: %w", account, order, err)
	}
	r.charged, r.delta = delta.Valid, delta.Int64
	return r, nil
}

func orderPosting(ctx context.Context, q delivery.DBTX, account string, order uuid.UUID, kind string) (delta int64, ref, key string, found bool, err error) {
	err = q.QueryRowContext(ctx, orderPostingSQL, account, order, kind).Scan(&delta, &ref, &key)
	if errors.Is(err, sql.ErrNoRows) {
		return 0, "", "", false, nil
	}
	if err != nil {
		return 0, "", "", false, fmt.Errorf("payments: reading %s of %s: %w", kind, order, err)
	}
	return delta, ref, key, true, nil
}

// violates reports whether err is a unique violation of the named index.
func violates(err error, index string) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && pgErr.Code == pgerrcode.UniqueViolation && pgErr.ConstraintName == index
}

// inTx runs fn in a transaction of its own (steps.InTx): on the sample's
// pgx pools, the account's lock and the writes after it are queued and
// go with the next read or the commit.
func (s *Service) inTx(ctx context.Context, fn func(tx delivery.DBTX) error) error {
	return steps.InTx(ctx, s.cfg.DB, fn)
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
