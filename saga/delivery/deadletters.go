package delivery

import (
	"encoding/json"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
)

// ReceiveHandler is the handler of a dead letter that a broker bridge
// received but could not queue: it is kept, and cannot be replayed.
const ReceiveHandler = "pgsaga.receive"

// DeadLetter is a message kept in pgsaga_dead_letters: one no consumer
// could handle, or that no consumer group subscribed to.
//
// saga.Client.DeadLetters lists them with a bounded part of each (PayloadPreview, a
// Reason cut at DeadLetterListText characters, Metadata only up to
// DeadLetterListText bytes); saga.Client.DeadLetter reads one whole.
type DeadLetter struct {
	ID            int64
	UUID          string
	Topic         string
	ConsumerGroup string // "" when no group subscribed to the topic
	Handler       string
	// Payload is the whole payload, read by saga.Client.DeadLetter only;
	// nil in a listing.
	Payload []byte
	// PayloadPreview is the payload's first DeadLetterPreviewBytes bytes
	// (the whole payload if it is shorter), and PayloadSize its size.
	PayloadPreview []byte
	PayloadSize    int
	// Metadata is the message's, with the DeadLetter* entries; nil if it was
	// not a JSON object of strings (the raw value is in RawMetadata), or,
	// in a listing, if its text is longer than DeadLetterListText bytes
	// (MetadataSize says how long it is).
	Metadata     message.Metadata
	RawMetadata  json.RawMessage
	MetadataSize int
	// Reason says why the message is here; in a listing, its first
	// DeadLetterListText characters (ReasonLength is its length in
	// characters).
	Reason       string
	ReasonLength int
	Attempts     int
	CreatedAt    time.Time // when the message was published
	DeadAt       time.Time
	// ReplayedAt is when it was sent back to its queue (saga.Client.ReplayDeadLetter);
	// nil if it was not.
	ReplayedAt *time.Time
	// ReadAt is the database's clock when d was read: the clock its times
	// were set by, so the one to tell their ages with.
	ReadAt time.Time
}

// Bounds of what DeadLetters reads of each dead letter.
const (
	// DeadLetterPreviewBytes bounds PayloadPreview.
	DeadLetterPreviewBytes = 256
	// DeadLetterListText bounds the reason (in characters) and the
	// metadata (in bytes of its JSON text) of a listed dead letter.
	DeadLetterListText = 4096
)

// PayloadComplete reports whether d holds its whole payload: read by
// saga.Client.DeadLetter, or listed with a preview that is all of it.
func (d DeadLetter) PayloadComplete() bool {
	return d.Payload != nil || len(d.PayloadPreview) == d.PayloadSize
}

// Replayable reports whether saga.Client.ReplayDeadLetter can send d back: not a
// message a broker bridge received but could not queue (ReceiveHandler).
func (d DeadLetter) Replayable() bool { return d.Handler != ReceiveHandler }

// DeadLetterFilter selects dead letters.
type DeadLetterFilter struct {
	// Topic of the messages; "" for every topic.
	Topic string
	// AfterID lists those with a greater ID (paging).
	AfterID int64
	// Limit bounds the list. Default: 100.
	Limit int
}

// DeadLetterDeletion selects the dead letters saga.Client.DeleteDeadLetters deletes:
// those IDs, or those of Topic dead-lettered longer than OlderThan ago (by
// the database's clock), one way or the other: never all of them.
type DeadLetterDeletion struct {
	IDs       []int64
	Topic     string
	OlderThan time.Duration
}
