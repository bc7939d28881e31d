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

	pub "github.com/pgsaga/pgsaga/saga/delivery"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/pgsaga/pgsaga/internal/metadata"
)

// What users read of dead letters (package delivery).
type (
	DeadLetter         = pub.DeadLetter
	DeadLetterFilter   = pub.DeadLetterFilter
	DeadLetterDeletion = pub.DeadLetterDeletion
)

// Bounds of what DeadLetters reads of each dead letter.
const (
	DeadLetterPreviewBytes = pub.DeadLetterPreviewBytes
	DeadLetterListText     = pub.DeadLetterListText
)

// Metadata a dead letter carries besides the message's own.
const (
	DeadLetterReason   = metadata.DeadLetterReason
	DeadLetterAttempts = metadata.DeadLetterAttempts
	DeadLetterTopic    = metadata.DeadLetterTopic
	DeadLetterHandler  = metadata.DeadLetterHandler
	DeadLetterGroup    = metadata.DeadLetterGroup
	DeadLetterAt       = metadata.DeadLetterAt
)

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
// ErrNoSuchDeadLetter if there is none.
func (t *Transport) DeadLetter(ctx context.Context, id int64) (DeadLetter, error) {
	d, err := scanDeadLetter(t.db.QueryRowContext(ctx, deadLetterByIDSQL, id), true)
	if errors.Is(err, sql.ErrNoRows) {
		return DeadLetter{}, fmt.Errorf("%w: %d", ErrNoSuchDeadLetter, id)
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

// ReplayDeadLetter sends dead letter id back to its topic, once: to the
// queue of the consumer group that gave up on it, or, for a message no
// group read when it was published, to every group that reads its topic
// now. The message keeps its id, payload and metadata as published (the
// dead letter's own entries dropped, ReplayedDeadLetter added); the dead
// letter stays, marked replayed. It returns how many queues it went to.
// Replaying again is ErrAlreadyReplayed; a group that no longer reads the
// topic (or none at all) is ErrTopicNotSubscribed; a message a broker bridge
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
		return 0, fmt.Errorf("%w: %d", ErrNoSuchDeadLetter, id)
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
		return 0, fmt.Errorf("%w: %s of topic %s (dead letter %d)", ErrTopicNotSubscribed, who, topic, id)
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

func validateDeletion(d DeadLetterDeletion) error {
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
	if err := validateDeletion(d); err != nil {
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
	if err := validateDeletion(d); err != nil {
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
