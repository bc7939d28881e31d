package transport

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strconv"
	"sync"
	"time"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v3/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgconn"
)

// RetryPolicy says how the failed attempts of one delivery are retried.
// Zero values take the documented defaults.
type RetryPolicy struct {
	// MaxAttempts is how many attempts one delivery gets before its message
	// is dead-lettered. Default: 5.
	MaxAttempts int
	// InitialBackoff is the wait before the second attempt; it doubles up to
	// MaxBackoff. Defaults: 100ms and 2s. The attempts and waits of one
	// delivery must fit well within Config.AckDeadline.
	InitialBackoff time.Duration
	MaxBackoff     time.Duration
	// DeadLetterTopic receives, in the same transaction, a copy of each
	// message whose attempts ran out or that failed permanently, with
	// DeadLetter* metadata; the lane then moves on. Empty: such a message is
	// nacked and redelivered without end, holding up its lane.
	DeadLetterTopic string
}

func (p *RetryPolicy) setDefaults() {
	if p.MaxAttempts == 0 {
		p.MaxAttempts = 5
	}
	if p.InitialBackoff == 0 {
		p.InitialBackoff = 100 * time.Millisecond
	}
	if p.MaxBackoff == 0 {
		p.MaxBackoff = 2 * time.Second
	}
}

func (p *RetryPolicy) validate(ackDeadline time.Duration) error {
	p.setDefaults()
	if p.MaxAttempts < 1 {
		return fmt.Errorf("retry: MaxAttempts must be positive, got %d", p.MaxAttempts)
	}
	if p.InitialBackoff < 0 || p.MaxBackoff < p.InitialBackoff {
		return fmt.Errorf("retry: need 0 <= InitialBackoff (%s) <= MaxBackoff (%s)", p.InitialBackoff, p.MaxBackoff)
	}
	if p.DeadLetterTopic != "" {
		if err := ValidateTopic(p.DeadLetterTopic); err != nil {
			return fmt.Errorf("retry: dead-letter topic: %w", err)
		}
	}
	if total := p.totalBackoff(); total > ackDeadline/2 {
		return fmt.Errorf("retry: %d attempts wait %s in all, more than half the ack deadline (%s)", p.MaxAttempts, total, ackDeadline)
	}
	return nil
}

// backoff is the wait after the given failed attempt (1-based).
func (p RetryPolicy) backoff(attempt int) time.Duration {
	d := p.InitialBackoff
	for i := 1; i < attempt && d < p.MaxBackoff; i++ {
		d *= 2
	}
	return min(d, p.MaxBackoff)
}

func (p RetryPolicy) totalBackoff() time.Duration {
	var total time.Duration
	for a := 1; a < p.MaxAttempts; a++ {
		total += p.backoff(a)
	}
	return total
}

// HandlerOption configures one handler.
type HandlerOption func(*route)

// WithRetry sets the handler's retry policy instead of Config.Retry.
func WithRetry(p RetryPolicy) HandlerOption { return func(r *route) { r.retry = p } }

// Metadata a dead-lettered copy carries.
const (
	DeadLetterReason   = "dead_letter_reason"
	DeadLetterAttempts = "dead_letter_attempts"
	DeadLetterTopic    = "dead_letter_topic"
	DeadLetterHandler  = "dead_letter_handler"
	DeadLetterGroup    = "dead_letter_group"
	DeadLetterAt       = "dead_letter_at"
)

// PermanentError marks a failure that no retry can fix (a message that
// cannot be decoded, a key reused for another request): the message is
// dead-lettered at once.
type PermanentError struct{ Err error }

func (e *PermanentError) Error() string { return "permanent: " + e.Err.Error() }
func (e *PermanentError) Unwrap() error { return e.Err }

// Permanent marks err as permanent. Permanent(nil) is nil.
func Permanent(err error) error {
	if err == nil {
		return nil
	}
	return &PermanentError{Err: err}
}

// IsPermanent reports whether err, or an error it wraps, is permanent.
func IsPermanent(err error) bool {
	var p *PermanentError
	return errors.As(err, &p)
}

// InsteadError asks for the failed attempt to be rolled back and Handler to
// run in a fresh attempt in its place; if that attempt succeeds, the message
// is done. The step runtime uses it to record a business failure without the
// writes of the handler that decided it.
type InsteadError struct {
	Handler HandlerFunc
	Cause   error
}

func (e *InsteadError) Error() string { return "rolled back: " + e.Cause.Error() }
func (e *InsteadError) Unwrap() error { return e.Cause }

// Instead returns an InsteadError.
func Instead(h HandlerFunc, cause error) error { return &InsteadError{Handler: h, Cause: cause} }

// ErrDeadLettered is returned by HandleInTx for a message it dead-lettered.
var ErrDeadLettered = errors.New("transport: message dead-lettered")

type attemptKey struct{}

// AttemptFromContext returns the number (1-based) of the delivery attempt
// running under ctx, or 0 outside a Router handler.
func AttemptFromContext(ctx context.Context) int {
	n, _ := ctx.Value(attemptKey{}).(int)
	return n
}

// route is one handler of a Router.
type route struct {
	r       *Router
	name    string
	topic   string // the logical topic
	lane    string // the physical topic read
	group   string
	offsets string // quoted offsets table of lane
	h       HandlerFunc
	retry   RetryPolicy

	sp *savepointState // shared by the copies of a route; see openSavepoint
}

// outcome of one attempt.
type outcome int

const (
	kept      outcome = iota // the attempt's work and its ack are in the batch
	failed                   // rolled back; the transaction is usable
	abandoned                // the batch transaction is doomed; ack and move on
	stuck                    // the transaction's state is unknown; nack
)

// deliver runs the attempts of one delivery of msg.
func (rt *route) deliver(msg *message.Message) error {
	delivery := msg.Context()
	raw, ok := wsql.TxFromContext(delivery)
	if !ok {
		return fmt.Errorf("%w (handler %s)", ErrNoTransaction, rt.name)
	}
	xid, offset, err := position(msg.Metadata)
	if err != nil {
		return fmt.Errorf("transport: handler %s: %w", rt.name, err)
	}
	// Statements must not be cancelled mid-flight when the subscriber gives
	// up on the message; statement_timeout bounds them instead.
	ctx := context.WithoutCancel(delivery)
	ack := attemptAck(rt.offsets, rt.group, xid, offset)
	log := rt.r.log.With("handler", rt.name, "message_uuid", msg.UUID)

	for n := 1; ; n++ {
		out, err := rt.attempt(ctx, raw, msg, n, ack, rt.h)
		var instead *InsteadError
		if out == failed && errors.As(err, &instead) {
			out, err = rt.attempt(ctx, raw, msg, n, ack, instead.Handler)
		}
		switch out {
		case kept:
			if delivery.Err() != nil {
				log.Error("handler outlived its delivery (ack deadline or close); its writes may have been committed without the message's ack")
			}
			return nil
		case abandoned:
			return nil
		case stuck:
			return err
		}
		if isSerializationFailure(err) {
			// The batch runs at REPEATABLE READ: a retry in the same
			// snapshot fails the same way. Redeliver in a new transaction.
			log.Info("serialization failure; redelivering the batch in a new transaction", "err", err)
			return rt.abandon(ctx, raw, msg, err)
		}
		permanent := IsPermanent(err)
		if !permanent && n < rt.retry.MaxAttempts {
			log.Warn("attempt failed; retrying", "attempt", n, "err", err)
			select {
			case <-time.After(rt.retry.backoff(n)):
				continue
			case <-rt.r.gate.closing:
				return err // nack; redelivered after the restart
			}
		}
		if rt.retry.DeadLetterTopic == "" {
			log.Error("attempts exhausted and no dead-letter topic; nacking", "attempts", n, "permanent", permanent, "err", err)
			return err
		}
		log.Error("dead-lettering message", "attempts", n, "permanent", permanent, "err", err, "dead_letter_topic", rt.retry.DeadLetterTopic)
		dead := deadLetter(msg, rt, n, err)
		out, derr := rt.attempt(ctx, raw, msg, n+1, ack, func(m *message.Message) error {
			tx, _ := TxFromContext(m.Context())
			return rt.r.t.Publisher(tx).Publish(rt.retry.DeadLetterTopic, dead)
		})
		if out == kept || out == abandoned {
			return nil
		}
		return errors.Join(err, fmt.Errorf("dead-lettering: %w", derr))
	}
}

// attempt runs h once inside a savepoint and, if it succeeds, sends its
// deferred statements and keeps it, storing the message's offset for the
// group in the same round trip (see keepAttemptSQL).
func (rt *route) attempt(ctx context.Context, raw *sql.Tx, msg *message.Message, n int, ack string, h HandlerFunc) (outcome, error) {
	// Registered before it touches the transaction: once Close has begun,
	// no new attempt starts, so the attempts Close may have to cut off are
	// exactly the registered ones.
	att := newAttemptTx(raw)
	if !rt.r.gate.track(att) {
		return failed, ErrClosing
	}
	defer rt.r.gate.untrack(att)
	if err := rt.openSavepoint(ctx, raw); err != nil {
		return rt.abandonOutcome(ctx, raw, msg, fmt.Errorf("opening attempt savepoint: %w", err))
	}
	// The handler gets a copy: an Ack or Nack it sends must not reach the
	// subscriber, which would move on while the attempt is still open.
	hm := msg.Copy()
	hm.SetContext(context.WithValue(ContextWithTx(ctx, att), attemptKey{}, n))
	herr := call(h, hm)
	att.revoke()

	if herr == nil {
		herr = att.failedFlush()
	}
	if herr == nil {
		q, args := composeStatements(att.takeDeferred(), ack)
		_, err := raw.ExecContext(ctx, q, args...)
		if err == nil {
			return kept, nil
		}
		if isUndefinedTable(err) {
			err = fmt.Errorf("%w: %w", ErrUnknownTopic, err)
		}
		// A deferred statement failed, or the handler reported success
		// over a failed statement it ignored: the attempt failed.
		herr = fmt.Errorf("transport: handler %s succeeded but its attempt could not be kept: %w", rt.name, err)
	}
	if _, err := raw.ExecContext(ctx, rollbackAttemptSQL); err != nil {
		return rt.abandonOutcome(ctx, raw, msg, errors.Join(herr, fmt.Errorf("rolling back attempt: %w", err)))
	}
	// ROLLBACK TO keeps the savepoint: the next attempt starts in it.
	return failed, herr
}

// openSavepoint makes sure an attempt savepoint is open in raw. The first
// attempt of a batch also bounds the batch's statements; later ones find
// the savepoint their predecessor opened when it was kept or rolled back.
func (rt *route) openSavepoint(ctx context.Context, raw *sql.Tx) error {
	q, err := rt.sp.begin(raw, rt.r.t.beginBatch)
	if err != nil || q == "" {
		return err
	}
	if _, err := raw.ExecContext(ctx, q); err != nil {
		return err
	}
	rt.sp.set(raw, true)
	return nil
}

// savepointState tracks whether an attempt savepoint is open in a route's
// current batch transaction, so that an attempt opens one only when none is:
// two nested savepoints of one name would let the ROLLBACK TO of a failed
// keep (after its RELEASE) land on the older one and silently take back a
// message already kept. A subscription hands out one message at a time, but
// a handler that outlives the ack deadline still runs while the subscriber
// commits its batch and starts the next, so the state is locked, belongs to
// the current batch only, and a batch that has been replaced can no longer
// change it or become current again.
type savepointState struct {
	mu      sync.Mutex
	current *sql.Tx
	open    bool
	past    [8]*sql.Tx // recent batches, kept so their addresses are not reused meanwhile
	next    int
}

// errBatchReplaced is returned to an attempt whose batch transaction is no
// longer its route's current one.
var errBatchReplaced = errors.New("transport: the delivery batch has been replaced (ack deadline passed)")

// begin returns the statement that opens an attempt savepoint in raw: none
// if one is open, beginBatch if raw is a new batch.
func (s *savepointState) begin(raw *sql.Tx, beginBatch string) (string, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	switch {
	case raw == s.current && s.open:
		return "", nil
	case raw == s.current:
		return openAttemptSQL, nil
	case slices.Contains(s.past[:], raw):
		return "", errBatchReplaced
	}
	if s.current != nil {
		s.past[s.next] = s.current
		s.next = (s.next + 1) % len(s.past)
	}
	s.current, s.open = raw, false
	return beginBatch, nil
}

// set records whether a savepoint is open in raw, if raw is current.
func (s *savepointState) set(raw *sql.Tx, open bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if raw == s.current {
		s.open = open
	}
}

// abandon gives up on the batch transaction, returning what the handler
// function must return: nil (ack) if the batch is now certain to fail,
// an error (nack) otherwise.
func (rt *route) abandon(ctx context.Context, raw *sql.Tx, msg *message.Message, cause error) error {
	out, err := rt.abandonOutcome(ctx, raw, msg, cause)
	if out == abandoned {
		return nil
	}
	return err
}

// abandonOutcome gives up on the batch transaction when an attempt's
// savepoint cannot be opened or rolled back, or a retry in it cannot help:
// the transaction either already cannot commit or may hold a partial
// attempt. If it is made certain to fail, the message is acked so the
// subscriber moves on quickly: its offset update then fails, and the whole
// batch rolls back and is redelivered. If that cannot be made certain, the
// message is nacked and the lane waits for the ack deadline, which is slow
// but never commits a partial attempt on purpose.
func (rt *route) abandonOutcome(ctx context.Context, raw *sql.Tx, msg *message.Message, cause error) (outcome, error) {
	rt.sp.set(raw, false)
	_, err := raw.ExecContext(ctx, doomBatchSQL)
	if doomed(err) {
		level := slog.LevelWarn
		switch {
		case isSerializationFailure(cause):
			level = slog.LevelInfo // routine under concurrency; logged by deliver
		case isAborted(cause):
			level = slog.LevelDebug // an earlier message of the batch abandoned it
		}
		rt.r.log.Log(ctx, level, "abandoning delivery batch; it will be redelivered",
			"handler", rt.name, "message_uuid", msg.UUID, "cause", cause)
		return abandoned, cause
	}
	rt.r.log.Error("delivery transaction in an unknown state; nacking and waiting for the ack deadline",
		"handler", rt.name, "message_uuid", msg.UUID, "cause", cause, "err", err)
	return stuck, errors.Join(cause, err)
}

// deadLetter copies msg for the dead-letter topic.
func deadLetter(msg *message.Message, rt *route, attempts int, cause error) *message.Message {
	dead := msg.Copy()
	delete(dead.Metadata, positionKey)
	reason := cause.Error()
	if len(reason) > 2000 {
		reason = reason[:2000] + "…"
	}
	dead.Metadata.Set(DeadLetterReason, reason)
	dead.Metadata.Set(DeadLetterAttempts, strconv.Itoa(attempts))
	dead.Metadata.Set(DeadLetterTopic, rt.topic)
	dead.Metadata.Set(DeadLetterHandler, rt.name)
	dead.Metadata.Set(DeadLetterGroup, rt.group)
	dead.Metadata.Set(DeadLetterAt, time.Now().UTC().Format(time.RFC3339Nano))
	return dead
}

// isAborted reports whether err says the transaction was already aborted.
func isAborted(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && pgErr.Code == "25P02"
}

func isSerializationFailure(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && (pgErr.Code == "40001" || pgErr.Code == "40P01")
}

// HandleInTx handles msg outside a subscriber, each attempt in a READ
// COMMITTED transaction of its own that commits when the attempt succeeds:
// the counterpart of a Router handler for messages that arrive another way
// (an HTTP request, another transport). Retries, Instead and dead-lettering
// work as in a Router; a dead-lettered message returns ErrDeadLettered with
// the cause. name and topic only label dead letters.
func (t *Transport) HandleInTx(ctx context.Context, name, topic string, msg *message.Message, h HandlerFunc, opts ...HandlerOption) error {
	if t.cfg.Intercept != nil {
		h = t.cfg.Intercept(name, h)
	}
	rt := &route{name: name, topic: topic, group: name, h: h, retry: t.cfg.Retry, sp: &savepointState{}}
	for _, opt := range opts {
		opt(rt)
	}
	if err := rt.retry.validate(t.cfg.AckDeadline); err != nil {
		return fmt.Errorf("transport: %s: %w", name, err)
	}
	log := t.log.With("handler", name, "message_uuid", msg.UUID)
	for n := 1; ; n++ {
		err := t.ownAttempt(ctx, msg, n, h)
		var instead *InsteadError
		if errors.As(err, &instead) {
			err = t.ownAttempt(ctx, msg, n, instead.Handler)
		}
		if err == nil {
			return nil
		}
		if ctx.Err() != nil {
			return err
		}
		permanent := IsPermanent(err)
		if !permanent && n < rt.retry.MaxAttempts {
			log.Warn("attempt failed; retrying", "attempt", n, "err", err)
			select {
			case <-time.After(rt.retry.backoff(n)):
				continue
			case <-ctx.Done():
				return err
			}
		}
		if rt.retry.DeadLetterTopic == "" {
			return err
		}
		log.Error("dead-lettering message", "attempts", n, "permanent", permanent, "err", err, "dead_letter_topic", rt.retry.DeadLetterTopic)
		dead := deadLetter(msg, rt, n, err)
		if derr := t.ownAttempt(ctx, msg, n+1, func(m *message.Message) error {
			tx, _ := TxFromContext(m.Context())
			return t.Publisher(tx).Publish(rt.retry.DeadLetterTopic, dead)
		}); derr != nil {
			return errors.Join(err, fmt.Errorf("dead-lettering: %w", derr))
		}
		return fmt.Errorf("%w: %w", ErrDeadLettered, err)
	}
}

// ownAttempt runs h in a transaction of its own.
func (t *Transport) ownAttempt(ctx context.Context, msg *message.Message, n int, h HandlerFunc) error {
	tx, err := t.db.BeginTx(ctx, &sql.TxOptions{Isolation: sql.LevelReadCommitted})
	if err != nil {
		return fmt.Errorf("transport: beginning transaction: %w", err)
	}
	defer tx.Rollback() //nolint:errcheck // no-op after Commit
	if _, err := tx.ExecContext(ctx, t.beginOwn); err != nil {
		return fmt.Errorf("transport: setting transaction timeouts: %w", err)
	}
	hm := msg.Copy()
	hm.SetContext(context.WithValue(ContextWithTx(ctx, tx), attemptKey{}, n))
	if err := call(h, hm); err != nil {
		return err
	}
	if err := tx.Commit(); err != nil {
		return fmt.Errorf("transport: committing: %w", err)
	}
	return nil
}
