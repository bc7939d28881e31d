package steps

import "errors"

// The errors the package returns, for errors.Is.
var (
	// ErrNilReply is the reason a command is dead-lettered when its
	// handler returned a nil pointer as its reply (return nil for none, or
	// a value); nothing of its attempt is kept.
	ErrNilReply = errors.New("steps: the handler returned a nil pointer as its reply")
	// ErrBadNotAfter is the reason a command is dead-lettered, its handler
	// never run, when its not-after (MetaNotAfter) cannot be read.
	ErrBadNotAfter = errors.New("steps: the command's not-after cannot be read")
	// ErrNoEventStore is returned by Tx.Append and Tx.Fold when the
	// runtime has no event store.
	ErrNoEventStore = errors.New("steps: the runtime has no event store (Config.Events)")
)
