package idempotency

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"time"

	"github.com/google/uuid"

	"github.com/pgsaga/pgsaga/internal/dbtx"
	"github.com/pgsaga/pgsaga/saga/delivery"
)

// Lease is a committed pending claim of the two-phase form: the holder calls
// the external service with the request's stable key, then completes the key
// with CompleteLease or CompleteLeaseTx. Only the token's holder can complete
// it; after Until, another worker may take it over and call again with the
// same key, which the external service must deduplicate.
type Lease struct {
	Request
	Token uuid.UUID
	Until time.Time
	// Attempt counts executions begun under the key: 1 for the first claim,
	// more after takeovers.
	Attempt int
	// Takeover is true when this lease replaced an expired one: the external
	// call may already have happened, and must be repeated with the same key.
	Takeover bool
}

// Acquisition is the outcome of Acquire: a Lease to execute under, or a
// finished Record to replay.
type Acquisition struct {
	Lease  *Lease
	Record *Record
}

// Acquire is phase one of the two-phase form. In a transaction of its own it
// claims req with a lease of the configured duration, or takes over an
// expired lease, and commits, so the claim survives a crash during the
// external call. A finished key is returned for replay; a key under a live
// lease, or held by an open transaction past lock_timeout, is ErrInProgress.
func (s *Store) Acquire(ctx context.Context, req Request) (Acquisition, error) {
	return s.AcquireFor(ctx, req, s.cfg.LeaseDuration)
}

// AcquireFor is Acquire with a lease of the given duration.
func (s *Store) AcquireFor(ctx context.Context, req Request, lease time.Duration) (Acquisition, error) {
	if s.cfg.DB == nil {
		return Acquisition{}, errors.New("idempotency: Config.DB is required for Acquire")
	}
	var acq Acquisition
	err := dbtx.InTx(ctx, s.cfg.DB, "idempotency", func(tx delivery.DBTX) error {
		var err error
		acq, err = s.acquireTx(ctx, tx, req, lease, false)
		return err
	})
	if err != nil {
		return Acquisition{}, err
	}
	return acq, nil
}

// AcquireTx is phase one in the caller's READ COMMITTED transaction, for a
// caller that commits more with the claim (a reservation, say). The claim,
// the lease and the caller's writes take effect when tx commits, and must
// commit before the external call. Config.LockTimeout bounds the claim's own
// wait; the transaction's lock_timeout is as it was once AcquireTx returns.
func (s *Store) AcquireTx(ctx context.Context, tx delivery.DBTX, req Request, lease time.Duration) (Acquisition, error) {
	return s.acquireTx(ctx, tx, req, lease, true)
}

// acquireTx is AcquireTx; with restore, the transaction's lock_timeout is
// set back after the claim (see claimTx).
func (s *Store) acquireTx(ctx context.Context, tx delivery.DBTX, req Request, lease time.Duration, restore bool) (Acquisition, error) {
	if err := req.validate(); err != nil {
		return Acquisition{}, err
	}
	if lease < time.Millisecond {
		return Acquisition{}, fmt.Errorf("%w: lease must be at least 1ms, got %s", ErrInvalidRequest, lease)
	}
	token := uuid.New()
	var (
		prev     string
		attempts sql.NullInt64
		until    sql.NullTime
		restored bool
	)
	err := tx.QueryRowContext(ctx, claimLeaseSQL, req.Scope, req.Key, req.Hash, s.lockTimeout, token, lease.Seconds()).
		Scan(&prev, &attempts, new(sql.NullTime), &until, &restored)
	if err != nil {
		return Acquisition{}, s.claimError(req, err)
	}
	l := &Lease{Request: req, Token: token, Attempt: int(attempts.Int64), Until: until.Time}
	acq, err := s.acquireExisting(ctx, tx, l, attempts.Valid, lease)
	if restore && !restored {
		err = restoreLockTimeout(ctx, tx, prev, err)
	}
	return acq, err
}

// acquireExisting finishes an acquisition once claimLeaseSQL ran: inserted,
// or the key exists and is replayed or taken over.
func (s *Store) acquireExisting(ctx context.Context, tx delivery.DBTX, l *Lease, inserted bool, lease time.Duration) (Acquisition, error) {
	if inserted {
		return Acquisition{Lease: l}, nil
	}
	req := l.Request
	rec, left, err := lockRecord(ctx, tx, req)
	if err != nil {
		return Acquisition{}, s.claimError(req, err)
	}
	if err := checkHash(req, rec); err != nil {
		return Acquisition{}, err
	}
	if rec.Finished() {
		return Acquisition{Record: &rec}, nil
	}
	err = tx.QueryRowContext(ctx, takeoverSQL, req.Scope, req.Key, l.Token, lease.Seconds()).Scan(&l.Attempt, &l.Until)
	if errors.Is(err, sql.ErrNoRows) {
		return Acquisition{}, &InProgressError{Scope: req.Scope, Key: req.Key, LockedUntil: rec.LockedUntil, RetryAfter: left}
	}
	if err != nil {
		return Acquisition{}, fmt.Errorf("idempotency: taking over %s/%s: %w", req.Scope, req.Key, err)
	}
	l.Takeover = true
	return Acquisition{Lease: l}, nil
}

// CompleteLeaseTx is phase two: it stores the outcome in tx, fenced on the
// lease token. A worker whose lease was taken over gets ErrLeaseLost and must
// not report its outcome as the key's. Never complete with an outcome that is
// not known (a timeout): leave the lease to expire, or ReleaseLease.
//
// tx must see the lease: a REPEATABLE READ transaction whose snapshot was
// taken before Acquire committed (a watermill-sql subscriber's batch, for
// one) does not, and gets ErrLeaseLost. Use CompleteLease there.
func (s *Store) CompleteLeaseTx(ctx context.Context, tx delivery.DBTX, l *Lease, status Status, resp Response) error {
	if err := checkFinal(status); err != nil {
		return err
	}
	res, err := tx.ExecContext(ctx, completeLeaseSQL, l.Scope, l.Key, string(status), resp.Code, resp.Body, nullJSON(resp.Meta), l.Token)
	if err != nil {
		return fmt.Errorf("idempotency: completing %s/%s: %w", l.Scope, l.Key, err)
	}
	if n, _ := res.RowsAffected(); n != 1 {
		return fmt.Errorf("%w: %s/%s (token %s)", ErrLeaseLost, l.Scope, l.Key, l.Token)
	}
	return nil
}

// CompleteLease is CompleteLeaseTx in a transaction of its own.
func (s *Store) CompleteLease(ctx context.Context, l *Lease, status Status, resp Response) error {
	if s.cfg.DB == nil {
		return errors.New("idempotency: Config.DB is required for CompleteLease")
	}
	return dbtx.InTx(ctx, s.cfg.DB, "idempotency", func(tx delivery.DBTX) error { return s.CompleteLeaseTx(ctx, tx, l, status, resp) })
}

// ReleaseLease ends a lease early without an outcome, so the next attempt
// can take the key over at once instead of waiting for the lease to expire.
// Use it when the external call failed in a way that is safe to repeat with
// the same key. It returns ErrLeaseLost if the lease was already taken over.
func (s *Store) ReleaseLease(ctx context.Context, l *Lease) error {
	if s.cfg.DB == nil {
		return errors.New("idempotency: Config.DB is required for ReleaseLease")
	}
	return dbtx.InTx(ctx, s.cfg.DB, "idempotency", func(tx delivery.DBTX) error {
		res, err := tx.ExecContext(ctx, releaseLeaseSQL, l.Scope, l.Key, l.Token)
		if err != nil {
			return fmt.Errorf("idempotency: releasing %s/%s: %w", l.Scope, l.Key, err)
		}
		if n, _ := res.RowsAffected(); n != 1 {
			return fmt.Errorf("%w: %s/%s (token %s)", ErrLeaseLost, l.Scope, l.Key, l.Token)
		}
		return nil
	})
}
