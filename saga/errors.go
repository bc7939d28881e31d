package saga

import (
	"errors"
)

// The errors the package returns, for errors.Is; each error a call returns
// wraps one of them, with details after it. What the delivery returns
// (dead letters, consumer groups, a message too large, missing
// privileges) is package delivery's: delivery.ErrNoSuchDeadLetter,
// delivery.ErrMessageTooLarge, a *delivery.ConsumerGroupAliveError, ….

// Building and registering sagas.
var (
	// ErrInvalidName is returned when a step's name is not 1 to
	// MaxStepName bytes of UTF-8 without control characters, or a trigger
	// gives a key that is empty, not UTF-8, holds a NUL, or does not
	// survive its encoding as JSON.
	ErrInvalidName = errors.New("saga: invalid name")
	// ErrClientStarted is returned when sagas, steps or projections are
	// added to a client that has started, and by a second Start.
	ErrClientStarted = errors.New("saga: the client has started; add sagas, steps and projections before Start")
	// ErrDefinitionChanged is returned by Setup and Start when a
	// definition's steps differ from those its version was first recorded
	// with while instances of that version are unfinished (running,
	// compensating, or parked as failed, which an operator may retry):
	// they would be misread. Give the changed definition a new Version and
	// keep registering the old one until its instances finish.
	ErrDefinitionChanged = errors.New("saga: a definition's steps changed without a new version")
)

// Starting sagas and publishing.
var (
	// ErrUnknownDefinition is returned when a call names a saga this
	// process has not registered, or meets an instance of a version it
	// does not know (another release's: that release handles it).
	ErrUnknownDefinition = errors.New("saga: definition not known to this process")
	// ErrTriggerType is returned by StartTx when the trigger is not of the
	// saga's trigger type (its On).
	ErrTriggerType = errors.New("saga: the trigger is not of the saga's trigger type")
	// ErrNotATransaction is returned by StartTx when given no transaction,
	// or a *sql.DB or *sql.Conn, whose every statement commits on its own
	// (the saga and its trigger would not commit or roll back with the
	// caller's work), and by PublishTx for a nil tx.
	ErrNotATransaction = errors.New("saga: a transaction is required (a *sql.Tx, or a pgx.Tx through PgxTx)")
	// ErrNilMessage is returned by PublishTx when given a nil message.
	ErrNilMessage = errors.New("saga: nil message")
)

// Reading and operating instances.
var (
	// ErrNoSuchSaga is returned when no instance has the id a call names
	// (Get, Retry, Cancel, Ask; WaitFinished waits for it to appear).
	ErrNoSuchSaga = errors.New("saga: instance not found")
	// ErrNotRetryable is returned by Retry (and recorded for a retry
	// request) when the instance is not parked as failed: it is running,
	// compensating, completed or compensated, or its definition cannot read
	// it (ErrDefinitionMismatch).
	ErrNotRetryable = errors.New("saga: instance cannot be retried")
	// ErrNotCancellable is returned by Cancel (and recorded for a cancel
	// request) when the instance has finished, or its definition cannot
	// read it (ErrDefinitionMismatch).
	ErrNotCancellable = errors.New("saga: instance cannot be cancelled")
	// ErrConcurrentChange is returned when the instance changed between
	// the call's read and its write (another worker's reply, a sweep, a
	// second operator): try again on what it is now.
	ErrConcurrentChange = errors.New("saga: instance changed concurrently")
	// ErrDefinitionMismatch is returned when an instance's definition
	// cannot read it (a step index outside the definition, an unknown
	// phase, a phase whose command the step lacks), as after a definition
	// changed its steps without a new Version. The sweeper and the reply
	// handler park such an instance with the reason; an operator's retry
	// or cancel of it is refused.
	ErrDefinitionMismatch = errors.New("saga: instance does not match its definition")
	// ErrUnknownRequest is returned by Ask for a request kind it does not
	// know.
	ErrUnknownRequest = errors.New("saga: invalid request")
	// ErrForgedReply is the reason a reply is dead-lettered when it
	// answers the command in flight without the command's reply token
	// (steps.MetaReplyToken): it changes nothing, as whoever published it
	// could not read the command.
	ErrForgedReply = errors.New("saga: forged reply: it does not carry its command's reply token")
	// ErrSchemaNotOnPath is returned by Migrate, Setup and Start when
	// ClientConfig.Schema names a schema the pool's connections do not
	// resolve names in first (their search_path): pgsaga would read and
	// write tables elsewhere.
	ErrSchemaNotOnPath = errors.New("saga: ClientConfig.Schema is not the connections' current schema")
)
