package broker

import "errors"

// The errors the package returns, for errors.Is.
var (
	// ErrInvalidConfig is returned by saga.NewClient (and the bridge it builds), wrapping what is wrong with a
	// Config.
	ErrInvalidConfig = errors.New("broker: invalid config")
	// ErrRelayCrashed is the reason logged for a relay batch abandoned by
	// Faults.CrashAfterPublish.
	ErrRelayCrashed = errors.New("broker: the relay crashed after a publish (fault injected)")
	// ErrStarted is returned when a start is asked of a bridge that was started.
	ErrStarted = errors.New("broker: the bridge was started already")
	// ErrNoLocalGroup is returned when starting a bridge that would receive
	// a topic no consumer group of its database reads: what it took from
	// the broker would be a dead letter here. Start the workers (or
	// Subscribe the groups) first.
	ErrNoLocalGroup = errors.New("broker: no consumer group of this database reads a received topic")
)
