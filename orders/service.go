package orders

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"regexp"
	"strconv"
	"strings"
	"unicode"
	"unicode/utf8"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"

	"github.com/pgsaga/pgsaga/idempotency"
	"github.com/pgsaga/pgsaga/internal/pgerr"
	"github.com/pgsaga/pgsaga/saga/delivery"
	"github.com/pgsaga/pgsaga/steps"
	"github.com/pgsaga/pgsaga/steps/events"
)

// Limits of a PlaceRequest.
const (
	MaxAmountCents = 1_000_000_000 // ten million in the currency's major unit
	MaxNoteBytes   = 500
	MaxRequestSize = 4 << 10 // of a JSON PlaceRequest
)

var customerIDPattern = regexp.MustCompile(`^[A-Za-z0-9_.-]{1,64}$`)

// PlaceRequest is a client's order.
type PlaceRequest struct {
	// Key is the client's idempotency key: the same key returns the same
	// order. Required, at most 255 bytes.
	Key string `json:"key"`
	// CustomerID of a known customer: [A-Za-z0-9_.-]{1,64}.
	CustomerID string `json:"customer_id"`
	// AmountCents to charge: 1 to MaxAmountCents.
	AmountCents int64 `json:"amount_cents"`
	// Note is free text, at most MaxNoteBytes of printable UTF-8.
	Note string `json:"note,omitempty"`
}

// Validate checks the request without touching the database.
func (r PlaceRequest) Validate() error {
	switch {
	case r.Key == "":
		return ErrMissingKey
	case len(r.Key) > idempotency.MaxKeyLen:
		return fmt.Errorf("%w (%d bytes)", ErrKeyTooLong, len(r.Key))
	case !customerIDPattern.MatchString(r.CustomerID):
		return fmt.Errorf("%w: %q (1 to 64 characters from [A-Za-z0-9_.-])", ErrInvalidCustomerID, truncate(r.CustomerID, 80))
	case r.AmountCents <= 0:
		return fmt.Errorf("%w, got %d cents", ErrInvalidAmount, r.AmountCents)
	case r.AmountCents > MaxAmountCents:
		return fmt.Errorf("%w: %d cents, at most %d", ErrAmountTooLarge, r.AmountCents, MaxAmountCents)
	case len(r.Note) > MaxNoteBytes:
		return fmt.Errorf("%w: %d bytes, at most %d", ErrNoteTooLong, len(r.Note), MaxNoteBytes)
	case !printable(r.Key) || !printable(r.Note):
		return fmt.Errorf("%w: key and note must be printable UTF-8", ErrMalformedRequest)
	}
	return nil
}

func printable(s string) bool {
	if !utf8.ValidString(s) {
		return false
	}
	for _, r := range s {
		if !unicode.IsPrint(r) && r != ' ' {
			return false
		}
	}
	return true
}

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "…"
}

// DecodePlaceRequest reads a JSON PlaceRequest of at most MaxRequestSize
// bytes, refusing unknown fields.
func DecodePlaceRequest(r io.Reader) (PlaceRequest, error) {
	body, err := io.ReadAll(io.LimitReader(r, MaxRequestSize+1))
	if err != nil {
		return PlaceRequest{}, fmt.Errorf("%w: %v", ErrMalformedRequest, err)
	}
	if len(body) > MaxRequestSize {
		return PlaceRequest{}, fmt.Errorf("%w: more than %d bytes", ErrRequestTooLarge, MaxRequestSize)
	}
	dec := json.NewDecoder(strings.NewReader(string(body)))
	dec.DisallowUnknownFields()
	var req PlaceRequest
	if err := dec.Decode(&req); err != nil {
		return PlaceRequest{}, fmt.Errorf("%w: %v", ErrMalformedRequest, err)
	}
	if dec.More() {
		return PlaceRequest{}, fmt.Errorf("%w: trailing data after the JSON object", ErrMalformedRequest)
	}
	return req, nil
}

// Config configures a Service.
type Config struct {
	// DB is required.
	DB *sql.DB
	// Publish publishes OrderCreated through Place's transaction when
	// Trigger is nil: saga.Client.PublishTx, typically.
	Publish func(ctx context.Context, tx delivery.DBTX, topic string, msgs ...*message.Message) error
	// Idempotency makes Place idempotent by the client's key. Required.
	Idempotency *idempotency.Store
	// Events is the event store; its registry must hold the order events
	// (RegisterEvents). Required.
	Events *events.Store
	// Trigger sends OrderCreated, the saga's trigger, in Place's
	// transaction. Default: publish it to CreatedTopic with Publish.
	// The sample sets it to its saga client's StartTx, which can start the
	// saga in that transaction (saga.ClientConfig.InProcessEngine).
	Trigger func(ctx context.Context, tx delivery.DBTX, created OrderCreated) error
	// Logger. Default: slog.Default().
	Logger *slog.Logger
}

// Service is the orders domain.
type Service struct {
	cfg Config
}

// New validates cfg and returns a Service.
func New(cfg Config) (*Service, error) {
	if cfg.DB == nil || cfg.Idempotency == nil || cfg.Events == nil {
		return nil, errors.New("orders: Config.DB, Idempotency and Events are required")
	}
	if cfg.Trigger == nil && cfg.Publish == nil {
		return nil, errors.New("orders: Config.Trigger or Publish is required")
	}
	if _, err := cfg.Events.Registry().Decode(Confirmed{}.EventType(), []byte(`{}`)); err != nil {
		return nil, fmt.Errorf("orders: the event store's registry lacks the order events (orders.RegisterEvents): %w", err)
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	return &Service{cfg: cfg}, nil
}

// AddCustomer registers a customer who may place orders; adding one twice is
// a no-op, so a connection lost under it is retried (see Place).
func (s *Service) AddCustomer(ctx context.Context, id, name string) error {
	if !customerIDPattern.MatchString(id) {
		return fmt.Errorf("%w: %q", ErrInvalidCustomerID, truncate(id, 80))
	}
	err := pgerr.RetryLost(ctx, func(ctx context.Context) error {
		_, err := s.cfg.DB.ExecContext(ctx, addCustomerSQL, id, name)
		return err
	})
	if err != nil {
		return fmt.Errorf("orders: adding customer %s: %w", id, err)
	}
	return nil
}

// PlaceResult says which order a Place call stands for.
type PlaceResult struct {
	OrderID uuid.UUID
	// Replayed is true when the key had already placed this order.
	Replayed bool
}

// Place places an order, at most once per (customer, key): in one
// transaction it claims the key, appends Placed to the new order's stream and
// publishes OrderCreated through the outbox. Invalid input is refused before
// anything is written, an unknown customer before anything is kept.
//
// A connection lost under it is retried (pgerr.RetryLost: about eleven
// seconds, enough for a server to restart). That is safe because the key's
// claim commits with everything Place writes, in one transaction, and
// nothing in it acts outside the database (the payment steps' commands
// are only queued): a transaction that died left nothing, and one whose
// COMMIT went through unanswered left the key, so the retry answers with
// its order (Replayed) instead of placing another.
func (s *Service) Place(ctx context.Context, req PlaceRequest) (PlaceResult, error) {
	if err := req.Validate(); err != nil {
		return PlaceResult{}, err
	}
	claim := idempotency.Request{
		Scope: "orders.place:" + req.CustomerID,
		Key:   req.Key,
		Hash:  idempotency.Fingerprint([]byte(req.CustomerID), []byte(strconv.FormatInt(req.AmountCents, 10)), []byte(req.Note)),
	}
	res, err := pgerr.RetryLostValue(ctx, func(ctx context.Context) (idempotency.Result, error) {
		return s.cfg.Idempotency.Do(ctx, claim, func(ctx context.Context, tx delivery.DBTX) (idempotency.Response, error) {
			return s.place(ctx, tx, req)
		})
	})
	if err != nil {
		return PlaceResult{}, err
	}
	id, err := uuid.ParseBytes(res.Response.Body)
	if err != nil {
		return PlaceResult{}, fmt.Errorf("orders: stored order id %q: %w", res.Response.Body, err)
	}
	return PlaceResult{OrderID: id, Replayed: res.Replayed}, nil
}

// place writes a new order in tx, the transaction of Place's claim.
func (s *Service) place(ctx context.Context, tx delivery.DBTX, req PlaceRequest) (idempotency.Response, error) {
	var known bool
	if err := tx.QueryRowContext(ctx, customerExistsSQL, req.CustomerID).Scan(&known); err != nil {
		return idempotency.Response{}, fmt.Errorf("orders: looking up customer: %w", err)
	}
	if !known {
		return idempotency.Response{}, fmt.Errorf("%w: %s", ErrUnknownCustomer, req.CustomerID)
	}
	id := uuid.New()
	placed := Placed{OrderID: id, CustomerID: req.CustomerID, AmountCents: req.AmountCents, Note: req.Note}
	if _, err := s.cfg.Events.AppendTx(withKnown(ctx, Stream(id), Order{}), tx, Stream(id), 0, events.Metadata{CorrelationID: id.String(), IdempotencyKey: req.Key}, placed); err != nil {
		return idempotency.Response{}, err
	}
	if err := s.trigger(ctx, tx, OrderCreated{OrderID: id, CustomerID: req.CustomerID, AmountCents: req.AmountCents}); err != nil {
		return idempotency.Response{}, err
	}
	return idempotency.Response{Code: 201, Body: []byte(id.String())}, nil
}

// Order returns an order's current state, folded from its stream.
func (s *Service) Order(ctx context.Context, id uuid.UUID) (Order, error) {
	var o Order
	v, err := s.cfg.Events.FoldTx(ctx, s.cfg.DB, Stream(id), 0, &o)
	if err != nil {
		return Order{}, err
	}
	if v == 0 {
		return Order{}, fmt.Errorf("%w: %s", ErrOrderNotFound, id)
	}
	return o, nil
}

// CancelByCustomer cancels an order on the customer's behalf. It may race the
// saga: whoever appends first wins and the other sees the outcome.
// Cancelling a placed order succeeds, a cancelled one is a no-op, and a
// confirmed one is refused with ErrAlreadyConfirmed. Being a no-op the
// second time, it is retried over a lost connection (see Place).
func (s *Service) CancelByCustomer(ctx context.Context, id uuid.UUID, reason string) error {
	for attempt := 1; ; attempt++ {
		err := pgerr.RetryLost(ctx, func(ctx context.Context) error { return s.cancelByCustomer(ctx, id, reason) })
		if !errors.Is(err, events.ErrVersionConflict) || attempt == 10 {
			return err
		}
	}
}

func (s *Service) cancelByCustomer(ctx context.Context, id uuid.UUID, reason string) error {
	tx, err := s.cfg.DB.BeginTx(ctx, &sql.TxOptions{Isolation: sql.LevelReadCommitted})
	if err != nil {
		return fmt.Errorf("orders: cancelling %s: %w", id, err)
	}
	defer tx.Rollback() //nolint:errcheck // no-op after Commit
	var o Order
	v, err := s.cfg.Events.FoldTx(ctx, tx, Stream(id), 0, &o)
	switch {
	case err != nil:
		return err
	case v == 0:
		return fmt.Errorf("%w: %s", ErrOrderNotFound, id)
	case o.Status == StatusCancelled:
		return nil
	case o.Status == StatusConfirmed:
		return fmt.Errorf("%w: %s", ErrAlreadyConfirmed, id)
	}
	if _, err := s.cfg.Events.AppendTx(withKnown(ctx, Stream(id), o), tx, Stream(id), v, events.Metadata{CorrelationID: id.String()}, Cancelled{By: ByCustomer, Reason: reason}); err != nil {
		return err
	}
	if err := tx.Commit(); err != nil {
		return fmt.Errorf("orders: cancelling %s: %w", id, err)
	}
	return nil
}

// trigger sends OrderCreated in tx (see Config.Trigger).
func (s *Service) trigger(ctx context.Context, tx delivery.DBTX, created OrderCreated) error {
	if s.cfg.Trigger != nil {
		return s.cfg.Trigger(ctx, tx, created)
	}
	id := created.OrderID.String()
	msg, err := steps.NewMessage(created, steps.Envelope{
		ID:            uuid.NewSHA1(uuid.NameSpaceOID, []byte("order-created:"+id)).String(),
		CorrelationID: id,
		Key:           "order-created:" + id,
	})
	if err != nil {
		return err
	}
	return s.cfg.Publish(ctx, tx, CreatedTopic, msg)
}

// Confirm and Cancel are the order steps a saga sends its commands to
// (saga.Send); a Service serves them (ConfirmStep, CancelStep).
var (
	Confirm = steps.Define[ConfirmOrder](ConfirmStepName, ConfirmTopic, nil)
	Cancel  = steps.Define[CancelOrder](CancelStepName, CancelTopic, nil)
)

// ConfirmStep returns Confirm, served by s.
func (s *Service) ConfirmStep() steps.Step[ConfirmOrder] { return Confirm.Handle(s.confirm) }

// CancelStep returns Cancel, served by s.
func (s *Service) CancelStep() steps.Step[CancelOrder] { return Cancel.Handle(s.cancel) }

func (s *Service) confirm(ctx context.Context, tx *steps.Tx, cmd ConfirmOrder) (steps.Message, error) {
	var o Order
	v, err := tx.Fold(ctx, Stream(cmd.OrderID), &o)
	switch {
	case err != nil:
		return nil, err
	case v == 0:
		return nil, steps.Fail(ConfirmRejected{OrderID: cmd.OrderID, Reason: "unknown order"}, "unknown order")
	case o.Status == StatusConfirmed:
		return OrderConfirmed{OrderID: cmd.OrderID}, nil
	case o.Status == StatusCancelled:
		reason := "order cancelled by " + o.CancelledBy
		return nil, steps.Fail(ConfirmRejected{OrderID: cmd.OrderID, Reason: reason}, reason)
	}
	if _, err := tx.Append(withKnown(ctx, Stream(cmd.OrderID), o), Stream(cmd.OrderID), v, Confirmed{}); err != nil {
		return nil, err
	}
	return OrderConfirmed{OrderID: cmd.OrderID}, nil
}

func (s *Service) cancel(ctx context.Context, tx *steps.Tx, cmd CancelOrder) (steps.Message, error) {
	var o Order
	v, err := tx.Fold(ctx, Stream(cmd.OrderID), &o)
	switch {
	case err != nil:
		return nil, err
	case v == 0:
		return nil, steps.Fail(CancelRejected{OrderID: cmd.OrderID, Reason: "unknown order"}, "unknown order")
	case o.Status == StatusCancelled:
		return OrderCancelled{OrderID: cmd.OrderID, AlreadyCancelled: true}, nil
	}
	if _, err := tx.Append(withKnown(ctx, Stream(cmd.OrderID), o), Stream(cmd.OrderID), v, Cancelled{By: BySaga, Reason: cmd.Reason}); err != nil {
		return nil, err
	}
	return OrderCancelled{OrderID: cmd.OrderID}, nil
}

const (
	addCustomerSQL    = `INSERT INTO customers (customer_id, name) VALUES ($1, $2) ON CONFLICT (customer_id) DO NOTHING`
	customerExistsSQL = `SELECT EXISTS (SELECT FROM customers WHERE customer_id = $1)`
)
