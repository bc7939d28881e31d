// Package payments is the sample payments domain: accounts whose balance is
// the sum of their postings in account_postings, deposits, and the charge and
// refund steps the saga drives, which call a payment gateway.
//
// The ledger invariant: an account's balance is SUM(delta_cents) of its
// postings and is never negative; an order is charged at most once, voided
// at most once and refunded at most once; a refund returns exactly what was
// charged. Every posting is made by a domain event of the account's stream
// ("account-<id>") in the same transaction; event_id is the event's id.
//
// The gateway is an external side effect. A charge reserves the money first:
// in one transaction, committed before the call, it claims the gateway call
// (a lease, the two-phase form of the idempotency package) and posts the
// charge. Then it calls the gateway with the step's stable key, and records
// the answer in a transaction of its own: captured (the gateway's charge id),
// or voided (declined: the money goes back). An unknown outcome (a timeout)
// is never recorded: the call is repeated with the same key and the gateway
// charges once. So every charge at the gateway has its posting, and the
// balance is checked exactly once per order.
//
// A finished charge is final. Whatever arrives later for the order and
// account (a re-sent command, or one redelivered after the idempotency
// reaper removed its key, to a gateway that may have forgotten the key too)
// is answered from the ledger: the captured charge, or the decline of a
// voided one. The gateway is never called again for it, and a reference,
// once recorded, is never overwritten.
package payments

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"log/slog"
	"regexp"
	"time"

	"github.com/google/uuid"

	"github.com/pgsaga/pgsaga/idempotency"
	"github.com/pgsaga/pgsaga/internal/pgerr"
	"github.com/pgsaga/pgsaga/saga/delivery"
	"github.com/pgsaga/pgsaga/steps"
	"github.com/pgsaga/pgsaga/steps/events"
)

// Topics of the domain's steps.
const (
	ChargeTopic = "payments.charge"
	RefundTopic = "payments.refund"
)

// Names of the steps (their idempotency scopes and consumer groups).
const (
	ChargeStepName = "payments.charge"
	RefundStepName = "payments.refund"
)

// Events of an account stream.

// Deposited adds money to an account.
type Deposited struct {
	AmountCents int64 `json:"amount_cents"`
}

// EventType implements events.Event: the type name in the event store.
func (Deposited) EventType() string { return "payments.deposited" }

// Charged takes an order's amount from an account: reserved before the
// gateway is called, so the money is spoken for whatever happens next.
type Charged struct {
	OrderID     uuid.UUID `json:"order_id"`
	AmountCents int64     `json:"amount_cents"`
}

// EventType implements events.Event: the type name in the event store.
func (Charged) EventType() string { return "payments.charged" }

// ChargeCaptured records the gateway's charge for a reserved charge.
type ChargeCaptured struct {
	OrderID  uuid.UUID `json:"order_id"`
	ChargeID string    `json:"charge_id"`
}

// EventType implements events.Event: the type name in the event store.
func (ChargeCaptured) EventType() string { return "payments.charge_captured" }

// ChargeVoided gives a reserved charge back: the gateway declined it.
type ChargeVoided struct {
	OrderID     uuid.UUID `json:"order_id"`
	AmountCents int64     `json:"amount_cents"`
	Reason      string    `json:"reason"`
}

// EventType implements events.Event: the type name in the event store.
func (ChargeVoided) EventType() string { return "payments.charge_voided" }

// Refunded returns an order's charge to the account.
type Refunded struct {
	OrderID     uuid.UUID `json:"order_id"`
	AmountCents int64     `json:"amount_cents"`
	RefundID    string    `json:"refund_id"`
}

// EventType implements events.Event: the type name in the event store.
func (Refunded) EventType() string { return "payments.refunded" }

// RegisterEvents adds the account events to reg.
func RegisterEvents(reg *events.Registry) error {
	return errors.Join(
		events.Register[Deposited](reg),
		events.Register[Charged](reg),
		events.Register[ChargeCaptured](reg),
		events.Register[ChargeVoided](reg),
		events.Register[Refunded](reg),
	)
}

// Stream is the event stream of an account.
func Stream(account string) string { return "account-" + account }

// Messages.

// ChargePayment asks to charge an order's amount to an account.
type ChargePayment struct {
	OrderID     uuid.UUID `json:"order_id"`
	AccountID   string    `json:"account_id"`
	AmountCents int64     `json:"amount_cents"`
}

// MessageType implements steps.Message: the type name on the wire.
func (ChargePayment) MessageType() string { return "payments.ChargePayment" }

// PaymentCharged answers ChargePayment.
type PaymentCharged struct {
	OrderID     uuid.UUID `json:"order_id"`
	AmountCents int64     `json:"amount_cents"`
	ChargeID    string    `json:"charge_id"`
}

// MessageType implements steps.Message: the type name on the wire.
func (PaymentCharged) MessageType() string { return "payments.PaymentCharged" }

// PaymentFailed answers ChargePayment when nothing was charged.
type PaymentFailed struct {
	OrderID uuid.UUID `json:"order_id"`
	Reason  string    `json:"reason"`
}

// MessageType implements steps.Message: the type name on the wire.
func (PaymentFailed) MessageType() string { return "payments.PaymentFailed" }

// RefundPayment asks to refund what was charged for an order.
type RefundPayment struct {
	OrderID   uuid.UUID `json:"order_id"`
	AccountID string    `json:"account_id"`
}

// MessageType implements steps.Message: the type name on the wire.
func (RefundPayment) MessageType() string { return "payments.RefundPayment" }

// RefundFailed answers RefundPayment when the gateway refused the refund:
// the money stays with the merchant and a person must act.
type RefundFailed struct {
	OrderID uuid.UUID `json:"order_id"`
	Reason  string    `json:"reason"`
}

// MessageType implements steps.Message: the type name on the wire.
func (RefundFailed) MessageType() string { return "payments.RefundFailed" }

// PaymentRefunded answers RefundPayment. AmountCents is 0 when the order was
// never charged, and Already is set when it had been refunded before.
type PaymentRefunded struct {
	OrderID     uuid.UUID `json:"order_id"`
	AmountCents int64     `json:"amount_cents"`
	RefundID    string    `json:"refund_id,omitempty"`
	Already     bool      `json:"already,omitempty"`
}

// MessageType implements steps.Message: the type name on the wire.
func (PaymentRefunded) MessageType() string { return "payments.PaymentRefunded" }

// Reasons a charge fails.
const (
	ReasonInsufficientFunds = "insufficient funds"
	ReasonDeclined          = "card declined"
	ReasonUnknownAccount    = "unknown account"
	ReasonInvalidCharge     = "invalid charge"
	ReasonAbandoned         = "payment abandoned: the order was compensated"
	ReasonRefundDeclined    = "refund declined by the gateway"
	// ReasonChargedElsewhere: the order is charged to another account; an
	// order is charged once, to one account.
	ReasonChargedElsewhere = "the order is charged to another account"
)

var accountIDPattern = regexp.MustCompile(`^[A-Za-z0-9_.-]{1,64}$`)

// Config configures a Service.
type Config struct {
	// DB is required.
	DB *sql.DB
	// Events is the event store; its registry must hold the account events
	// (RegisterEvents). Required.
	Events *events.Store
	// Idempotency holds deposit keys and the gateway leases. Required.
	Idempotency *idempotency.Store
	// Gateway is the payment gateway client. Required.
	Gateway *GatewayClient
	// GatewayLease is how long a gateway call's claim is held before another
	// worker may take it over and call again with the same key. It must
	// exceed the gateway client's timeout. Default: 10s.
	GatewayLease time.Duration
	// Logger. Default: slog.Default().
	Logger *slog.Logger
}

// Service is the payments domain.
type Service struct {
	cfg     Config
	answers answers // of the gateway calls this process recorded
}

// New validates cfg and returns a Service.
func New(cfg Config) (*Service, error) {
	if cfg.DB == nil || cfg.Events == nil || cfg.Idempotency == nil || cfg.Gateway == nil {
		return nil, errors.New("payments: Config.DB, Events, Idempotency and Gateway are required")
	}
	if _, err := cfg.Events.Registry().Decode(Deposited{}.EventType(), []byte(`{}`)); err != nil {
		return nil, fmt.Errorf("payments: the event store's registry lacks the account events (payments.RegisterEvents): %w", err)
	}
	if cfg.GatewayLease == 0 {
		cfg.GatewayLease = 10 * time.Second
	}
	timeout := 2 * time.Second
	if cfg.Gateway.HTTP != nil && cfg.Gateway.HTTP.Timeout > 0 {
		timeout = cfg.Gateway.HTTP.Timeout
	}
	if cfg.GatewayLease <= timeout {
		return nil, fmt.Errorf("payments: GatewayLease (%s) must exceed the gateway client's timeout (%s)", cfg.GatewayLease, timeout)
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	return &Service{cfg: cfg}, nil
}

// Charge and Refund are the payment steps a saga sends its commands to
// (saga.Send); a Service serves them (ChargeStep, RefundStep).
var (
	Charge = steps.Define[ChargePayment](ChargeStepName, ChargeTopic, nil)
	Refund = steps.Define[RefundPayment](RefundStepName, RefundTopic, nil)
)

// ChargeStep returns Charge, served by s.
func (s *Service) ChargeStep() steps.Step[ChargePayment] { return Charge.Handle(s.charge) }

// RefundStep returns Refund, served by s.
func (s *Service) RefundStep() steps.Step[RefundPayment] { return Refund.Handle(s.refund) }

// OpenAccount creates an account; opening it twice is a no-op, so a
// connection lost under it is retried (pgerr.RetryLost).
func (s *Service) OpenAccount(ctx context.Context, id string) error {
	if !accountIDPattern.MatchString(id) {
		return fmt.Errorf("%w: %q", ErrInvalidAccountID, id)
	}
	err := pgerr.RetryLost(ctx, func(ctx context.Context) error {
		_, err := s.cfg.DB.ExecContext(ctx, openAccountSQL, id)
		return err
	})
	if err != nil {
		return fmt.Errorf("payments: opening account %s: %w", id, err)
	}
	return nil
}

// Deposit adds amountCents to an account, once per key. A connection lost
// under it is retried (pgerr.RetryLost): the key's claim commits with the
// posting, so a retry after a COMMIT that went through unanswered finds
// the key and deposits nothing more.
func (s *Service) Deposit(ctx context.Context, account string, amountCents int64, key string) error {
	if amountCents <= 0 {
		return fmt.Errorf("%w, got %d", ErrInvalidAmount, amountCents)
	}
	req := idempotency.Request{Scope: "payments.deposit:" + account, Key: key, Hash: idempotency.Fingerprint([]byte(fmt.Sprint(amountCents)))}
	return pgerr.RetryLost(ctx, func(ctx context.Context) error {
		_, err := s.cfg.Idempotency.Do(ctx, req, func(ctx context.Context, tx delivery.DBTX) (idempotency.Response, error) {
			if err := lockAccount(ctx, tx, account); err != nil {
				return idempotency.Response{}, err
			}
			recs, err := s.cfg.Events.AppendTx(ctx, tx, Stream(account), events.AnyVersion, events.Metadata{IdempotencyKey: key}, Deposited{AmountCents: amountCents})
			if err != nil {
				return idempotency.Response{}, err
			}
			_, err = tx.ExecContext(ctx, insertPostingSQL, account, recs[0].ID, amountCents, nil, "deposit", nil, key)
			return idempotency.Response{Code: 200}, err
		})
		return err
	})
}

// Balance returns an account's balance: the sum of its postings.
func (s *Service) Balance(ctx context.Context, account string) (int64, error) {
	var b int64
	if err := s.cfg.DB.QueryRowContext(ctx, balanceSQL, account).Scan(&b); err != nil {
		return 0, fmt.Errorf("payments: balance of %s: %w", account, err)
	}
	return b, nil
}

// queueLock queues the account's lock (lockAccountSQL, as lockAccount
// runs it) with the statement that comes after it: that statement starts
// once the lock is held, so that under READ COMMITTED it sees what the
// account's earlier holders committed. Its row count is not read: the
// statement after it must check that the transaction holds the lock (the
// reservation reads the account's row as the lock wrote it), unless the
// account is known to exist (it has postings).
func queueLock(ctx context.Context, tx delivery.DBTX, account string) error {
	return steps.Queue(ctx, tx, "payments: locking account "+account, lockAccountSQL, account)
}

// lockAccount locks an account against other postings. The lock is what
// keeps the account's writers in turn: each decides on what it reads after
// it (the balance, the order's postings) and appends to the account's
// stream at events.AnyVersion, after whatever the writers before it
// appended, with no read of the stream's version of its own. Under
// REPEATABLE READ, a posting committed after the transaction's snapshot
// makes the lock fail with a serialization error, instead of a balance
// computed without that posting.
func lockAccount(ctx context.Context, tx delivery.DBTX, account string) error {
	res, err := tx.ExecContext(ctx, lockAccountSQL, account)
	if err != nil {
		return fmt.Errorf("payments: locking account %s: %w", account, err)
	}
	n, err := res.RowsAffected()
	if err != nil {
		return fmt.Errorf("payments: locking account %s: %w", account, err)
	}
	if n == 0 {
		return fmt.Errorf("%w: %s", ErrUnknownAccount, account)
	}
	return nil
}

const (
	openAccountSQL = `INSERT INTO accounts (account_id) VALUES ($1) ON CONFLICT (account_id) DO NOTHING`
	lockAccountSQL = `UPDATE accounts SET version = version + 1 WHERE account_id = $1`
	balanceSQL     = `SELECT coalesce(sum(delta_cents), 0) FROM account_postings WHERE account_id = $1`

	insertPostingSQL = `INSERT INTO account_postings (account_id, event_id, delta_cents, order_id, kind, reference, request_key)
VALUES ($1, $2, $3, $4, $5, $6, $7)`

	// orderPostingSQL finds an order's posting of one kind.
	orderPostingSQL = `SELECT delta_cents, coalesce(reference, ''), coalesce(request_key, '') FROM account_postings
WHERE account_id = $1 AND order_id = $2 AND kind = $3`

	fenceSQL = `INSERT INTO charge_fences (order_id, account_id) VALUES ($1, $2) ON CONFLICT (order_id) DO NOTHING`

	// reservationSQL reads what a charge's reservation decides on: whether
	// the account is locked by this transaction (its row's version is the
	// one the queued lock wrote: an account opened after the lock matched
	// no row exists, but is not locked, and counts as unknown, as the lock
	// found it; the transaction takes no savepoint before it), whether
	// the order is fenced, its charge posting on the account (one at most:
	// account_postings_one_charge_idx), whether that was voided, and the
	// account's balance. It runs after the account's lock, so that its
	// snapshot holds what the charges before it committed.
	reservationSQL = `SELECT EXISTS (SELECT FROM accounts WHERE account_id = $1 AND xmin = pg_current_xact_id()::xid),
    EXISTS (SELECT FROM charge_fences WHERE order_id = $2),
    c.delta_cents, coalesce(c.reference, ''), coalesce(c.request_key, ''),
    EXISTS (SELECT FROM account_postings WHERE account_id = $1 AND order_id = $2 AND kind = 'void'),
    (SELECT coalesce(sum(delta_cents), 0) FROM account_postings WHERE account_id = $1)
FROM (VALUES (1)) AS one
LEFT JOIN account_postings c ON c.account_id = $1 AND c.order_id = $2 AND c.kind = 'charge'`

	// captureSQL records the gateway's charge id on a reserved charge. Once
	// set, a reference is never overwritten: that would orphan the charge
	// it named (money taken at the gateway that no posting accounts for).
	captureSQL = `UPDATE account_postings SET reference = $3
WHERE account_id = $1 AND order_id = $2 AND kind = 'charge' AND reference IS NULL`

	// oneChargeIndex allows one charge posting per order (migration 00004).
	oneChargeIndex = "account_postings_one_charge_idx"
)
