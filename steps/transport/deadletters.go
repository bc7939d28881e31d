package transport

import (
	"context"
	"encoding/json"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/pgsaga/pgsaga/steps/metadata"
)

// DeadLetter is a message kept in pgsaga_dead_letters: one no consumer
// could handle, or that no consumer group subscribed to.
type DeadLetter struct {
	ID            int64
	UUID          string
	Topic         string
	ConsumerGroup string // "" when no group subscribed to the topic
	Handler       string
	Payload       []byte
	// Metadata is the message's, with the DeadLetter* entries; nil if it was
	// not a JSON object of strings (the raw value is in RawMetadata).
	Metadata    message.Metadata
	RawMetadata json.RawMessage
	Reason      string
	Attempts    int
	CreatedAt   time.Time // when the message was published
	DeadAt      time.Time
}

// Metadata a dead letter carries besides the message's own.
const (
	DeadLetterReason   = metadata.DeadLetterReason
	DeadLetterAttempts = metadata.DeadLetterAttempts
	DeadLetterTopic    = metadata.DeadLetterTopic
	DeadLetterHandler  = metadata.DeadLetterHandler
	DeadLetterGroup    = metadata.DeadLetterGroup
	DeadLetterAt       = metadata.DeadLetterAt
)

// DeadLetterFilter selects dead letters.
type DeadLetterFilter struct {
	// Topic of the messages; "" for every topic.
	Topic string
	// AfterID lists those with a greater ID (paging).
	AfterID int64
	// Limit bounds the list. Default: 100.
	Limit int
}

// DeadLetters lists dead letters, oldest first.
func (t *Transport) DeadLetters(ctx context.Context, f DeadLetterFilter) ([]DeadLetter, error) {
	if f.Limit <= 0 {
		f.Limit = 100
	}
	rows, err := t.db.QueryContext(ctx, deadLettersSQL, f.Topic, f.AfterID, f.Limit)
	if err != nil {
		return nil, fmt.Errorf("transport: listing dead letters: %w", migrationHint(err))
	}
	defer rows.Close()
	var out []DeadLetter
	for rows.Next() {
		var d DeadLetter
		var md []byte
		if err := rows.Scan(&d.ID, &d.UUID, &d.Topic, &d.ConsumerGroup, &d.Handler, &d.Payload, &md, &d.Reason, &d.Attempts, &d.CreatedAt, &d.DeadAt); err != nil {
			return nil, fmt.Errorf("transport: listing dead letters: %w", err)
		}
		d.RawMetadata = md
		var m message.Metadata
		if json.Unmarshal(md, &m) == nil {
			d.Metadata = m
		}
		out = append(out, d)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("transport: listing dead letters: %w", err)
	}
	return out, nil
}
