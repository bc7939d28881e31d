package transport

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/pgsaga/pgsaga/internal/metadata"
)

// DeadLetter is a message kept in pgsaga_dead_letters: one no consumer
// could handle, or that no consumer group subscribed to.
//
// DeadLetters lists them with a bounded part of each (PayloadPreview, a
// Reason cut at DeadLetterListText characters, Metadata only up to
// DeadLetterListText bytes); Transport.DeadLetter reads one whole.
type DeadLetter struct {
	ID            int64
	UUID          string
	Topic         string
	ConsumerGroup string // "" when no group subscribed to the topic
	Handler       string
	// Payload is the whole payload, read by Transport.DeadLetter only;
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
	// ReplayedAt is when it was sent back to its queue (ReplayDeadLetter);
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
// Transport.DeadLetter, or listed with a preview that is all of it.
func (d DeadLetter) PayloadComplete() bool {
	return d.Payload != nil || len(d.PayloadPreview) == d.PayloadSize
}

// Replayable reports whether ReplayDeadLetter can send d back: not a
// message a broker bridge received but could not queue (ReceiveHandler).
func (d DeadLetter) Replayable() bool { return d.Handler != ReceiveHandler }

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

// DeadLetters lists dead letters, oldest first, each with a bounded part
// of its payload, reason and metadata (see DeadLetter): a page of them
// takes memory in proportion to its Limit, however large the messages.
// DeadLetter reads one whole.
func (t *Transport) DeadLetters(ctx context.Context, f DeadLetterFilter) ([]DeadLetter, error) {
	if f.Limit <= 0 {
		f.Limit = 100
	}
	rows, err := t.db.QueryContext(ctx, deadLettersSQL, f.Topic, f.AfterID, f.Limit, DeadLetterPreviewBytes, DeadLetterListText)
	if err != nil {
		return nil, fmt.Errorf("transport: listing dead letters: %w", migrationHint(err))
	}
	defer rows.Close()
	var out []DeadLetter
	for rows.Next() {
		d, err := scanDeadLetter(rows, false)
		if err != nil {
			return nil, fmt.Errorf("transport: listing dead letters: %w", err)
		}
		out = append(out, d)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("transport: listing dead letters: %w", err)
	}
	return out, nil
}

// DeadLetter reads dead letter id whole, its payload included;
// ErrDeadLetterNotFound if there is none.
func (t *Transport) DeadLetter(ctx context.Context, id int64) (DeadLetter, error) {
	d, err := scanDeadLetter(t.db.QueryRowContext(ctx, deadLetterByIDSQL, id), true)
	if errors.Is(err, sql.ErrNoRows) {
		return DeadLetter{}, fmt.Errorf("%w: %d", ErrDeadLetterNotFound, id)
	}
	if err != nil {
		return DeadLetter{}, fmt.Errorf("transport: reading dead letter %d: %w", id, migrationHint(err))
	}
	return d, nil
}

// scanDeadLetter scans a row of deadLettersSQL (whole: deadLetterSQL).
func scanDeadLetter(row interface{ Scan(...any) error }, whole bool) (DeadLetter, error) {
	var (
		d       DeadLetter
		payload []byte
		md      []byte
	)
	if err := row.Scan(&d.ID, &d.UUID, &d.Topic, &d.ConsumerGroup, &d.Handler, &payload, &d.PayloadSize, &md, &d.MetadataSize,
		&d.Reason, &d.ReasonLength, &d.Attempts, &d.CreatedAt, &d.DeadAt, &d.ReplayedAt, &d.ReadAt); err != nil {
		return DeadLetter{}, err
	}
	if payload == nil {
		payload = []byte{}
	}
	d.PayloadPreview = payload[:min(len(payload), DeadLetterPreviewBytes)]
	if whole {
		d.Payload = payload
	}
	if md != nil { // nil: left out of a listing for its size
		d.RawMetadata = md
		var m message.Metadata
		if json.Unmarshal(md, &m) == nil {
			d.Metadata = m
		}
	}
	return d, nil
}

// DeadLettersWaiting counts the dead letters not replayed, by topic.
func (t *Transport) DeadLettersWaiting(ctx context.Context) (map[string]int, error) {
	rows, err := t.db.QueryContext(ctx, deadLettersWaitingSQL)
	if err != nil {
		return nil, fmt.Errorf("transport: counting dead letters: %w", migrationHint(err))
	}
	defer rows.Close()
	out := map[string]int{}
	for rows.Next() {
		var (
			topic string
			n     int
		)
		if err := rows.Scan(&topic, &n); err != nil {
			return nil, fmt.Errorf("transport: counting dead letters: %w", err)
		}
		out[topic] = n
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("transport: counting dead letters: %w", err)
	}
	return out, nil
}

// ReplayedDeadLetter is the metadata entry of a replayed message: the id of
// the dead letter it came from.
const ReplayedDeadLetter = "replayed_dead_letter"

// Errors of ReplayDeadLetter.
var (
	ErrDeadLetterNotFound = errors.New("transport: no such dead letter")
	ErrAlreadyReplayed    = errors.New("transport: the dead letter was replayed already")
	ErrNoConsumerGroup    = errors.New("transport: no consumer group reads the dead letter's topic")
	ErrNotReplayable      = errors.New("transport: the dead letter cannot be replayed")
)

// ReplayDeadLetter sends dead letter id back to its topic, once: to the
// queue of the consumer group that gave up on it, or, for a message no
// group read when it was published, to every group that reads its topic
// now. The message keeps its id, payload and metadata as published (the
// dead letter's own entries dropped, ReplayedDeadLetter added); the dead
// letter stays, marked replayed. It returns how many queues it went to.
// Replaying again is ErrAlreadyReplayed; a group that no longer reads the
// topic (or none at all) is ErrNoConsumerGroup; a message a broker bridge
// received but could not queue (ReceiveHandler) is ErrNotReplayable; in
// each case nothing changes.
func (t *Transport) ReplayDeadLetter(ctx context.Context, id int64) (int, error) {
	tx, err := t.db.BeginTx(ctx, &sql.TxOptions{Isolation: sql.LevelReadCommitted})
	if err != nil {
		return 0, fmt.Errorf("transport: replaying dead letter %d: %w", id, err)
	}
	defer tx.Rollback() //nolint:errcheck // a no-op after Commit
	var (
		topic, group, handler string
		replayed              *time.Time
	)
	err = tx.QueryRowContext(ctx, lockDeadLetterSQL, id).Scan(&topic, &group, &handler, &replayed)
	switch {
	case errors.Is(err, sql.ErrNoRows):
		return 0, fmt.Errorf("%w: %d", ErrDeadLetterNotFound, id)
	case err != nil:
		return 0, fmt.Errorf("transport: replaying dead letter %d: %w", id, migrationHint(err))
	case replayed != nil:
		return 0, fmt.Errorf("%w: %d at %s", ErrAlreadyReplayed, id, replayed.Format(time.RFC3339))
	case !(DeadLetter{Handler: handler}).Replayable():
		return 0, fmt.Errorf("%w: dead letter %d arrived from a message broker and was never queued here (what arrived cannot be queued as it is); it must be sent again", ErrNotReplayable, id)
	}
	var n int
	if err := tx.QueryRowContext(ctx, replayDeadLetterSQL, id, t.schema.notifyChannel).Scan(&n); err != nil {
		return 0, fmt.Errorf("transport: replaying dead letter %d: %w", id, err)
	}
	if n == 0 {
		who := "its group " + group
		if group == "" {
			who = "any group"
		}
		return 0, fmt.Errorf("%w: %s of topic %s (dead letter %d)", ErrNoConsumerGroup, who, topic, id)
	}
	if err := tx.Commit(); err != nil {
		return 0, fmt.Errorf("transport: replaying dead letter %d: %w", id, err)
	}
	return n, nil
}

// StoreDeadLetter keeps msg, a message of topic that never reached a queue
// of this database (one taken in from a message broker that the queue
// cannot store, say), as a dead letter of group and handler, with reason
// and one attempt. Whatever msg holds is stored: text PostgreSQL cannot
// keep (NUL, bytes that are not UTF-8) in its UUID, metadata and reason is
// replaced with U+FFFD (the reason says what was wrong), and its payload is
// kept byte for byte.
func (t *Transport) StoreDeadLetter(ctx context.Context, topic, group, handler string, msg *message.Message, reason string) error {
	md := make(map[string]string, len(msg.Metadata))
	for k, v := range msg.Metadata {
		md[Storable(k)] = Storable(v)
	}
	b, err := json.Marshal(md)
	if err != nil {
		return fmt.Errorf("transport: dead-lettering %s: %w", msg.UUID, err)
	}
	if _, err := t.db.ExecContext(ctx, deadLetterMessageSQL, Storable(msg.UUID), Storable(topic), Storable(group), Storable(handler),
		[]byte(msg.Payload), string(b), Storable(reason), 1); err != nil {
		return fmt.Errorf("transport: dead-lettering %s: %w", Storable(msg.UUID), migrationHint(err))
	}
	t.metrics.DeadLettered(topic, handler)
	return nil
}

// Storable is s as PostgreSQL text can keep it: NUL and bytes that are
// not UTF-8 become U+FFFD.
func Storable(s string) string {
	if utf8.ValidString(s) && !strings.ContainsRune(s, 0) {
		return s
	}
	return strings.ReplaceAll(strings.ToValidUTF8(s, "\uFFFD"), "\x00", "\uFFFD")
}

// Unstorable says why PostgreSQL cannot keep s as text ("" if it can): a
// NUL, or bytes that are not UTF-8.
func Unstorable(s string) string {
	switch {
	case !utf8.ValidString(s):
		return "bytes that are not UTF-8"
	case strings.ContainsRune(s, 0):
		return "a NUL character"
	}
	return ""
}

// DeadLetterDeletion selects the dead letters DeleteDeadLetters deletes:
// those IDs, or those of Topic dead-lettered longer than OlderThan ago (by
// the database's clock), one way or the other: never all of them.
type DeadLetterDeletion struct {
	IDs       []int64
	Topic     string
	OlderThan time.Duration
}

// ErrInvalidDeletion: a DeadLetterDeletion that selects neither by IDs nor
// by Topic and OlderThan, or both ways.
var ErrInvalidDeletion = errors.New("transport: invalid dead letter deletion")

func (d DeadLetterDeletion) validate() error {
	byAge := d.Topic != "" || d.OlderThan != 0
	switch {
	case len(d.IDs) > 0 && byAge:
		return fmt.Errorf("%w: IDs, or Topic and OlderThan, not both", ErrInvalidDeletion)
	case len(d.IDs) > 0:
		return nil
	case d.Topic == "" || d.OlderThan <= 0:
		return fmt.Errorf("%w: IDs, or Topic and a positive OlderThan (got %q, %s)", ErrInvalidDeletion, d.Topic, d.OlderThan)
	}
	return nil
}

// CountDeadLetters counts the dead letters DeleteDeadLetters would delete
// now.
func (t *Transport) CountDeadLetters(ctx context.Context, d DeadLetterDeletion) (int64, error) {
	if err := d.validate(); err != nil {
		return 0, err
	}
	var n int64
	if err := t.db.QueryRowContext(ctx, countDeadLettersSQL, d.IDs, d.Topic, d.OlderThan.Seconds()).Scan(&n); err != nil {
		return 0, fmt.Errorf("transport: counting dead letters: %w", migrationHint(err))
	}
	return n, nil
}

// DeleteDeadLetters deletes the dead letters d selects, replayed or not,
// and returns how many it deleted (an ID with no dead letter is not
// counted).
func (t *Transport) DeleteDeadLetters(ctx context.Context, d DeadLetterDeletion) (int64, error) {
	if err := d.validate(); err != nil {
		return 0, err
	}
	res, err := t.db.ExecContext(ctx, deleteDeadLettersSQL, d.IDs, d.Topic, d.OlderThan.Seconds())
	if err != nil {
		return 0, fmt.Errorf("transport: deleting dead letters: %w", migrationHint(err))
	}
	n, _ := res.RowsAffected()
	return n, nil
}

// selectDeadLettersSQL selects dead letters by id ($1, if any), else by
// topic ($2) and age ($3 seconds since they were dead-lettered).
const (
	selectDeadLettersSQL = `FROM pgsaga_dead_letters
WHERE CASE WHEN cardinality($1::bigint[]) > 0 THEN id = ANY ($1::bigint[])
    ELSE topic = $2 AND dead_at < clock_timestamp() - make_interval(secs => $3) END`
	countDeadLettersSQL  = `SELECT count(*) ` + selectDeadLettersSQL
	deleteDeadLettersSQL = `DELETE ` + selectDeadLettersSQL
)
