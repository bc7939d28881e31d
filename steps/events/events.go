// Package events is pgsaga's versioned event store: streams of domain events
// in domain_events, appended with an expected version, loaded and folded
// into aggregates.
//
// It lives under steps because a step's events are part of its transaction
// (steps.Tx.Append), yet domains use it directly too (an order is placed
// outside any step). It knows nothing of sagas. A tx argument (delivery.DBTX)
// is pgsaga's one database interface, named delivery.DBTX for users: a
// *sql.Tx, *sql.Conn or *sql.DB, or a pgx.Tx wrapped by saga.PgxTx.
//
// Appends are optimistic: AppendTx writes versions expected+1… only if the
// stream is still at the expected version, in one statement. A racing writer
// makes it return ErrVersionConflict without aborting the transaction; the
// step runtime treats that as transient and retries the step on fresh state.
// A writer that decides on no state of the stream, its appends kept in turn
// by a lock of its own (the sample's ledger locks the account's row),
// appends at AnyVersion: after the stream's last event, found in the
// append's statement, with no read before it.
// (Under REPEATABLE READ a conflict with a write committed after the
// transaction's snapshot is a serialization failure instead, which pgsaga's
// transport answers by redelivering the batch in a new transaction.)
package events

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"reflect"
	"slices"
	"strconv"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"

	"github.com/pgsaga/pgsaga/internal/dbtx"
	"github.com/pgsaga/pgsaga/internal/metadata"
	"github.com/pgsaga/pgsaga/saga/delivery"
)

// Projection is a handler that keeps a read model (a view table) from the
// events of a topic, in a transaction it is handed (Handle's tx):
// asynchronous, in the transaction of each
// delivery of the event (the default), or inline, in the transaction that
// appends it. Register it with saga.Client.AddProjections.
type Projection struct {
	// Name names the handler and, asynchronous, its consumer group.
	Name string
	// Topic whose events it applies (saga.ClientConfig.EventsTopic).
	Topic string
	// Handle applies one event message in tx, the transaction of the append
	// (inline) or of the message's delivery (asynchronous): writes through
	// tx commit with it. Its delivery.DBTX is delivery.DBTX.
	Handle func(ctx context.Context, tx delivery.DBTX, msg *message.Message) error
	// Inline runs Handle in the appending transaction, in every process
	// that appends to the topic through the client's event store: the view
	// is current when the append commits, and costs no message, delivery
	// or worker. Handle's error fails the append (a step that appends is
	// retried, or dead-lettered for a permanent error), so an inline
	// projection must be as sure as the step itself. Events appended by
	// other processes that lack the projection are not projected.
	Inline bool
}

// Event is a domain event: a JSON-encodable value with a stable type name.
// EventType must be a constant of the type (value receiver): it is called on
// zero values.
type Event interface {
	EventType() string
}

// VersionConflictError says which stream conflicted (matches
// ErrVersionConflict).
type VersionConflictError struct {
	Stream   string
	Expected int
}

// Error implements error.
func (e *VersionConflictError) Error() string {
	return fmt.Sprintf("events: stream %s is no longer at version %d", e.Stream, e.Expected)
}

// Is makes VersionConflictError match ErrVersionConflict.
func (e *VersionConflictError) Is(target error) bool { return target == ErrVersionConflict }

// Registry maps event type names to Go types.
type Registry struct {
	mu    sync.RWMutex
	types map[string]reflect.Type
}

// NewRegistry returns an empty registry.
func NewRegistry() *Registry { return &Registry{types: map[string]reflect.Type{}} }

// Register adds event type E. E must be a non-pointer type; registering two
// Go types under one name is an error.
func Register[E Event](r *Registry) error {
	var zero E
	t := reflect.TypeOf(zero)
	if t == nil || t.Kind() == reflect.Pointer {
		return fmt.Errorf("events: register %T: use a non-pointer type", zero)
	}
	name := zero.EventType()
	if name == "" {
		return fmt.Errorf("events: register %v: empty type name", t)
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if prev, ok := r.types[name]; ok && prev != t {
		return fmt.Errorf("events: type name %q already registered for %v", name, prev)
	}
	r.types[name] = t
	return nil
}

// MustRegister is Register that panics, for package initialisation.
func MustRegister[E Event](r *Registry) {
	if err := Register[E](r); err != nil {
		panic(err)
	}
}

// Decode turns a stored payload back into its registered Go type.
func (r *Registry) Decode(typeName string, payload []byte) (Event, error) {
	r.mu.RLock()
	t, ok := r.types[typeName]
	r.mu.RUnlock()
	if !ok {
		return nil, fmt.Errorf("%w: %q (register it with events.Register)", ErrUnknownEventType, typeName)
	}
	v := reflect.New(t)
	if err := json.Unmarshal(payload, v.Interface()); err != nil {
		return nil, fmt.Errorf("events: decoding %s: %w", typeName, err)
	}
	return v.Elem().Interface().(Event), nil
}

// Metadata travels with each event.
type Metadata struct {
	CorrelationID  string `json:"correlation_id,omitempty"`
	CausationID    string `json:"causation_id,omitempty"`
	SagaID         string `json:"saga_id,omitempty"`
	IdempotencyKey string `json:"idempotency_key,omitempty"`
}

// Recorded is an event as stored.
type Recorded struct {
	Position   int64
	ID         uuid.UUID
	StreamID   string
	Version    int
	Type       string
	Data       Event
	Metadata   Metadata
	RecordedAt time.Time
}

// Aggregate is state folded from a stream's events.
type Aggregate interface {
	Apply(Recorded) error
}

// Metadata keys of a published event message, besides the envelope keys
// shared with steps (type, correlation_id, causation_id, saga_id,
// idempotency_key).
const (
	MetaStreamID = metadata.StreamID
	MetaVersion  = metadata.StreamVersion
	// MetaPartitionKey is the stream id again, under the name partitioned
	// brokers order by.
	MetaPartitionKey = metadata.PartitionKey
)

// Config configures a Store.
type Config struct {
	// Registry decodes stored events. Required.
	Registry *Registry
	// Topic names the topic of a stream's events: the topic they are
	// published to (with Publisher) and the one inline projections
	// (Project) are given; "" for none. Default: none.
	Topic func(streamID string) string
	// Publisher publishes a stream's events to its topic through the
	// appending transaction (the outbox), for asynchronous projections and
	// other consumers. Nil: events are not published.
	Publisher func(tx delivery.DBTX) message.Publisher
	// Project runs inline projections: it is given the event messages of
	// each append (as they would be published) in the appending
	// transaction, after the insert, so its statements see the new events
	// and commit or roll back with them. Its error fails the append (the
	// caller must roll back). Nil: none. Needs Topic.
	Project func(ctx context.Context, tx delivery.DBTX, topic string, msgs []*message.Message) error
}

// Store appends and loads events.
type Store struct {
	cfg Config
}

// NewStore validates cfg and returns a Store.
func NewStore(cfg Config) (*Store, error) {
	if cfg.Registry == nil {
		return nil, errors.New("events: Config.Registry is required")
	}
	if cfg.Topic == nil && (cfg.Publisher != nil || cfg.Project != nil) {
		return nil, errors.New("events: Config.Topic is required with Config.Publisher or Config.Project")
	}
	return &Store{cfg: cfg}, nil
}

// Registry returns the store's registry.
func (s *Store) Registry() *Registry { return s.cfg.Registry }

// AnyVersion, as AppendTx's expected version, appends after the stream's
// last event, whatever its version: the append reads the stream's version
// in its own statement (under READ COMMITTED, that statement's snapshot,
// taken after any lock the transaction waited for before it). It is for a
// writer that decides on nothing read from the stream and whose appends to
// it are serialized by a lock it holds; without such a lock, two writers
// that each read some other state and then append both succeed. A writer
// that appends to the stream after the statement's snapshot (committed while
// the append waited for it on the stream's version) still makes it append
// nothing and return a *VersionConflictError.
const AnyVersion = -1

// AppendTx appends evs to stream in tx, as versions expected+1…, provided the
// stream is at version expected (0: the stream must not exist; AnyVersion:
// after its last event). It returns the recorded events, or a
// *VersionConflictError and appends nothing.
func (s *Store) AppendTx(ctx context.Context, tx delivery.DBTX, stream string, expected int, md Metadata, evs ...Event) ([]Recorded, error) {
	ids, types, payloads, meta, err := encode(stream, expected, md, evs)
	if err != nil || len(evs) == 0 {
		return nil, err
	}
	query, args := appendSQL, []any{stream, expected, ids, types, payloads, meta}
	if expected == AnyVersion {
		query, args = appendAnySQL, []any{stream, ids, types, payloads, meta}
	}
	rows, err := tx.QueryContext(ctx, query, args...)
	if err != nil {
		return nil, fmt.Errorf("events: appending to %s: %w", stream, err)
	}
	recorded := make([]Recorded, 0, len(evs))
	for rows.Next() {
		var (
			r   Recorded
			ord int
		)
		if err := rows.Scan(&r.Position, &r.Version, &r.RecordedAt, &ord); err != nil {
			rows.Close()
			return nil, fmt.Errorf("events: appending to %s: %w", stream, err)
		}
		if ord < 1 || ord > len(evs) {
			rows.Close()
			return nil, fmt.Errorf("events: appending to %s: version %d came back as event %d of %d", stream, r.Version, ord, len(evs))
		}
		i := ord - 1
		r.ID, r.StreamID, r.Type, r.Data, r.Metadata = uuid.MustParse(ids[i]), stream, types[i], evs[i], md
		recorded = append(recorded, r)
	}
	if err := rows.Close(); err != nil {
		return nil, fmt.Errorf("events: appending to %s: %w", stream, err)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("events: appending to %s: %w", stream, err)
	}
	if len(recorded) != len(evs) {
		// Nothing or only part was written; the caller must roll back (a
		// partial append needs a writer that skipped the version check, or
		// one that appended at AnyVersion past this one's snapshot).
		return nil, &VersionConflictError{Stream: stream, Expected: expected}
	}
	// RETURNING gives no order: the events are put back in theirs.
	slices.SortFunc(recorded, func(a, b Recorded) int { return a.Version - b.Version })
	if err := s.project(ctx, tx, recorded, payloads); err != nil {
		return nil, err
	}
	return recorded, nil
}

// QueueAppendTx appends evs to stream after its last event, as AppendTx
// does at AnyVersion, and reads nothing back: in a transaction that
// queues writes (steps.Queue), the append is sent with the transaction's
// next statement or its commit, in the same round trip. It returns the
// events' ids. It is for a writer that needs nothing of the append but
// the ids (their versions and positions are the database's), and whose
// appends to stream are serialized by a lock it holds (see AnyVersion):
// a writer that appended to the stream past the statement's snapshot
// makes it fail, and fail tx, with a unique violation of the stream's
// versions instead of coming back short. A stream whose events are
// projected or published (Config.Topic names a topic for it) is appended
// with AppendTx, at once, for the projections' sake.
func (s *Store) QueueAppendTx(ctx context.Context, tx delivery.DBTX, stream string, md Metadata, evs ...Event) ([]uuid.UUID, error) {
	if s.cfg.Topic != nil && s.cfg.Topic(stream) != "" && (s.cfg.Publisher != nil || s.cfg.Project != nil) {
		recs, err := s.AppendTx(ctx, tx, stream, AnyVersion, md, evs...)
		if err != nil {
			return nil, err
		}
		out := make([]uuid.UUID, len(recs))
		for i, r := range recs {
			out[i] = r.ID
		}
		return out, nil
	}
	ids, types, payloads, meta, err := encode(stream, AnyVersion, md, evs)
	if err != nil || len(evs) == 0 {
		return nil, err
	}
	if err := dbtx.Queue(ctx, tx, "events: appending to "+stream, appendQueuedSQL, stream, ids, types, payloads, meta); err != nil {
		return nil, err
	}
	out := make([]uuid.UUID, len(ids))
	for i, id := range ids {
		out[i] = uuid.MustParse(id)
	}
	return out, nil
}

// encode checks an append and encodes its events and metadata, each
// event with a new id.
func encode(stream string, expected int, md Metadata, evs []Event) (ids, types, payloads []string, meta string, err error) {
	if stream == "" || len(stream) > 200 {
		return nil, nil, nil, "", fmt.Errorf("%w: stream id must be 1 to 200 bytes", ErrInvalidAppend)
	}
	if expected < 0 && expected != AnyVersion {
		return nil, nil, nil, "", fmt.Errorf("%w: expected version %d is negative (and not AnyVersion)", ErrInvalidAppend, expected)
	}
	ids, types, payloads = make([]string, len(evs)), make([]string, len(evs)), make([]string, len(evs))
	for i, ev := range evs {
		if ev == nil {
			return nil, nil, nil, "", fmt.Errorf("%w: nil event", ErrInvalidAppend)
		}
		b, err := json.Marshal(ev)
		if err != nil {
			return nil, nil, nil, "", fmt.Errorf("%w: encoding %s: %v", ErrInvalidAppend, ev.EventType(), err)
		}
		ids[i], types[i], payloads[i] = uuid.NewString(), ev.EventType(), string(b)
	}
	m, err := json.Marshal(md)
	if err != nil {
		return nil, nil, nil, "", fmt.Errorf("events: encoding metadata: %w", err)
	}
	return ids, types, payloads, string(m), nil
}

// project hands the appended events to the inline projections and the
// publisher, as messages of the stream's topic.
func (s *Store) project(ctx context.Context, tx delivery.DBTX, recorded []Recorded, payloads []string) error {
	if s.cfg.Topic == nil || (s.cfg.Publisher == nil && s.cfg.Project == nil) {
		return nil
	}
	topic := s.cfg.Topic(recorded[0].StreamID)
	if topic == "" {
		return nil
	}
	msgs := messages(recorded, payloads)
	for i, m := range msgs {
		m.SetContext(context.WithValue(ctx, recordedKey{}, recorded[i]))
	}
	if s.cfg.Project != nil {
		if err := s.cfg.Project(ctx, tx, topic, msgs); err != nil {
			return fmt.Errorf("events: projecting events of %s: %w", recorded[0].StreamID, err)
		}
	}
	if s.cfg.Publisher == nil {
		return nil
	}
	if err := s.cfg.Publisher(tx).Publish(topic, msgs...); err != nil {
		return fmt.Errorf("events: publishing events of %s: %w", recorded[0].StreamID, err)
	}
	return nil
}

type recordedKey struct{}

// RecordedFromContext returns the event an inline projection's message
// carries, as its append recorded it (Data the appender's own value), so
// that a projection that knows the stream's state before it can apply it
// without reading the stream (see Config.Project); false for a message
// delivered any other way.
func RecordedFromContext(ctx context.Context) (Recorded, bool) {
	r, ok := ctx.Value(recordedKey{}).(Recorded)
	return r, ok
}

// messages are the event messages of recorded, as they are published.
func messages(recorded []Recorded, payloads []string) []*message.Message {
	msgs := make([]*message.Message, len(recorded))
	for i, r := range recorded {
		m := message.NewMessage(r.ID.String(), []byte(payloads[i]))
		for k, v := range map[string]string{
			metadata.Type: r.Type, metadata.CorrelationID: r.Metadata.CorrelationID, metadata.CausationID: r.Metadata.CausationID,
			metadata.SagaID: r.Metadata.SagaID, metadata.Key: r.Metadata.IdempotencyKey,
			MetaStreamID: r.StreamID, MetaVersion: strconv.Itoa(r.Version),
			// Relays to brokers keep one stream's events in order by it.
			MetaPartitionKey: r.StreamID,
		} {
			if v != "" {
				m.Metadata.Set(k, v)
			}
		}
		msgs[i] = m
	}
	return msgs
}

// LoadTx reads stream's events in version order, up to version upTo (0: all).
func (s *Store) LoadTx(ctx context.Context, q delivery.DBTX, stream string, upTo int) ([]Recorded, error) {
	if upTo <= 0 {
		upTo = int(^uint32(0) >> 1)
	}
	rows, err := q.QueryContext(ctx, loadSQL, stream, upTo)
	if err != nil {
		return nil, fmt.Errorf("events: loading %s: %w", stream, err)
	}
	defer rows.Close()
	var out []Recorded
	for rows.Next() {
		var (
			r        Recorded
			payload  []byte
			metadata []byte
		)
		if err := rows.Scan(&r.Position, &r.ID, &r.Version, &r.Type, &payload, &metadata, &r.RecordedAt); err != nil {
			return nil, fmt.Errorf("events: loading %s: %w", stream, err)
		}
		r.StreamID = stream
		if r.Data, err = s.cfg.Registry.Decode(r.Type, payload); err != nil {
			return nil, fmt.Errorf("events: loading %s version %d: %w", stream, r.Version, err)
		}
		if err := json.Unmarshal(metadata, &r.Metadata); err != nil {
			return nil, fmt.Errorf("events: loading %s version %d metadata: %w", stream, r.Version, err)
		}
		out = append(out, r)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("events: loading %s: %w", stream, err)
	}
	return out, nil
}

// VersionTx returns the current version of stream (0 if it has no events).
func (s *Store) VersionTx(ctx context.Context, q delivery.DBTX, stream string) (int, error) {
	var v int
	if err := q.QueryRowContext(ctx, versionSQL, stream).Scan(&v); err != nil {
		return 0, fmt.Errorf("events: reading the version of %s: %w", stream, err)
	}
	return v, nil
}

// FoldTx applies stream's events (up to version upTo; 0: all) to agg in
// order and returns the version reached (0 for an empty stream).
func (s *Store) FoldTx(ctx context.Context, q delivery.DBTX, stream string, upTo int, agg Aggregate) (int, error) {
	recs, err := s.LoadTx(ctx, q, stream, upTo)
	if err != nil {
		return 0, err
	}
	version := 0
	for _, r := range recs {
		if r.Version != version+1 {
			return 0, fmt.Errorf("events: stream %s jumps from version %d to %d", stream, version, r.Version)
		}
		if err := agg.Apply(r); err != nil {
			return 0, fmt.Errorf("events: applying %s version %d (%s): %w", stream, r.Version, r.Type, err)
		}
		version = r.Version
	}
	return version, nil
}

const (
	// appendSQL inserts the events only if the stream is at the expected
	// version; a racer that got there first makes it insert nothing. Each
	// row comes back with its event's place in the append (version -
	// expected).
	appendSQL = `INSERT INTO domain_events (event_id, stream_id, version, event_type, payload, metadata)
SELECT e.event_id::uuid, $1, $2 + e.ord, e.event_type, e.payload::jsonb, $6::jsonb
FROM unnest($3::text[], $4::text[], $5::text[]) WITH ORDINALITY AS e(event_id, event_type, payload, ord)
WHERE (SELECT coalesce(max(version), 0) FROM domain_events WHERE stream_id = $1) = $2
ON CONFLICT (stream_id, version) DO NOTHING
RETURNING position, version, recorded_at, version - $2`

	// appendAnySQL inserts the events after the stream's last event as the
	// statement's snapshot sees it. A racer that appended after that
	// snapshot holds those versions: the insert waits for it and, once it
	// commits, skips them, so the append comes back short. Each row comes
	// back with its event's place in the append (its version - the head).
	appendAnySQL = `WITH head AS (SELECT coalesce(max(version), 0) AS v FROM domain_events WHERE stream_id = $1)
INSERT INTO domain_events (event_id, stream_id, version, event_type, payload, metadata)
SELECT e.event_id::uuid, $1, head.v + e.ord, e.event_type, e.payload::jsonb, $5::jsonb
FROM head, unnest($2::text[], $3::text[], $4::text[]) WITH ORDINALITY AS e(event_id, event_type, payload, ord)
ON CONFLICT (stream_id, version) DO NOTHING
RETURNING position, version, recorded_at, version - (SELECT v FROM head)`

	// appendQueuedSQL is appendAnySQL for an append nobody reads back: a
	// racer's versions past the snapshot make it fail (a unique
	// violation) rather than skip them.
	appendQueuedSQL = `WITH head AS (SELECT coalesce(max(version), 0) AS v FROM domain_events WHERE stream_id = $1)
INSERT INTO domain_events (event_id, stream_id, version, event_type, payload, metadata)
SELECT e.event_id::uuid, $1, head.v + e.ord, e.event_type, e.payload::jsonb, $5::jsonb
FROM head, unnest($2::text[], $3::text[], $4::text[]) WITH ORDINALITY AS e(event_id, event_type, payload, ord)`

	versionSQL = `SELECT coalesce(max(version), 0) FROM domain_events WHERE stream_id = $1`

	loadSQL = `SELECT position, event_id, version, event_type, payload, metadata, recorded_at
FROM domain_events WHERE stream_id = $1 AND version <= $2 ORDER BY version`
)
