package events

import "errors"

// The errors the package returns, for errors.Is.
var (
	// ErrVersionConflict is returned by an append when the stream is not
	// at the expected version (another append came first): read it again
	// and decide anew.
	ErrVersionConflict = errors.New("events: version conflict")
	// ErrUnknownEventType is returned when a stored event's type name has
	// no registered Go type to decode it into.
	ErrUnknownEventType = errors.New("events: unknown event type")
	// ErrInvalidAppend is returned by an append given a bad stream id,
	// expected version or event.
	ErrInvalidAppend = errors.New("events: invalid append")
)
