// Package fakegateway is a fake payment gateway for the demo and the tests:
// an HTTP server on loopback with its own idempotency by key, like a real
// one, and faults on demand: decline, slow, unavailable (503), and "charged
// but the response was lost" (the charge commits, then the connection hangs
// until the client gives up).
//
// Its state (operations and every call) lives in PostgreSQL tables of its
// own, so a demo that is killed and resumed keeps talking to a gateway that
// remembers what it charged: a gateway started later on the same database
// (another process, another port) refunds the charges an earlier one made.
//
// Like a real gateway it may also forget idempotency keys (ForgetKeys): real
// ones keep a key for a retention period only, after which a call with the
// key is a new operation and charges again.
//
// API: POST /v1/charges and POST /v1/refunds with an Idempotency-Key header
// and a JSON body {"account_id": "...", "amount_cents": 123, "order_id":
// "..." (metadata, charges), "charge_id": "..." (refunds)}. 200 {"id":
// "ch_…"} on success, 402 {"error": "card_declined"} on decline, 503 when
// unavailable, 400 for bad requests: {"error": "no_such_charge"} for a
// refund of a charge the gateway never made (for that account), and
// {"error": "amount_exceeds_charge"} for one of more than was charged.
package fakegateway

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"net"
	"net/http"
	"sync"
	"time"

	"github.com/google/uuid"
)

// Fault is what the gateway does to one call.
type Fault string

// Faults.
const (
	None        Fault = ""
	Decline     Fault = "decline"     // refuse the charge or refund (stored: a retry with the key is declined too)
	Slow        Fault = "slow"        // answer after Config.SlowDelay
	Unavailable Fault = "unavailable" // 503 before doing anything
	Lost        Fault = "lost"        // do the operation, then hang up without an answer
)

// Call describes one call, for choosing its fault.
type Call struct {
	Op          string // "charge" or "refund"
	Key         string // the Idempotency-Key
	Attempt     int    // 1 for the first call with this key, ever
	AccountID   string
	AmountCents int64
	OrderID     string // the order id the caller sent as metadata, if any
}

// Config configures a Gateway.
type Config struct {
	// DB holds the gateway's state. Required.
	DB *sql.DB
	// Addr to listen on. Default: 127.0.0.1:0 (a free port).
	Addr string
	// Faults picks the fault of each call. Default: none.
	Faults func(Call) Fault
	// SlowDelay is how long a Slow call waits. Default: 300ms.
	SlowDelay time.Duration
	// LostHang is how long a Lost call hangs before hanging up, unless the
	// client gives up first. Default: 30s.
	LostHang time.Duration
	// Logger. Default: slog.Default().
	Logger *slog.Logger
}

// RandomFaults returns a Faults function that injects a fault into a share
// rate of calls, choosing evenly among kinds, reproducibly from seed.
func RandomFaults(seed uint64, rate float64, kinds ...Fault) func(Call) Fault {
	if len(kinds) == 0 {
		kinds = []Fault{Slow, Unavailable, Lost}
	}
	var mu sync.Mutex
	rng := rand.New(rand.NewPCG(seed, 0x6761746577617921))
	return func(Call) Fault {
		mu.Lock()
		defer mu.Unlock()
		if rng.Float64() >= rate {
			return None
		}
		return kinds[rng.IntN(len(kinds))]
	}
}

// Gateway is a running fake gateway.
type Gateway struct {
	cfg  Config
	srv  *http.Server
	ln   net.Listener
	done chan struct{}
}

// Start creates the gateway's tables if needed and starts serving.
func Start(ctx context.Context, cfg Config) (*Gateway, error) {
	if cfg.DB == nil {
		return nil, errors.New("fakegateway: Config.DB is required")
	}
	if cfg.Addr == "" {
		cfg.Addr = "127.0.0.1:0"
	}
	if cfg.Faults == nil {
		cfg.Faults = func(Call) Fault { return None }
	}
	if cfg.SlowDelay == 0 {
		cfg.SlowDelay = 300 * time.Millisecond
	}
	if cfg.LostHang == 0 {
		cfg.LostHang = 30 * time.Second
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if err := createSchema(ctx, cfg.DB); err != nil {
		return nil, err
	}
	ln, err := net.Listen("tcp", cfg.Addr)
	if err != nil {
		return nil, fmt.Errorf("fakegateway: listening on %s: %w", cfg.Addr, err)
	}
	g := &Gateway{cfg: cfg, ln: ln, done: make(chan struct{})}
	mux := http.NewServeMux()
	mux.HandleFunc("POST /v1/charges", func(w http.ResponseWriter, r *http.Request) { g.serve(w, r, "charge") })
	mux.HandleFunc("POST /v1/refunds", func(w http.ResponseWriter, r *http.Request) { g.serve(w, r, "refund") })
	g.srv = &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	go func() {
		defer close(g.done)
		if err := g.srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			cfg.Logger.Error("fake gateway stopped", "err", err)
		}
	}()
	return g, nil
}

// URL is the gateway's base URL.
func (g *Gateway) URL() string { return "http://" + g.ln.Addr().String() }

// Close stops the gateway, cutting hanging calls.
func (g *Gateway) Close() error {
	err := g.srv.Close()
	<-g.done
	return err
}

type request struct {
	AccountID   string `json:"account_id"`
	AmountCents int64  `json:"amount_cents"`
	ChargeID    string `json:"charge_id,omitempty"`
	// OrderID is metadata: the gateway stores it and never checks it, so
	// reconciliation can find every charge of an order.
	OrderID string `json:"order_id,omitempty"`
}

func (g *Gateway) serve(w http.ResponseWriter, r *http.Request, op string) {
	ctx := r.Context()
	key := r.Header.Get("Idempotency-Key")
	var req request
	if err := json.NewDecoder(http.MaxBytesReader(w, r.Body, 4096)).Decode(&req); err != nil || key == "" || req.AmountCents <= 0 || req.AccountID == "" {
		writeJSON(w, http.StatusBadRequest, map[string]string{"error": "bad_request"})
		return
	}
	if op == "refund" {
		problem, err := g.checkRefund(ctx, req)
		if err != nil {
			g.cfg.Logger.Error("fake gateway: reading the refunded charge", "err", err)
			writeJSON(w, http.StatusInternalServerError, map[string]string{"error": "internal"})
			return
		}
		if problem != "" {
			writeJSON(w, http.StatusBadRequest, map[string]string{"error": problem})
			return
		}
	}
	attempt, err := g.recordCall(ctx, key, op)
	if err != nil {
		g.cfg.Logger.Error("fake gateway: recording call", "err", err)
		writeJSON(w, http.StatusInternalServerError, map[string]string{"error": "internal"})
		return
	}
	fault := g.cfg.Faults(Call{Op: op, Key: key, Attempt: attempt, AccountID: req.AccountID, AmountCents: req.AmountCents, OrderID: req.OrderID})
	if err := g.noteFault(ctx, key, attempt, fault); err != nil {
		g.cfg.Logger.Error("fake gateway: recording fault", "err", err)
	}
	switch fault {
	case Unavailable:
		writeJSON(w, http.StatusServiceUnavailable, map[string]string{"error": "unavailable"})
		return
	case Slow:
		select {
		case <-time.After(g.cfg.SlowDelay):
		case <-ctx.Done():
			return
		}
	}
	outcome := "succeeded"
	if fault == Decline {
		outcome = "declined"
	}
	opID, stored, err := g.operate(ctx, key, op, req, outcome)
	if err != nil {
		g.cfg.Logger.Error("fake gateway: operating", "err", err)
		writeJSON(w, http.StatusInternalServerError, map[string]string{"error": "internal"})
		return
	}
	if fault == Lost {
		// The operation is done; the answer never arrives.
		select {
		case <-time.After(g.cfg.LostHang):
		case <-ctx.Done():
		}
		if hj, ok := w.(http.Hijacker); ok {
			if conn, _, err := hj.Hijack(); err == nil {
				_ = conn.Close()
			}
		}
		return
	}
	if stored == "declined" {
		writeJSON(w, http.StatusPaymentRequired, map[string]string{"error": "card_declined", "id": opID})
		return
	}
	writeJSON(w, http.StatusOK, map[string]string{"id": opID})
}

// checkRefund says what is wrong with a refund, as a real gateway would:
// its charge must be one this gateway made (by any process, at any time:
// the operations are in the database), succeeded, for the same account,
// and not of less than the refund. "" when nothing is.
func (g *Gateway) checkRefund(ctx context.Context, req request) (string, error) {
	var charged int64
	err := g.cfg.DB.QueryRowContext(ctx, chargeOfRefundSQL, req.ChargeID, req.AccountID).Scan(&charged)
	switch {
	case errors.Is(err, sql.ErrNoRows):
		return "no_such_charge", nil
	case err != nil:
		return "", err
	case req.AmountCents > charged:
		return "amount_exceeds_charge", nil
	}
	return "", nil
}

// recordCall counts a call and returns how many calls the key has had.
func (g *Gateway) recordCall(ctx context.Context, key, op string) (int, error) {
	var n int
	err := g.cfg.DB.QueryRowContext(ctx, recordCallSQL, key, op).Scan(&n)
	return n, err
}

func (g *Gateway) noteFault(ctx context.Context, key string, attempt int, fault Fault) error {
	if fault == None {
		return nil
	}
	_, err := g.cfg.DB.ExecContext(ctx, noteFaultSQL, key, attempt, string(fault))
	return err
}

// operate performs op once per key and returns the operation's id and
// outcome, as first stored.
func (g *Gateway) operate(ctx context.Context, key, op string, req request, outcome string) (id, stored string, err error) {
	prefix := "ch_"
	if op == "refund" {
		prefix = "re_"
	}
	err = g.cfg.DB.QueryRowContext(ctx, insertOperationSQL, key, op, req.AccountID, req.AmountCents, nullIfEmpty(req.ChargeID), outcome,
		prefix+uuid.NewString()[:18], nullIfEmpty(req.OrderID)).Scan(&id, &stored)
	if errors.Is(err, sql.ErrNoRows) {
		err = g.cfg.DB.QueryRowContext(ctx, storedOperationSQL, key).Scan(&id, &stored)
	}
	return id, stored, err
}

func nullIfEmpty(s string) any {
	if s == "" {
		return nil
	}
	return s
}

func writeJSON(w http.ResponseWriter, code int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	_ = json.NewEncoder(w).Encode(v)
}

// Operation is what the gateway did for one key.
type Operation struct {
	Key         string
	Op          string
	AccountID   string
	AmountCents int64
	Outcome     string // "succeeded" or "declined"
	ID          string
	OrderID     string // as sent by the caller; "" when none was
	// Calls counts every call with the key, including those made before the
	// gateway forgot it.
	Calls int
}

// Operation returns what was done under key, and whether anything was.
func (g *Gateway) Operation(ctx context.Context, key string) (Operation, bool, error) {
	var o Operation
	err := g.cfg.DB.QueryRowContext(ctx, getOperationSQL, key).Scan(&o.Key, &o.Op, &o.AccountID, &o.AmountCents, &o.Outcome, &o.ID, &o.OrderID, &o.Calls)
	if errors.Is(err, sql.ErrNoRows) {
		return Operation{}, false, nil
	}
	return o, err == nil, err
}

// ForgetKeys makes the gateway forget the given idempotency keys (every key
// when none is given), as a real gateway does once a key's retention period
// has passed: the next call with a forgotten key is a new operation, and a
// charge charges again. What the gateway did stays on record (Stats, the
// operations table the invariant checker reconciles with the ledger); only
// the key no longer leads to it. It returns how many operations it forgot.
func (g *Gateway) ForgetKeys(ctx context.Context, keys ...string) (int, error) {
	var arg any // NULL: every key
	if len(keys) > 0 {
		arg = keys
	}
	res, err := g.cfg.DB.ExecContext(ctx, forgetKeysSQL, arg)
	if err != nil {
		return 0, fmt.Errorf("fakegateway: forgetting keys: %w", err)
	}
	n, err := res.RowsAffected()
	if err != nil {
		return 0, fmt.Errorf("fakegateway: forgetting keys: %w", err)
	}
	return int(n), nil
}

// Stats sums up what the gateway has done.
type Stats struct {
	Calls         int
	Charges       int
	ChargedCents  int64
	Refunds       int
	RefundedCents int64
	Declines      int
	// Faults counts injected faults by kind.
	Faults map[Fault]int
}

// Stats reads the gateway's totals.
func (g *Gateway) Stats(ctx context.Context) (Stats, error) {
	return ReadStats(ctx, g.cfg.DB)
}

// ReadStats reads a gateway's totals from its tables in db.
func ReadStats(ctx context.Context, db *sql.DB) (Stats, error) {
	s := Stats{Faults: map[Fault]int{}}
	err := db.QueryRowContext(ctx, statsSQL).Scan(&s.Calls, &s.Charges, &s.ChargedCents, &s.Refunds, &s.RefundedCents, &s.Declines)
	if err != nil {
		return Stats{}, fmt.Errorf("fakegateway: reading stats: %w", err)
	}
	rows, err := db.QueryContext(ctx, faultStatsSQL)
	if err != nil {
		return Stats{}, fmt.Errorf("fakegateway: reading stats: %w", err)
	}
	defer rows.Close()
	for rows.Next() {
		var f string
		var n int
		if err := rows.Scan(&f, &n); err != nil {
			return Stats{}, err
		}
		s.Faults[Fault(f)] = n
	}
	return s, rows.Err()
}

func createSchema(ctx context.Context, db *sql.DB) error {
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		return fmt.Errorf("fakegateway: creating tables: %w", err)
	}
	defer tx.Rollback() //nolint:errcheck // no-op after Commit
	if _, err := tx.ExecContext(ctx, `SELECT pg_advisory_xact_lock(7067736167610004)`); err != nil {
		return fmt.Errorf("fakegateway: creating tables: %w", err)
	}
	if _, err := tx.ExecContext(ctx, schemaSQL); err != nil {
		return fmt.Errorf("fakegateway: creating tables: %w", err)
	}
	return tx.Commit()
}

const (
	schemaSQL = `
CREATE TABLE IF NOT EXISTS fake_gateway_operations (
    key          text        PRIMARY KEY,
    op           text        NOT NULL,
    account_id   text        NOT NULL,
    amount_cents bigint      NOT NULL,
    charge_id    text,
    outcome      text        NOT NULL,
    id           text        NOT NULL,
    created_at   timestamptz NOT NULL DEFAULT now()
);
-- Added after the first release: ADD COLUMN IF NOT EXISTS upgrades the
-- tables of a database that already had them.
-- order_id is the caller's metadata; forgotten_key is the key an operation
-- had before the gateway forgot it (its key is then 'forgotten:' || id, so
-- the key is free for a new operation while the old one stays on record).
ALTER TABLE fake_gateway_operations ADD COLUMN IF NOT EXISTS order_id text;
ALTER TABLE fake_gateway_operations ADD COLUMN IF NOT EXISTS forgotten_key text;
CREATE INDEX IF NOT EXISTS fake_gateway_operations_id_idx ON fake_gateway_operations (id);
CREATE TABLE IF NOT EXISTS fake_gateway_call_counts (
    key   text PRIMARY KEY,
    calls int  NOT NULL
);
CREATE TABLE IF NOT EXISTS fake_gateway_calls (
    key   text        NOT NULL,
    op    text        NOT NULL,
    n     int         NOT NULL,
    fault text,
    at    timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (key, n)
);`

	// recordCallSQL numbers the calls of a key: the upsert of the counter
	// row serialises concurrent calls with one key.
	recordCallSQL = `WITH c AS (
    INSERT INTO fake_gateway_call_counts AS cc (key, calls) VALUES ($1, 1)
    ON CONFLICT (key) DO UPDATE SET calls = cc.calls + 1
    RETURNING calls)
INSERT INTO fake_gateway_calls (key, op, n) SELECT $1, $2, calls FROM c
RETURNING n`

	// chargeOfRefundSQL reads the amount of the charge a refund names.
	chargeOfRefundSQL = `SELECT amount_cents FROM fake_gateway_operations
WHERE id = $1 AND op = 'charge' AND outcome = 'succeeded' AND account_id = $2`

	noteFaultSQL = `UPDATE fake_gateway_calls SET fault = $3 WHERE key = $1 AND n = $2`

	// insertOperationSQL stores an operation unless the key has one.
	insertOperationSQL = `INSERT INTO fake_gateway_operations (key, op, account_id, amount_cents, charge_id, outcome, id, order_id)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8)
ON CONFLICT (key) DO NOTHING
RETURNING id, outcome`

	// storedOperationSQL reads the operation a key already has; a statement
	// of its own, so it sees a concurrent insert the first one waited for.
	storedOperationSQL = `SELECT id, outcome FROM fake_gateway_operations WHERE key = $1`

	// forgetKeysSQL moves operations off their keys; an operation forgotten
	// once is never renamed again.
	forgetKeysSQL = `UPDATE fake_gateway_operations SET forgotten_key = key, key = 'forgotten:' || id
WHERE forgotten_key IS NULL AND ($1::text[] IS NULL OR key = ANY ($1::text[]))`

	getOperationSQL = `SELECT o.key, o.op, o.account_id, o.amount_cents, o.outcome, o.id, coalesce(o.order_id, ''),
    (SELECT count(*) FROM fake_gateway_calls c WHERE c.key = o.key)
FROM fake_gateway_operations o WHERE o.key = $1`

	statsSQL = `SELECT
    (SELECT count(*) FROM fake_gateway_calls),
    count(*) FILTER (WHERE op = 'charge' AND outcome = 'succeeded'),
    coalesce(sum(amount_cents) FILTER (WHERE op = 'charge' AND outcome = 'succeeded'), 0),
    count(*) FILTER (WHERE op = 'refund' AND outcome = 'succeeded'),
    coalesce(sum(amount_cents) FILTER (WHERE op = 'refund' AND outcome = 'succeeded'), 0),
    count(*) FILTER (WHERE outcome = 'declined')
FROM fake_gateway_operations`

	faultStatsSQL = `SELECT fault, count(*) FROM fake_gateway_calls WHERE fault IS NOT NULL GROUP BY fault`
)
