package delivery

import (
	"context"
	"errors"
	"fmt"
)

// Errors of the delivery. Their texts start "transport:", the part of
// pgsaga that delivers.
var (
	// ErrInvalidTopic is returned when a topic name is outside
	// [A-Za-z0-9-$:._]{1,255}.
	ErrInvalidTopic = errors.New("transport: invalid topic name")

	// ErrInvalidConsumerGroup is returned when a consumer group's name (a
	// step's, a saga's replies', a bridge's) is outside
	// [A-Za-z0-9-$:._]{1,255}.
	ErrInvalidConsumerGroup = errors.New("transport: invalid consumer group name (1 to 255 characters from [A-Za-z0-9-$:._])")

	// ErrInvalidChannel is returned when a notification channel's name
	// (Config.NotifyChannel, saga.ClientConfig.FinishedChannel) is outside
	// [A-Za-z0-9-$:._]{1,63}.
	ErrInvalidChannel = errors.New("transport: invalid notification channel name")

	// ErrInvalidMessageID is returned when a published message's UUID is
	// empty or longer than 255 bytes.
	ErrInvalidMessageID = errors.New("transport: message UUID must be 1 to 255 bytes")

	// ErrMessageTooLarge is returned when a published message is larger
	// than Config.MaxMessageBytes (a permanent error): nothing of the
	// publish is written.
	ErrMessageTooLarge = errors.New("transport: message larger than MaxMessageBytes")

	// ErrUnstorable is returned when a published message holds text
	// PostgreSQL cannot store (a UUID that is not UTF-8, a NUL in its
	// metadata): nothing of the publish is written.
	ErrUnstorable = errors.New("transport: the message cannot be stored")

	// ErrHandlerPanicked is returned when a handler panicked (it wraps the
	// panic's value); the attempt was rolled back.
	ErrHandlerPanicked = errors.New("transport: handler panicked")

	// ErrAttemptTimeout is returned when an attempt outlived
	// Config.AttemptTimeout (or was cut off by stopping) and was rolled
	// back.
	ErrAttemptTimeout = errors.New("transport: delivery attempt timed out; everything it did was rolled back")

	// ErrTransactionEnded is returned when a handler ended its attempt's
	// transaction (COMMIT, END, ROLLBACK). Nothing of the attempt is kept;
	// the message is dead-lettered, since the handler does it every time.
	ErrTransactionEnded = errors.New("transport: the handler ended its attempt's transaction (COMMIT, END or ROLLBACK); use Savepoint for nested rollback")

	// ErrHandlerNotCalled is returned when a router middleware returned
	// without calling the handler (or called it with a message that lost
	// its context). The delivery counts as a failed attempt.
	ErrHandlerNotCalled = errors.New("transport: a router middleware returned without calling the handler with the delivered message")

	// ErrAttemptOver is returned when a statement is issued through an
	// attempt's transaction after the attempt ended (the handler returned,
	// or it was cut off).
	ErrAttemptOver = errors.New("transport: delivery attempt is over; its transaction can no longer be used")

	// ErrNoTransaction is returned when a handler runs on a message that
	// did not come from pgsaga's delivery.
	ErrNoTransaction = errors.New("transport: message carries no delivery transaction")

	// ErrClosing is returned when an attempt was not started because its
	// router is closing; its message stays queued, untouched. It wraps
	// context.Canceled.
	ErrClosing = fmt.Errorf("transport: router is closing: %w", context.Canceled)

	// ErrRouterClosed is returned when handlers are added to, or a start
	// is asked of, a router that is closed or already runs.
	ErrRouterClosed = errors.New("transport: router is closed")

	// ErrSubscriberClosed is returned when a subscriber is used after it
	// was closed.
	ErrSubscriberClosed = errors.New("transport: subscriber is closed")

	// ErrDeadLettered is returned when a message run outside a queue was
	// dead-lettered.
	ErrDeadLettered = errors.New("transport: message dead-lettered")

	// ErrAwaitedTooOften is returned when a handler awaited more than
	// RetryPolicy.MaxAttempts times without finishing (see steps.Await).
	ErrAwaitedTooOften = errors.New("transport: the handler awaited too often without finishing")

	// ErrAwaitedAgain is returned when a handler run outside a queue
	// awaited again right after its call ran (see steps.Await).
	ErrAwaitedAgain = errors.New("transport: the handler awaited again after its call ran")

	// ErrInProcessBroke is returned when an in-process delivery broke the
	// transaction of the attempt that published its message (its
	// connection was lost, it ended the transaction, it released a
	// savepoint not its own). The publishing attempt fails, as a transient
	// failure; its retry queues the message.
	ErrInProcessBroke = errors.New("transport: an in-process delivery broke its publisher's transaction")

	// ErrNotUTF8 is returned when the database's encoding is not UTF8.
	ErrNotUTF8 = errors.New("pgsaga needs a UTF8 database")

	// ErrSettingsDiffer is returned when a process's configuration differs
	// from what the processes on its database share (the notification
	// channel of wake-ups, Config.NotifyChannel).
	ErrSettingsDiffer = errors.New("transport: this process's settings differ from those of the processes sharing the database")

	// ErrNotPgx is returned when Config.DB is not a database/sql handle
	// over pgx (stdlib.OpenDBFromPool or stdlib.OpenDB).
	ErrNotPgx = errors.New("transport: Config.DB must be a database/sql handle over pgx (stdlib.OpenDBFromPool or stdlib.OpenDB)")

	// ErrMissingPrivileges is returned when the database role lacks a
	// privilege a worker needs to deliver (the error is a *PrivilegeError,
	// which says which). Without it a worker would start and report
	// healthy while every delivery failed.
	ErrMissingPrivileges = errors.New("transport: the database role lacks privileges a worker needs")

	// ErrNoSuchDeadLetter is returned when no dead letter has the ID asked
	// for.
	ErrNoSuchDeadLetter = errors.New("transport: no such dead letter")

	// ErrAlreadyReplayed is returned when a dead letter asked to be
	// replayed was replayed already.
	ErrAlreadyReplayed = errors.New("transport: the dead letter was replayed already")

	// ErrTopicNotSubscribed is returned when a dead letter asked to be
	// replayed is of a topic no consumer group subscribes to: it would be
	// dead-lettered again.
	ErrTopicNotSubscribed = errors.New("transport: no consumer group reads the dead letter's topic")

	// ErrNotReplayable is returned when a dead letter asked to be replayed
	// cannot be: a message a broker bridge received but could not queue
	// (ReceiveHandler).
	ErrNotReplayable = errors.New("transport: the dead letter cannot be replayed")

	// ErrInvalidDeletion is returned when a DeadLetterDeletion selects
	// neither by IDs nor by Topic and OlderThan, or both ways.
	ErrInvalidDeletion = errors.New("transport: invalid dead letter deletion")

	// ErrConsumerGroupAlive is returned when a consumer group asked to be
	// dropped was shown alive by a router within
	// GroupDrop.UnlessSeenWithin; the error is a *ConsumerGroupAliveError.
	ErrConsumerGroupAlive = errors.New("transport: the consumer group runs")

	// ErrNoSuchConsumerGroup is returned when a consumer group asked to be
	// dropped is not recorded.
	ErrNoSuchConsumerGroup = errors.New("transport: no such consumer group")

	// ErrCloseTimeout is returned by Stop (saga.Client.Stop,
	// saga.Worker.Stop) when, after the drain, a consumer did not end its
	// batch in time: its connection hangs (a network partition, say). The
	// database rolls the batch back once it drops the session (within
	// Config.MaxTransactionDuration), and its messages are delivered again.
	ErrCloseTimeout = errors.New("transport: a consumer did not end its batch in time; the database rolls it back")
)
