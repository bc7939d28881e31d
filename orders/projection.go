package orders

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"reflect"
	"strconv"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"

	"github.com/pgsaga/pgsaga/saga/delivery"
	"github.com/pgsaga/pgsaga/steps"
	"github.com/pgsaga/pgsaga/steps/events"
)

// ProjectionName names the projection's handler and consumer group.
const ProjectionName = "orders.projection"

// View is a row of order_views.
type View struct {
	OrderID      uuid.UUID
	CustomerID   string
	AmountCents  int64
	Status       Status
	Version      int
	PlacedAt     time.Time
	ConfirmedAt  *time.Time
	CancelledAt  *time.Time
	CancelledBy  *string
	CancelReason *string
	UpdatedAt    time.Time
}

// Projection is the order_views projection of EventsTopic, for a
// saga.Client (AddProjections).
//
// Events may arrive twice, late or out of order. For each one the projection
// folds the order's stream up to that event's version, in the delivery's
// transaction, and writes the state only if it is newer than the row (a
// guarded upsert). A late event therefore never moves a row back, and a
// reordered one brings the state of its version, not a partial delta.
// Inline, in the transaction of an append whose appender read the order
// (Place, the confirm and cancel steps, CancelByCustomer), it applies the
// event to that state instead of reading the stream again.
func (s *Service) Projection() events.Projection {
	return events.Projection{Name: ProjectionName, Topic: EventsTopic, Handle: s.Project}
}

// Project applies one event message to order_views; Projection runs it for
// every event of EventsTopic.
func (s *Service) Project(ctx context.Context, tx delivery.DBTX, msg *message.Message) error {
	stream := msg.Metadata.Get(events.MetaStreamID)
	version, err := strconv.Atoi(msg.Metadata.Get(events.MetaVersion))
	id, idErr := uuid.Parse(strings.TrimPrefix(stream, "order-"))
	if idErr != nil || stream != Stream(id) || err != nil || version < 1 {
		return steps.Permanent(fmt.Errorf("orders: projection: message %s is not an order event (stream %q, version %q)",
			msg.UUID, stream, msg.Metadata.Get(events.MetaVersion)))
	}
	if o, ok := knownAfter(ctx, stream, version, msg.Payload); ok {
		// Projected inline by the append that knew the order before it:
		// no need to read the stream back.
		return upsertView(ctx, tx, o)
	}
	var o Order
	v, err := s.cfg.Events.FoldTx(ctx, tx, stream, version, &o)
	if err != nil {
		return err
	}
	if v < version {
		// An event message is delivered only once the transaction that
		// appended the event has committed: this one names an event that
		// does not exist.
		return steps.Permanent(fmt.Errorf("orders: projection: message %s names %s version %d, which does not exist", msg.UUID, stream, version))
	}
	return upsertView(ctx, tx, o)
}

// known is an order's state as its appender read it, carried in the
// append's context to its inline projection (see withKnown).
type known struct {
	stream string
	order  Order
}

type knownKey struct{}

// withKnown returns ctx carrying o, the state of stream before the append
// made under it: the inline projection of that append applies the event
// to it instead of folding the stream again.
func withKnown(ctx context.Context, stream string, o Order) context.Context {
	return context.WithValue(ctx, knownKey{}, known{stream: stream, order: o})
}

// knownAfter returns the order of stream at version, if ctx carries its
// state just before (withKnown) and the event at version as its append
// recorded it (events.RecordedFromContext). The event's data is decoded
// from payload, the stored JSON, as a fold decodes it (text that is not
// UTF-8, say, is stored and folded with U+FFFD in its place).
func knownAfter(ctx context.Context, stream string, version int, payload []byte) (Order, bool) {
	k, ok := ctx.Value(knownKey{}).(known)
	if !ok || k.stream != stream || k.order.Version != version-1 {
		return Order{}, false
	}
	r, ok := events.RecordedFromContext(ctx)
	if !ok || r.StreamID != stream || r.Version != version || r.Data == nil {
		return Order{}, false
	}
	data := reflect.New(reflect.TypeOf(r.Data))
	if err := json.Unmarshal(payload, data.Interface()); err != nil {
		return Order{}, false
	}
	ev, ok := data.Elem().Interface().(events.Event)
	if !ok {
		return Order{}, false
	}
	r.Data = ev
	o := k.order
	if err := o.Apply(r); err != nil {
		return Order{}, false // the fold says what is wrong
	}
	return o, true
}

// upsertView writes o's row; nothing reads it back in the transaction, so
// it is queued where tx can (steps.Queue).
func upsertView(ctx context.Context, tx delivery.DBTX, o Order) error {
	return steps.Queue(ctx, tx, "orders: projecting "+o.ID.String(), upsertViewSQL, o.ID, o.CustomerID, o.AmountCents, string(o.Status), o.Version,
		o.PlacedAt, nullTime(o.ConfirmedAt), nullTime(o.CancelledAt), nullString(o.CancelledBy), nullString(o.CancelReason), o.UpdatedAt)
}

// RebuildViews recomputes order_views from the event store, from scratch, in
// one transaction, and returns how many orders it wrote. The result equals
// what the projection converges to. It locks order_views for its duration:
// with the projection inline (the sample's default), every order write
// (Place, a customer's cancellation, the confirm and cancel steps) waits
// for it, and a step that waits longer than the transport's LockTimeout is
// retried; run it when orders are quiet.
func (s *Service) RebuildViews(ctx context.Context) (int, error) {
	tx, err := s.cfg.DB.BeginTx(ctx, &sql.TxOptions{Isolation: sql.LevelRepeatableRead})
	if err != nil {
		return 0, fmt.Errorf("orders: rebuilding views: %w", err)
	}
	defer tx.Rollback() //nolint:errcheck // no-op after Commit
	// Keep the projection out (its consumer, or the order writers when it
	// runs inline) while the table is rebuilt.
	if _, err := tx.ExecContext(ctx, lockViewsSQL); err != nil {
		return 0, fmt.Errorf("orders: rebuilding views: %w", err)
	}
	if _, err := tx.ExecContext(ctx, clearViewsSQL); err != nil {
		return 0, fmt.Errorf("orders: rebuilding views: %w", err)
	}
	rows, err := tx.QueryContext(ctx, orderStreamsSQL)
	if err != nil {
		return 0, fmt.Errorf("orders: rebuilding views: %w", err)
	}
	var streams []string
	for rows.Next() {
		var st string
		if err := rows.Scan(&st); err != nil {
			rows.Close()
			return 0, fmt.Errorf("orders: rebuilding views: %w", err)
		}
		streams = append(streams, st)
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return 0, fmt.Errorf("orders: rebuilding views: %w", err)
	}
	for _, st := range streams {
		var o Order
		if _, err := s.cfg.Events.FoldTx(ctx, tx, st, 0, &o); err != nil {
			return 0, err
		}
		if err := upsertView(ctx, tx, o); err != nil {
			return 0, err
		}
	}
	if err := tx.Commit(); err != nil {
		return 0, fmt.Errorf("orders: rebuilding views: %w", err)
	}
	return len(streams), nil
}

// View returns an order's row of order_views.
func (s *Service) View(ctx context.Context, id uuid.UUID) (View, error) {
	var (
		v      View
		status string
	)
	err := s.cfg.DB.QueryRowContext(ctx, getViewSQL, id).Scan(&v.OrderID, &v.CustomerID, &v.AmountCents, &status, &v.Version,
		&v.PlacedAt, &v.ConfirmedAt, &v.CancelledAt, &v.CancelledBy, &v.CancelReason, &v.UpdatedAt)
	if errors.Is(err, sql.ErrNoRows) {
		return View{}, fmt.Errorf("%w: %s has no view (yet)", ErrOrderNotFound, id)
	}
	if err != nil {
		return View{}, fmt.Errorf("orders: reading view of %s: %w", id, err)
	}
	v.Status = Status(status)
	return v, nil
}

func nullTime(t time.Time) *time.Time {
	if t.IsZero() {
		return nil
	}
	return &t
}

func nullString(s string) *string {
	if s == "" {
		return nil
	}
	return &s
}

const (
	// upsertViewSQL writes an order's state unless the row already holds a
	// newer version.
	upsertViewSQL = `INSERT INTO order_views AS v (order_id, customer_id, amount_cents, status, version,
    placed_at, confirmed_at, cancelled_at, cancelled_by, cancel_reason, updated_at)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11)
ON CONFLICT (order_id) DO UPDATE SET
    customer_id = excluded.customer_id, amount_cents = excluded.amount_cents, status = excluded.status,
    version = excluded.version, placed_at = excluded.placed_at, confirmed_at = excluded.confirmed_at,
    cancelled_at = excluded.cancelled_at, cancelled_by = excluded.cancelled_by,
    cancel_reason = excluded.cancel_reason, updated_at = excluded.updated_at
WHERE v.version < excluded.version`

	lockViewsSQL    = `LOCK TABLE order_views IN EXCLUSIVE MODE`
	clearViewsSQL   = `DELETE FROM order_views`
	orderStreamsSQL = `SELECT DISTINCT stream_id FROM domain_events WHERE stream_id LIKE 'order-%' ORDER BY stream_id`
	getViewSQL      = `SELECT order_id, customer_id, amount_cents, status, version, placed_at, confirmed_at,
    cancelled_at, cancelled_by, cancel_reason, updated_at FROM order_views WHERE order_id = $1`
)
