package transport

import (
	"context"
	"errors"
	"fmt"
	"regexp"
	"runtime/debug"
	"strings"
	"time"
	"unicode/utf8"

	pub "github.com/pgsaga/pgsaga/saga/delivery"

	"github.com/pgsaga/pgsaga/internal/outcome"
	"github.com/pgsaga/pgsaga/internal/pgerr"
)

// Errors callers can branch on: those of package delivery, where users
// match them.
var (
	ErrInvalidTopic         = pub.ErrInvalidTopic
	ErrInvalidConsumerGroup = pub.ErrInvalidConsumerGroup
	ErrInvalidChannel       = pub.ErrInvalidChannel
	ErrInvalidMessageID     = pub.ErrInvalidMessageID
	ErrMessageTooLarge      = pub.ErrMessageTooLarge
	ErrHandlerPanicked      = pub.ErrHandlerPanicked
	ErrAttemptTimeout       = pub.ErrAttemptTimeout
	ErrTransactionEnded     = pub.ErrTransactionEnded
	ErrHandlerNotCalled     = pub.ErrHandlerNotCalled
	ErrAttemptOver          = pub.ErrAttemptOver
	ErrNoTransaction        = pub.ErrNoTransaction
	ErrClosing              = pub.ErrClosing
	ErrRouterClosed         = pub.ErrRouterClosed
	ErrCloseTimeout         = pub.ErrCloseTimeout
	ErrSubscriberClosed     = pub.ErrSubscriberClosed
	ErrDeadLettered         = pub.ErrDeadLettered
	ErrAwaitedTooOften      = pub.ErrAwaitedTooOften
	ErrAwaitedAgain         = pub.ErrAwaitedAgain
	ErrSettingsDiffer       = pub.ErrSettingsDiffer
	ErrNotPgx               = pub.ErrNotPgx
	ErrNotUTF8              = pub.ErrNotUTF8
	ErrUnstorable           = pub.ErrUnstorable
	ErrMissingPrivileges    = pub.ErrMissingPrivileges
	ErrNoSuchDeadLetter     = pub.ErrNoSuchDeadLetter
	ErrAlreadyReplayed      = pub.ErrAlreadyReplayed
	ErrTopicNotSubscribed   = pub.ErrTopicNotSubscribed
	ErrNotReplayable        = pub.ErrNotReplayable
	ErrInvalidDeletion      = pub.ErrInvalidDeletion
	ErrConsumerGroupAlive   = pub.ErrConsumerGroupAlive
	ErrNoSuchConsumerGroup  = pub.ErrNoSuchConsumerGroup
)

// PermanentError marks a failure that no retry can fix (a message that
// cannot be decoded, a key reused for another request): the message is
// dead-lettered at once.
type PermanentError struct{ Err error }

// Error implements error.
func (e *PermanentError) Error() string { return "permanent: " + e.Err.Error() }

// Unwrap returns the underlying error.
func (e *PermanentError) Unwrap() error { return e.Err }

// Outcome implements outcome.Classifier.
func (e *PermanentError) Outcome() outcome.Kind { return outcome.Permanent }

// Permanent marks err as permanent. Permanent(nil) is nil.
func Permanent(err error) error {
	if err == nil {
		return nil
	}
	return &PermanentError{Err: err}
}

// IsPermanent reports whether no retry can change how err ended handling:
// a permanent error or a business failure (see package outcome: Permanent,
// steps.Fail, idempotency.Reject, a message that cannot be decoded, a key
// reused for another request), the handler ending its transaction, or
// PostgreSQL refusing bytes it can never store (invalid in the database
// encoding, or a JSON \u0000), which the same message would hit every time.
func IsPermanent(err error) bool {
	return outcome.Final(err) || errors.Is(err, ErrTransactionEnded) || pgerr.BadInput(err)
}

// InsteadError asks for the failed attempt to be rolled back and Handler to
// run in a fresh attempt in its place; if that attempt succeeds, the message
// is done. The step runtime uses it to record a business failure without the
// writes of the handler that decided it.
type InsteadError struct {
	Handler HandlerFunc
	Cause   error
}

// Error implements error.
func (e *InsteadError) Error() string { return "rolled back: " + e.Cause.Error() }

// Unwrap returns the underlying error.
func (e *InsteadError) Unwrap() error { return e.Cause }

// Instead returns an InsteadError.
func Instead(h HandlerFunc, cause error) error { return &InsteadError{Handler: h, Cause: cause} }

// AwaitError hands a message back while Call runs outside the delivery's
// transaction: build it with Await.
type AwaitError struct {
	// Within bounds the call: its context ends then, and a message whose
	// process died meanwhile is delivered again then.
	Within time.Duration
	// Call is the work that waits on the world outside the database (an
	// external service): it records its outcome where the handler's next
	// run finds it, and returns nil, or fails the attempt.
	Call func(ctx context.Context) error
}

// Error implements error.
func (e *AwaitError) Error() string {
	return fmt.Sprintf("transport: the handler awaits a call (within %s) outside its transaction", e.Within)
}

// Await is what a handler returns when its work must wait for something
// outside the database, such as a call to a payment gateway, that must not
// hold a transaction open: the attempt is rolled back (whatever the
// handler committed on its own stays, a lease say), and call runs outside
// any transaction, within the given bound. Then the handler runs again, and
// finds what call recorded.
//
// For a queued delivery the message is handed back to its queue, parked
// for within, and its batch goes on with the other messages; no attempt is
// counted. When call returns nil the message is woken and delivered again
// at once, still as the same attempt (in-process deliveries from it
// included); when it fails, the failure is the attempt's (retried after
// its backoff, dead-lettered when attempts run out); if the process stops,
// the call is cancelled and the message woken for the next worker; if it
// dies, the message comes back after within. A message whose handler
// awaits more than RetryPolicy.MaxAttempts times fails its attempts with
// ErrAwaitedTooOften from then on, so a handler that awaits for ever still
// ends in a dead letter. A call that returns while its batch holds for it
// (Config.AwaitHold: the batch holds for its calls once its deliveries are
// done) is followed by the handler's run in that batch, right before it
// commits, and its message is not handed back.
//
// Outside a queue (HandleInTx, an in-process delivery) there is nothing to
// hand back: call runs inline, within the attempt's deadline, and the
// handler runs again in a fresh attempt; awaiting again then fails the
// attempt with ErrAwaitedAgain.
//
// A call with no function or no positive bound is a permanent failure.
func Await(within time.Duration, call func(ctx context.Context) error) error {
	if call == nil || within <= 0 {
		return Permanent(fmt.Errorf("transport: Await needs a call and a positive bound (got %s)", within))
	}
	return &AwaitError{Within: within, Call: call}
}

// HandBackError hands a message back to its queue untouched: the attempt
// is rolled back, no attempt is counted, and the message becomes available
// again after a short while (doubling with each hand-back, up to
// maxHandBack), for whichever consumer of its group claims it then. For a
// handler that cannot handle the message in this process but another
// process of the group can: the saga engine of one release, during a
// rolling deploy, given a reply for a definition version only the other
// release knows. Build it with HandBack. Outside a queue (HandleInTx) it
// is returned to the caller as it is, neither retried nor dead-lettered;
// an in-process delivery that hands back is queued instead.
type HandBackError struct{ Cause error }

// Error implements error.
func (e *HandBackError) Error() string { return "handed back: " + e.Cause.Error() }

// Unwrap returns the cause.
func (e *HandBackError) Unwrap() error { return e.Cause }

// HandBack returns a HandBackError for cause. HandBack(nil) is nil.
func HandBack(cause error) error {
	if cause == nil {
		return nil
	}
	return &HandBackError{Cause: cause}
}

// IsAwait reports whether err awaits a call (Await).
func IsAwait(err error) bool {
	var aw *AwaitError
	return errors.As(err, &aw)
}

// IsHandBack reports whether err hands its message back (HandBack).
func IsHandBack(err error) bool {
	var hb *HandBackError
	return errors.As(err, &hb)
}

// handBackWait is how long a message handed back for the n-th time (from
// 1) waits before it can be claimed again: 250ms doubling, at most
// maxHandBack, so that a message nobody running can handle costs a claim
// every half a minute, not a claim a poll.
func handBackWait(n int) time.Duration {
	return min(250*time.Millisecond<<min(max(n-1, 0), 8), maxHandBack)
}

// maxHandBack bounds handBackWait.
const maxHandBack = 30 * time.Second

// MaxTopicLen bounds a topic's name.
const MaxTopicLen = 255

var namePattern = regexp.MustCompile(`^[A-Za-z0-9\-$:._]+$`)

// ValidateTopic reports whether topic can name a topic.
func ValidateTopic(topic string) error {
	if topic == "" || len(topic) > MaxTopicLen || !namePattern.MatchString(topic) {
		return fmt.Errorf("%w: %q (1 to %d characters from [A-Za-z0-9-$:._])", ErrInvalidTopic, topic, MaxTopicLen)
	}
	return nil
}

// ValidateChannel reports whether channel can name a PostgreSQL
// notification channel pgsaga uses (NotifyChannel, a saga client's
// FinishedChannel): 1 to 63 characters from [A-Za-z0-9-$:._]. The name is
// not echoed.
func ValidateChannel(channel string) error {
	if channel == "" || len(channel) > 63 || !namePattern.MatchString(channel) {
		return fmt.Errorf("%w: 1 to 63 characters from [A-Za-z0-9-$:._] (got %d bytes)", ErrInvalidChannel, len(channel))
	}
	return nil
}

// ValidateConsumerGroup reports whether group can name a consumer group.
func ValidateConsumerGroup(group string) error {
	if group == "" || len(group) > 255 || !namePattern.MatchString(group) {
		return fmt.Errorf("%w: %q", ErrInvalidConsumerGroup, group)
	}
	return nil
}

// PanicError is a recovered panic: a failure of the one message (or item)
// whose handling panicked. Error says what panicked and the panic's value,
// on one short line (PanicValue): it is what a dead letter's reason and a
// saga's failure reason quote. Stack, the goroutine's stack at the panic,
// is for the log only.
type PanicError struct {
	// What panicked: "handler", "router middleware", "awaited call".
	What  string
	Value string
	Stack []byte
}

// Recovered makes a PanicError of p, recovered from what, with the
// current stack. Call it in the deferred function that recovered p.
func Recovered(what string, p any) *PanicError {
	return &PanicError{What: what, Value: PanicValue(p), Stack: debug.Stack()}
}

// Error implements error.
func (e *PanicError) Error() string { return "transport: " + e.What + " panicked: " + e.Value }

// Unwrap makes a PanicError ErrHandlerPanicked.
func (e *PanicError) Unwrap() error { return ErrHandlerPanicked }

// maxPanicValue bounds PanicValue.
const maxPanicValue = 300

// PanicValue renders a panic's value on one line of at most 300 bytes, as
// text PostgreSQL can keep (Storable), for a reason: a panic value can be
// anything, of any size.
func PanicValue(p any) string {
	s := strings.Join(strings.Fields(Storable(fmt.Sprint(p))), " ")
	if len(s) > maxPanicValue {
		cut := maxPanicValue
		for cut > 0 && !utf8.RuneStart(s[cut]) {
			cut--
		}
		s = s[:cut] + "…"
	}
	return s
}

// panicStack is the log attributes of err's panic stack, if err is (or
// wraps) a PanicError: none otherwise.
func panicStack(err error) []any {
	var p *PanicError
	if errors.As(err, &p) && len(p.Stack) > 0 {
		return []any{"stack", string(p.Stack)}
	}
	return nil
}
