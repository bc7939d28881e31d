// Package idempotency stores idempotency keys in PostgreSQL and decides, for
// each request carrying one, whether to execute it or replay what it stored.
//
// A tx argument (delivery.DBTX) is pgsaga's one database interface, named
// delivery.DBTX for users: a *sql.Tx, *sql.Conn or *sql.DB, or a pgx.Tx
// wrapped by saga.PgxTx.
//
// The claim follows docs/DESIGN.md ("The step transaction"), verified on PostgreSQL 15: insert first with
// INSERT … ON CONFLICT DO NOTHING (a missing row cannot be locked, so
// SELECT … FOR UPDATE first lets two racers through), then lock the existing
// row to read a concurrent claimer's outcome. The claim lives in the caller's
// transaction with the request's effects: if that transaction rolls back, so
// does the claim, and a waiting racer becomes the executor.
//
// Outcomes a caller branches on:
//
//   - Claim.Execute: this caller owns the key; run the request, then
//     CompleteTx in the same transaction;
//   - Claim.Record: a finished request (completed or failed) to replay;
//   - ErrInProgress: another transaction holds the key, beyond lock_timeout,
//     or a two-phase claim's lease is still running;
//   - ErrKeyReused: the key was first used with a different request;
//   - ErrConflict: under REPEATABLE READ or SERIALIZABLE a racer that waited
//     for a concurrent claim gets a serialization failure instead of the
//     stored row; the transaction must be retried from the start (a
//     watermill-sql subscriber's batch, for instance, is rolled back and
//     redelivered by pgsaga's transport).
//
// Steps with an external side effect use the two-phase form (Acquire,
// CompleteLease): the pending claim commits with a lease before the external
// call, and only the lease holder can complete it.
//
// The package stands alone: it knows nothing of sagas. Over the same store
// it offers keys for messages (MessageKeys: claim, work, finish, in the
// caller's transaction), the same as a Watermill middleware (Middleware),
// and a net/http middleware (HTTPMiddleware).
package idempotency

import (
	"context"
	"crypto/sha256"
	"database/sql"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgerrcode"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/pgsaga/pgsaga/internal/dbtx"
	"github.com/pgsaga/pgsaga/internal/outcome"
	"github.com/pgsaga/pgsaga/saga/delivery"
)

// Status of a key.
type Status string

// Statuses, as stored in idempotency_keys.status.
const (
	StatusPending   Status = "pending"
	StatusCompleted Status = "completed"
	StatusFailed    Status = "failed"
)

// Limits of a key's identity, as the schema enforces them.
const (
	MaxScopeLen = 200
	MaxKeyLen   = 255
)

// Request identifies one request: its key within a scope (an endpoint, a
// step, a caller) and a hash of its content, so a key reused for a different
// request is caught.
type Request struct {
	Scope string
	Key   string
	// Hash is a fingerprint of the request's content (see Fingerprint).
	Hash []byte
}

// Response is what a finished request stored and every replay returns.
type Response struct {
	// Code is an HTTP status, or any code the caller gives it meaning.
	Code int
	// Body is the response payload.
	Body []byte
	// Meta is JSON the caller needs to replay faithfully (headers, reply
	// message ids). Nil for none.
	Meta json.RawMessage
}

// Record is a key as stored.
type Record struct {
	Request
	Status      Status
	Response    Response
	Attempts    int
	LeaseToken  uuid.UUID // zero unless a two-phase claim holds a lease
	LockedUntil time.Time // zero unless a two-phase claim holds a lease
	CreatedAt   time.Time
	UpdatedAt   time.Time
	CompletedAt time.Time // zero while pending
}

// Finished reports whether the record holds a final outcome.
func (r Record) Finished() bool { return r.Status == StatusCompleted || r.Status == StatusFailed }

// Claim is the outcome of ClaimTx.
type Claim struct {
	// Execute is true when this caller owns the key and must run the
	// request, then complete the key in the same transaction.
	Execute bool
	// Record is the stored outcome to replay when Execute is false.
	Record Record
}

// InProgressError is returned (matching ErrInProgress) when a key is held.
type InProgressError struct {
	Scope, Key string
	// LockedUntil is when a two-phase claim's lease expires; zero when the
	// key is held by another open transaction.
	LockedUntil time.Time
	// RetryAfter is how long the lease had left when the claim found it,
	// measured on the database's clock (which LockedUntil is on too, so
	// time.Until(LockedUntil) is off by however far this machine's clock
	// is): wait that long before claiming again. Zero when the key is held
	// by another open transaction, or the lease just ran out.
	RetryAfter time.Duration
}

// Error implements error.
func (e *InProgressError) Error() string {
	if e.LockedUntil.IsZero() {
		return fmt.Sprintf("idempotency: %s/%s is being executed by another transaction", e.Scope, e.Key)
	}
	return fmt.Sprintf("idempotency: %s/%s is leased until %s", e.Scope, e.Key, e.LockedUntil.Format(time.RFC3339Nano))
}

// Is makes InProgressError match ErrInProgress.
func (e *InProgressError) Is(target error) bool { return target == ErrInProgress }

// Config configures a Store. Zero values take the documented defaults.
type Config struct {
	// DB opens the store's own transactions (Do, Acquire, CompleteLease,
	// Get). Required for those; ClaimTx and CompleteTx use the caller's.
	DB *sql.DB
	// LockTimeout bounds how long a claim waits for a concurrent claimer of
	// the same key to commit or roll back (SET LOCAL lock_timeout, for the
	// claim's statements only: ClaimTx and AcquireTx set the transaction's
	// own lock_timeout back before they return). Default: 5s.
	LockTimeout time.Duration
	// LeaseDuration is how long a two-phase claim is held before another
	// worker may take it over. Default: 30s.
	LeaseDuration time.Duration
	// Logger. Default: slog.Default().
	Logger *slog.Logger
}

// Store claims, completes and replays idempotency keys.
type Store struct {
	cfg         Config
	lockTimeout string // lock_timeout setting, in milliseconds
}

// NewStore validates cfg and returns a Store.
func NewStore(cfg Config) (*Store, error) {
	if cfg.LockTimeout == 0 {
		cfg.LockTimeout = 5 * time.Second
	}
	if cfg.LeaseDuration == 0 {
		cfg.LeaseDuration = 30 * time.Second
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.LockTimeout < time.Millisecond {
		return nil, fmt.Errorf("idempotency: LockTimeout must be at least 1ms, got %s", cfg.LockTimeout)
	}
	if cfg.LeaseDuration < time.Millisecond {
		return nil, fmt.Errorf("idempotency: LeaseDuration must be at least 1ms, got %s", cfg.LeaseDuration)
	}
	return &Store{cfg: cfg, lockTimeout: strconv.FormatInt(cfg.LockTimeout.Milliseconds(), 10)}, nil
}

// Fingerprint hashes the parts of a request into a Request.Hash. Parts are
// length-prefixed, so ("ab","c") and ("a","bc") differ.
func Fingerprint(parts ...[]byte) []byte {
	h := sha256.New()
	var n [8]byte
	for _, p := range parts {
		binary.BigEndian.PutUint64(n[:], uint64(len(p)))
		h.Write(n[:])
		h.Write(p)
	}
	return h.Sum(nil)
}

// storableText reports whether PostgreSQL can store s as text: valid UTF-8
// (the database's encoding; anything else fails with SQLSTATE 22021) and no
// NUL byte, which text cannot hold in any encoding.
func storableText(s string) bool {
	return utf8.ValidString(s) && !strings.ContainsRune(s, 0)
}

func (r Request) validate() error {
	switch {
	case r.Scope == "" || len(r.Scope) > MaxScopeLen:
		return fmt.Errorf("%w: scope must be 1 to %d bytes, got %d", ErrInvalidRequest, MaxScopeLen, len(r.Scope))
	case r.Key == "" || len(r.Key) > MaxKeyLen:
		return fmt.Errorf("%w: key must be 1 to %d bytes, got %d", ErrInvalidRequest, MaxKeyLen, len(r.Key))
	case !storableText(r.Scope):
		return fmt.Errorf("%w: scope must be UTF-8 text without NUL bytes", ErrInvalidRequest)
	case !storableText(r.Key):
		return fmt.Errorf("%w: key must be UTF-8 text without NUL bytes", ErrInvalidRequest)
	case len(r.Hash) == 0:
		return fmt.Errorf("%w: request hash is empty (use Fingerprint)", ErrInvalidRequest)
	}
	return nil
}

// ClaimTx claims req in tx. See the package documentation for outcomes.
// Config.LockTimeout bounds the claim's own wait; the transaction's
// lock_timeout is as it was once ClaimTx returns.
func (s *Store) ClaimTx(ctx context.Context, tx delivery.DBTX, req Request) (Claim, error) {
	return s.claimTx(ctx, tx, req, s.lockTimeout, true)
}

// claimTx is ClaimTx with lock_timeout given in milliseconds. With restore,
// the transaction's lock_timeout is set back after the claim; a caller
// whose transaction runs nothing else (Do) saves the round trip.
func (s *Store) claimTx(ctx context.Context, tx delivery.DBTX, req Request, lockTimeout string, restore bool) (Claim, error) {
	if err := req.validate(); err != nil {
		return Claim{}, err
	}
	if bc, ok := tx.(dbtx.BatchClaimer); ok {
		if claimed, rehash := bc.ClaimedInBatch(req.Scope, req.Key, req.Hash); claimed {
			// Claimed with the batch's other keys; stored with this
			// request's hash if the batch's was another.
			if rehash {
				if _, err := tx.ExecContext(ctx, rehashSQL, req.Scope, req.Key, req.Hash); err != nil {
					return Claim{}, s.claimError(req, err)
				}
			}
			return Claim{Execute: true}, nil
		}
	}
	var (
		prev     string
		attempts sql.NullInt64
		created  sql.NullTime
		restored bool
	)
	if err := tx.QueryRowContext(ctx, claimSQL, req.Scope, req.Key, req.Hash, lockTimeout).Scan(&prev, &attempts, &created, &restored); err != nil {
		return Claim{}, s.claimError(req, err)
	}
	claim, err := s.claimExisting(ctx, tx, req, attempts.Valid)
	if restore && !restored {
		err = restoreLockTimeout(ctx, tx, prev, err)
	}
	return claim, err
}

// claimExisting finishes a claim once claimSQL ran: inserted, or the key
// exists and is read under lock.
func (s *Store) claimExisting(ctx context.Context, tx delivery.DBTX, req Request, inserted bool) (Claim, error) {
	if inserted {
		return Claim{Execute: true}, nil
	}
	rec, left, err := lockRecord(ctx, tx, req)
	if err != nil {
		return Claim{}, s.claimError(req, err)
	}
	if err := checkHash(req, rec); err != nil {
		return Claim{}, err
	}
	if rec.Status == StatusPending {
		if q, ok := tx.(dbtx.BatchQueuer); ok && rec.LeaseToken == uuid.Nil && q.BatchedPending() {
			// Locked, pending and without a lease: claimed in this
			// transaction, by an earlier attempt of its batch whose
			// completion is queued (see completeWrite).
			return Claim{}, fmt.Errorf("idempotency: %s/%s: %w", req.Scope, req.Key, dbtx.ErrBatchedPending)
		}
		// A committed pending row is a two-phase claim: its lease holds it.
		return Claim{}, &InProgressError{Scope: req.Scope, Key: req.Key, LockedUntil: rec.LockedUntil, RetryAfter: left}
	}
	return Claim{Record: rec}, nil
}

// restoreLockTimeout sets tx's lock_timeout back to prev after a claim
// that ended with err. A database error has aborted tx (nothing to restore,
// and no statement would run); any other error is returned as it is, with
// the restore done on a best-effort basis.
func restoreLockTimeout(ctx context.Context, tx delivery.DBTX, prev string, err error) error {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		return err
	}
	if _, rerr := tx.ExecContext(ctx, restoreLockTimeoutSQL, prev); rerr != nil && err == nil {
		return fmt.Errorf("idempotency: restoring lock_timeout after the claim: %w", rerr)
	}
	return err
}

// CompleteTx stores the outcome of a claim made with ClaimTx in the same
// transaction. status must be StatusCompleted or StatusFailed (a final
// business rejection, replayed like a success).
func (s *Store) CompleteTx(ctx context.Context, tx delivery.DBTX, req Request, status Status, resp Response) error {
	if err := checkFinal(status); err != nil {
		return err
	}
	res, err := tx.ExecContext(ctx, completeSQL, req.Scope, req.Key, string(status), resp.Code, resp.Body, nullJSON(resp.Meta))
	if err != nil {
		return fmt.Errorf("idempotency: completing %s/%s: %w", req.Scope, req.Key, err)
	}
	if n, _ := res.RowsAffected(); n != 1 {
		return fmt.Errorf("%w: %s/%s", ErrNotClaimed, req.Scope, req.Key)
	}
	return nil
}

// Failure is a final business outcome, the one type of the module that
// means it: the request was understood and refused. Returned from a Do
// callback, the key is stored failed with Response, without the callback's
// writes, and Response is replayed to every later request with the same
// key. Returned from a handler behind Middleware (Reject), the key is
// stored failed with Replies, which are published like a success's and
// replayed to every duplicate. Any other error is transient: nothing is
// stored. A step refuses with steps.Fail, which is answered the same way.
type Failure struct {
	Reason   string
	Response Response           // Do's answer
	Replies  []*message.Message // Middleware's answer
}

// Error implements error.
func (f *Failure) Error() string { return "idempotency: failed: " + f.Reason }

// Outcome implements outcome.Classifier: a business failure.
func (f *Failure) Outcome() delivery.Outcome { return outcome.BusinessFailure }

// Result is the outcome of Do.
type Result struct {
	Status   Status
	Response Response
	// Replayed is true when the response was stored by an earlier request.
	Replayed bool
}

// Do runs fn at most once per key, in a READ COMMITTED transaction of its own
// that also holds the claim: fn's writes through tx commit with the stored
// response or not at all. fn returns the response, a *Failure (stored as
// failed, without fn's writes) or another error (rolled back, nothing
// stored, returned). No savepoint guards fn: a *Failure rolls the whole
// transaction back and is stored in one of its own; should a request of
// the same key finish it in between, the failed request gets that
// outcome, replayed.
func (s *Store) Do(ctx context.Context, req Request, fn func(ctx context.Context, tx delivery.DBTX) (Response, error)) (Result, error) {
	if s.cfg.DB == nil {
		return Result{}, errors.New("idempotency: Config.DB is required for Do")
	}
	var fail *Failure
	res, err := s.inClaim(ctx, req, func(ctx context.Context, tx delivery.DBTX) (Status, Response, error) {
		resp, err := fn(ctx, tx)
		if errors.As(err, &fail) {
			return "", Response{}, err
		}
		return StatusCompleted, resp, err
	})
	if fail == nil {
		return res, err
	}
	// No savepoint guards fn's writes (it was a statement and a round trip
	// of every request; failures are rare): its transaction, claim and
	// all, is rolled back now, and the failure is stored in one of its
	// own. A request of the same key that claimed it meanwhile decides:
	// its stored outcome is replayed, as it would be to any later request.
	if afterFailureRollback != nil {
		afterFailureRollback(req)
	}
	return s.inClaim(ctx, req, func(context.Context, delivery.DBTX) (Status, Response, error) {
		return StatusFailed, fail.Response, nil
	})
}

// afterFailureRollback, if set (by the package's tests), runs between the
// rollback of a request that failed and the storing of its failure.
var afterFailureRollback func(Request)

// inClaim claims req in a READ COMMITTED transaction of its own and, if
// the key is this caller's to execute, runs fn in it and stores the
// outcome fn returns, in the same commit; a key finished already is
// replayed. An error of fn rolls everything back.
//
// On a pgx pool the transaction is a dbtx.Pipe: BEGIN goes with the
// claim, and what fn queues (dbtx.Queue) with the completion, so that a
// request costs its callback's round trips and three of its own (claim,
// completion, commit).
func (s *Store) inClaim(ctx context.Context, req Request, fn func(ctx context.Context, tx delivery.DBTX) (Status, Response, error)) (Result, error) {
	var res Result
	piped, err := dbtx.WithPipe(ctx, s.cfg.DB, "idempotency", func(p *dbtx.Pipe) error {
		var err error
		res, err = s.claimAndRun(ctx, p, req, fn, func() error { return p.Commit(ctx) })
		return err
	})
	if piped {
		return res, err
	}
	tx, err := s.cfg.DB.BeginTx(ctx, &sql.TxOptions{Isolation: sql.LevelReadCommitted})
	if err != nil {
		return Result{}, fmt.Errorf("idempotency: beginning transaction: %w", err)
	}
	defer tx.Rollback() //nolint:errcheck // no-op after Commit
	return s.claimAndRun(ctx, tx, req, fn, tx.Commit)
}

// claimAndRun is inClaim in tx, which commit commits.
func (s *Store) claimAndRun(ctx context.Context, tx delivery.DBTX, req Request, fn func(ctx context.Context, tx delivery.DBTX) (Status, Response, error), commit func() error) (Result, error) {
	claim, err := s.claimTx(ctx, tx, req, s.lockTimeout, false)
	if err != nil {
		return Result{}, err
	}
	if !claim.Execute {
		if err := commit(); err != nil {
			return Result{}, fmt.Errorf("idempotency: committing %s/%s: %w", req.Scope, req.Key, err)
		}
		return Result{Status: claim.Record.Status, Response: claim.Record.Response, Replayed: true}, nil
	}
	status, resp, err := fn(ctx, tx)
	if err != nil {
		return Result{}, err
	}
	if err := s.CompleteTx(ctx, tx, req, status, resp); err != nil {
		return Result{}, err
	}
	if err := commit(); err != nil {
		return Result{}, fmt.Errorf("idempotency: committing %s/%s: %w", req.Scope, req.Key, err)
	}
	return Result{Status: status, Response: resp}, nil
}

// Get returns the stored record of a key.
func (s *Store) Get(ctx context.Context, scope, key string) (Record, error) {
	if s.cfg.DB == nil {
		return Record{}, errors.New("idempotency: Config.DB is required for Get")
	}
	return s.GetTx(ctx, s.cfg.DB, scope, key)
}

// GetTx is Get through tx: it reads the record as tx sees it, without
// locking it.
func (s *Store) GetTx(ctx context.Context, tx delivery.DBTX, scope, key string) (Record, error) {
	rec, err := scanRecord(tx.QueryRowContext(ctx, getRecordSQL, scope, key), Request{Scope: scope, Key: key})
	if errors.Is(err, sql.ErrNoRows) {
		return Record{}, fmt.Errorf("%w: %s/%s", ErrNoSuchKey, scope, key)
	}
	return rec, err
}

// lockRecord reads req's key under a row lock, with how long its lease
// has left on the database's clock (zero when it has none or it ran out).
func lockRecord(ctx context.Context, tx delivery.DBTX, req Request) (Record, time.Duration, error) {
	var left float64
	rec, err := scanRecord(tx.QueryRowContext(ctx, lockRecordSQL, req.Scope, req.Key), req, &left)
	if errors.Is(err, sql.ErrNoRows) {
		// Deleted between our insert attempt and the lock (the reaper, or a
		// racer that rolled back after our snapshot); the caller retries.
		return Record{}, 0, fmt.Errorf("%w: key vanished while claiming", ErrConflict)
	}
	return rec, time.Duration(left * float64(time.Second)), err
}

// scanRecord scans recordColumns, then extra.
func scanRecord(row *sql.Row, req Request, extra ...any) (Record, error) {
	var (
		rec                   Record
		status                string
		code                  sql.NullInt64
		meta                  []byte
		token                 uuid.NullUUID
		lockedUntil, complete sql.NullTime
	)
	err := row.Scan(append([]any{&rec.Hash, &status, &code, &rec.Response.Body, &meta, &rec.Attempts,
		&token, &lockedUntil, &rec.CreatedAt, &rec.UpdatedAt, &complete}, extra...)...)
	if err != nil {
		return Record{}, err
	}
	rec.Scope, rec.Key = req.Scope, req.Key
	rec.Status = Status(status)
	rec.Response.Code = int(code.Int64)
	if len(meta) > 0 {
		rec.Response.Meta = meta
	}
	rec.LeaseToken = token.UUID
	rec.LockedUntil = lockedUntil.Time
	rec.CompletedAt = complete.Time
	return rec, nil
}

func checkHash(req Request, rec Record) error {
	if string(rec.Hash) != string(req.Hash) {
		return fmt.Errorf("%w: %s/%s", ErrKeyReused, req.Scope, req.Key)
	}
	return nil
}

func checkFinal(status Status) error {
	if status != StatusCompleted && status != StatusFailed {
		return fmt.Errorf("%w: a key completes as %q or %q, not %q", ErrInvalidRequest, StatusCompleted, StatusFailed, status)
	}
	return nil
}

// claimError classifies the errors of a claim's statements.
func (s *Store) claimError(req Request, err error) error {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		switch pgErr.Code {
		case pgerrcode.LockNotAvailable: // the holder outlived lock_timeout
			return fmt.Errorf("%w: %w", &InProgressError{Scope: req.Scope, Key: req.Key}, err)
		case pgerrcode.SerializationFailure, pgerrcode.DeadlockDetected: // a racer under REPEATABLE READ / SERIALIZABLE
			return fmt.Errorf("%w: %s/%s: %w", ErrConflict, req.Scope, req.Key, err)
		}
	}
	return fmt.Errorf("idempotency: claiming %s/%s: %w", req.Scope, req.Key, err)
}

func nullJSON(m json.RawMessage) any {
	if len(m) == 0 {
		return nil
	}
	return []byte(m)
}
