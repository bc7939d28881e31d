package payments_test

import (
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/idempotency"
	"github.com/pgsaga/pgsaga/internal/pgdb"
	"github.com/pgsaga/pgsaga/internal/stepsrt"
	"github.com/pgsaga/pgsaga/internal/testdb"
	"github.com/pgsaga/pgsaga/internal/testout"
	"github.com/pgsaga/pgsaga/internal/testpg"
	"github.com/pgsaga/pgsaga/internal/testsample"
	"github.com/pgsaga/pgsaga/internal/transport"
	"github.com/pgsaga/pgsaga/payments"
	"github.com/pgsaga/pgsaga/payments/fakegateway"
	"github.com/pgsaga/pgsaga/steps"
	"github.com/pgsaga/pgsaga/steps/events"
)

func TestMain(m *testing.M) { testpg.Main(m, testsample.Schemas()...) }

// logger is the tests' logger (PGSAGA_TEST_LOG shows it).
var logger = testout.Logger

type env struct {
	t       *testing.T
	db      *testdb.DB
	tr      *transport.Transport
	store   *idempotency.Store
	rt      stepsrt.Runtime
	gw      *fakegateway.Gateway
	svc     *payments.Service
	replies string

	mu     sync.Mutex
	faults map[string][]fakegateway.Fault // per key, by attempt
}

func newEnv(t *testing.T) *env { return newEnvWithPool(t, 0) }

// newEnvWithPool gives the steps a pool of their own of maxConns (0: the
// package's shared pool).
func newEnvWithPool(t *testing.T, maxConns int32) *env {
	t.Helper()
	return newEnvWith(t, envOptions{maxConns: maxConns})
}

// envOptions vary an env; the zero value is newEnv's.
type envOptions struct {
	// db is the database; default: the package's shared one.
	db *testdb.DB
	// maxConns gives the steps a pool of their own (0: db's pool).
	maxConns int32
	// retry is the steps' retry policy; default: the transport's (6 attempts).
	retry *transport.RetryPolicy
	// gatewayTimeout and gatewayLease: default 300ms and 1s.
	gatewayTimeout, gatewayLease time.Duration
	// hook sees every gateway call before its fault is chosen (and may
	// hold it).
	hook func(fakegateway.Call)
	// tracer sees every statement of the steps' and the ledger's pool (a
	// pool of their own, of maxConns or 8).
	tracer pgx.QueryTracer
}

func newEnvWith(t *testing.T, opts envOptions) *env {
	t.Helper()
	db := opts.db
	if db == nil {
		db = testdb.Shared(t)
	}
	if opts.tracer != nil {
		pool, err := pgdb.Open(context.Background(), pgdb.Config{URL: db.URL, MaxConns: cmp.Or(opts.maxConns, 8), Tracer: opts.tracer})
		require.NoError(t, err)
		t.Cleanup(pool.Close)
		db = &testdb.DB{Name: db.Name, URL: db.URL, Pool: pool.Pool, SQL: pool.SQL}
	} else if opts.maxConns > 0 {
		pool := testdb.Open(t, db.URL, opts.maxConns)
		db = &testdb.DB{Name: db.Name, URL: db.URL, Pool: pool.Pool, SQL: pool.SQL}
	}
	e := &env{t: t, db: db, faults: map[string][]fakegateway.Fault{}, replies: "replies_" + uuid.NewString()[:8]}
	tr, err := transport.New(transport.Config{DB: db.SQL, Logger: logger(), PollInterval: 20 * time.Millisecond, IdlePollInterval: testdb.NoSafetyPoll,
		Retry: transport.RetryPolicy{MaxAttempts: 6, InitialBackoff: 10 * time.Millisecond, MaxBackoff: 100 * time.Millisecond}})
	require.NoError(t, err)
	store, err := idempotency.NewStore(idempotency.Config{DB: db.SQL})
	require.NoError(t, err)
	reg := events.NewRegistry()
	require.NoError(t, payments.RegisterEvents(reg))
	es, err := events.NewStore(events.Config{Registry: reg})
	require.NoError(t, err)
	rt, err := stepsrt.New(stepsrt.Config{Transport: tr, Store: store, Events: es, Logger: logger(), Retry: opts.retry})
	require.NoError(t, err)
	// The gateway is another service: it gets a pool of its own.
	gwPool := testdb.Open(t, db.URL, 4)
	faults := e.fault
	if opts.hook != nil {
		faults = func(c fakegateway.Call) fakegateway.Fault { opts.hook(c); return e.fault(c) }
	}
	gw, err := fakegateway.Start(context.Background(), fakegateway.Config{DB: gwPool.SQL, Logger: logger(),
		LostHang: 2 * time.Second, SlowDelay: 50 * time.Millisecond, Faults: faults})
	require.NoError(t, err)
	t.Cleanup(func() { _ = gw.Close() })
	svc, err := payments.New(payments.Config{DB: db.SQL, Events: es, Idempotency: store, Logger: logger(),
		Gateway:      &payments.GatewayClient{BaseURL: gw.URL(), HTTP: &http.Client{Timeout: cmp.Or(opts.gatewayTimeout, 300*time.Millisecond)}},
		GatewayLease: cmp.Or(opts.gatewayLease, time.Second)})
	require.NoError(t, err)
	e.tr, e.store, e.rt, e.gw, e.svc = tr, store, rt, gw, svc
	// "reader" keeps the replies queued for the tests to read.
	require.NoError(t, tr.Subscribe(context.Background(), transport.Subscription{Topic: e.replies, ConsumerGroup: "reader"}))
	return e
}

// fault injects the faults planned for a key, attempt by attempt.
func (e *env) fault(c fakegateway.Call) fakegateway.Fault {
	e.mu.Lock()
	defer e.mu.Unlock()
	plan := e.faults[c.Key]
	if c.Attempt <= len(plan) {
		return plan[c.Attempt-1]
	}
	return fakegateway.None
}

func (e *env) plan(key string, faults ...fakegateway.Fault) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.faults[key] = faults
}

func (e *env) account(cents int64) string {
	e.t.Helper()
	id := "acct-" + uuid.NewString()[:8]
	ctx := context.Background()
	require.NoError(e.t, e.svc.OpenAccount(ctx, id))
	if cents > 0 {
		require.NoError(e.t, e.svc.Deposit(ctx, id, cents, "seed-"+id))
	}
	return id
}

func (e *env) balance(account string) int64 {
	b, err := e.svc.Balance(context.Background(), account)
	require.NoError(e.t, err)
	return b
}

func (e *env) count(query string, args ...any) int {
	e.t.Helper()
	var n int
	require.NoError(e.t, e.db.SQL.QueryRow(query, args...).Scan(&n))
	return n
}

// reply is a reply as published.
type reply struct {
	env     steps.Envelope
	payload map[string]any
}

// execute runs a step for cmd under key, in its own transactions, and
// returns the reply it published.
func (e *env) execute(step steps.AnyStep, cmd steps.Message, key string) reply {
	e.t.Helper()
	msg, err := steps.NewMessage(cmd, steps.Envelope{Key: key, ReplyTo: e.replies})
	require.NoError(e.t, err)
	require.NoError(e.t, e.rt.Execute(context.Background(), step, msg))
	return e.reply(key)
}

func (e *env) reply(key string) reply {
	e.t.Helper()
	var id, meta, payload string
	require.NoError(e.t, e.db.SQL.QueryRow(`SELECT uuid, metadata::text, convert_from(payload, 'UTF8') FROM pgsaga_queue
		WHERE topic = $1 AND consumer_group = 'reader' AND metadata->>'idempotency_key' = $2 ORDER BY id DESC LIMIT 1`, e.replies, key).Scan(&id, &meta, &payload))
	m := message.NewMessage(id, nil)
	require.NoError(e.t, json.Unmarshal([]byte(meta), &m.Metadata))
	var r reply
	r.env = steps.EnvelopeOf(m)
	require.NoError(e.t, json.Unmarshal([]byte(payload), &r.payload))
	return r
}

func charge(order uuid.UUID, account string, cents int64) payments.ChargePayment {
	return payments.ChargePayment{OrderID: order, AccountID: account, AmountCents: cents}
}

func TestDepositAndBalance(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ctx := context.Background()
	acct := e.account(0)
	require.NoError(t, e.svc.Deposit(ctx, acct, 500, "d1"))
	require.NoError(t, e.svc.Deposit(ctx, acct, 500, "d1"), "the same deposit twice")
	require.NoError(t, e.svc.Deposit(ctx, acct, 250, "d2"))
	assert.Equal(t, int64(750), e.balance(acct))
	assert.Equal(t, 2, e.count(`SELECT count(*) FROM account_postings WHERE account_id = $1`, acct))
	require.ErrorIs(t, e.svc.Deposit(ctx, acct, 0, "d3"), payments.ErrInvalidAmount)
	require.ErrorIs(t, e.svc.Deposit(ctx, "nobody-"+uuid.NewString()[:6], 10, "d4"), payments.ErrUnknownAccount)
	require.ErrorIs(t, e.svc.OpenAccount(ctx, "bad id!"), payments.ErrInvalidAccountID)
}

func TestChargeThenRefund(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	acct := e.account(1000)
	order := uuid.New()
	key := "saga-" + order.String() + ":charge"

	r := e.execute(e.svc.ChargeStep(), charge(order, acct, 300), key)
	require.Equal(t, steps.OutcomeOK, r.env.Outcome, "%+v", r)
	assert.Equal(t, "payments.PaymentCharged", r.env.Type)
	chargeID := r.payload["charge_id"].(string)
	assert.Equal(t, int64(700), e.balance(acct))
	op, ok, err := e.gw.Operation(context.Background(), key)
	require.NoError(t, err)
	require.True(t, ok, "the gateway got the step's key")
	assert.Equal(t, chargeID, op.ID)
	assert.Equal(t, int64(300), op.AmountCents)

	// The same command again (a re-send): replayed, not charged again.
	again := e.execute(e.svc.ChargeStep(), charge(order, acct, 300), key)
	assert.Equal(t, chargeID, again.payload["charge_id"])
	assert.Equal(t, int64(700), e.balance(acct))

	refundKey := "saga-" + order.String() + ":refund"
	r = e.execute(e.svc.RefundStep(), payments.RefundPayment{OrderID: order, AccountID: acct}, refundKey)
	require.Equal(t, steps.OutcomeOK, r.env.Outcome)
	assert.EqualValues(t, 300, r.payload["amount_cents"])
	assert.Equal(t, int64(1000), e.balance(acct))

	// Never twice: another refund command for the order refunds nothing.
	r = e.execute(e.svc.RefundStep(), payments.RefundPayment{OrderID: order, AccountID: acct}, refundKey+"-again")
	assert.Equal(t, true, r.payload["already"])
	assert.Equal(t, int64(1000), e.balance(acct))

	// A refund of an order never charged is a no-op success.
	r = e.execute(e.svc.RefundStep(), payments.RefundPayment{OrderID: uuid.New(), AccountID: acct}, "refund-nothing-"+acct)
	assert.Equal(t, steps.OutcomeOK, r.env.Outcome)
	assert.EqualValues(t, 0, r.payload["amount_cents"])

	assert.Equal(t, 1, e.count(`SELECT count(*) FROM account_postings WHERE order_id = $1 AND kind = 'charge'`, order))
	assert.Equal(t, 1, e.count(`SELECT count(*) FROM account_postings WHERE order_id = $1 AND kind = 'refund'`, order))
	assert.Equal(t, 1, e.count(`SELECT count(*) FROM fake_gateway_operations WHERE key = $1 AND op = 'refund'`, payments.RefundKey(order)),
		"one refund at the gateway, under the order's refund key")
	assert.Equal(t, 4, e.count(`SELECT count(*) FROM domain_events WHERE stream_id = $1`, payments.Stream(acct)), "deposited, charged, captured, refunded, and nothing more")
}

// chargeReads runs one charge of 300 from an account holding 1000 and
// returns the SELECTs of it that match.
func chargeReads(t *testing.T, match func(sql string) bool) (*env, string, []string) {
	t.Helper()
	var mu sync.Mutex
	var reads []string
	e := newEnvWith(t, envOptions{tracer: testdb.Tracer(func(sql string, _ []any) {
		if strings.HasPrefix(strings.TrimSpace(sql), "SELECT") && match(sql) {
			mu.Lock()
			reads = append(reads, sql)
			mu.Unlock()
		}
	})})
	acct := e.account(1000)
	order := uuid.New()
	mu.Lock()
	reads = nil
	mu.Unlock()
	r := e.execute(e.svc.ChargeStep(), charge(order, acct, 300), "saga-"+order.String()+":charge")
	require.Equal(t, steps.OutcomeOK, r.env.Outcome, "%+v", r)
	mu.Lock()
	got := slices.Clone(reads)
	mu.Unlock()
	assert.Equal(t, int64(700), e.balance(acct))
	return e, acct, got
}

// A charge's ledger work goes in few round trips: each of its two
// transactions sends BEGIN with its first statement, the account's lock
// with the read (or update) after it, and its appends and postings with
// the commit. The count is of the whole step, its delivery included,
// the gateway's own pool apart, in the test's runtime (the reply read
// back included); 24 before the ledger's transactions were pipelined
// (BEGIN, claim, lock, read, append, posting, COMMIT; BEGIN, completion,
// lock, capture, append, COMMIT: 3 each now), 17 before the run after the
// gateway call answered from what the call kept instead of reading the
// record back.
func TestAChargeIsSixteenRoundTrips(t *testing.T) {
	t.Parallel()
	db, trips := testdb.RoundTrips(t, testdb.Shared(t))
	e := newEnvWith(t, envOptions{db: db})
	acct := e.account(1000)
	for i, want := range []int64{-1, 16} { // the first prepares each statement, a round trip of its own
		order := uuid.New()
		trips.Store(0)
		r := e.execute(e.svc.ChargeStep(), charge(order, acct, 300), "saga-"+order.String()+":charge")
		require.Equal(t, steps.OutcomeOK, r.env.Outcome, "%+v", r)
		if i > 0 {
			assert.Equal(t, want, trips.Load(), "round trips of one charge")
		}
	}
	assert.Equal(t, int64(400), e.balance(acct))
}

// The charge's run after its awaited call answers from what the call
// recorded in this process, without reading the gateway key's record
// back; a run whose process did not keep it (another process made the
// call, this one restarted) reads the record, and answers the same, a
// decline included.
func TestTheRunAfterTheCallAnswersFromWhatItKept(t *testing.T) {
	t.Parallel()
	for name, want := range map[string]int{"kept": 0, "not kept": 2} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			answersFromWhatItKept(t, want)
		})
	}
}

func answersFromWhatItKept(t *testing.T, want int) {
	var mu sync.Mutex
	records := 0
	e := newEnvWith(t, envOptions{tracer: testdb.Tracer(func(sql string, _ []any) {
		if strings.HasPrefix(strings.TrimSpace(sql), "SELECT") && strings.Contains(sql, "FROM idempotency_keys") {
			mu.Lock()
			records++
			mu.Unlock()
		}
	})})
	if want > 0 {
		payments.KeepNoAnswers(e.svc)
	}
	acct := e.account(1000)
	charged, declined := uuid.New(), uuid.New()
	e.plan("saga-"+declined.String()+":charge", fakegateway.Decline)
	mu.Lock()
	records = 0
	mu.Unlock()
	r := e.execute(e.svc.ChargeStep(), charge(charged, acct, 300), "saga-"+charged.String()+":charge")
	require.Equal(t, steps.OutcomeOK, r.env.Outcome, "%+v", r)
	assert.NotEmpty(t, r.payload["charge_id"])
	r = e.execute(e.svc.ChargeStep(), charge(declined, acct, 200), "saga-"+declined.String()+":charge")
	require.Equal(t, steps.OutcomeFailed, r.env.Outcome, "%+v", r)
	assert.Equal(t, payments.ReasonDeclined, r.payload["reason"])
	mu.Lock()
	assert.Equal(t, want, records, "the records the runs after their calls read")
	mu.Unlock()
	assert.Equal(t, int64(700), e.balance(acct))
}

// The reservation reads what it decides on (the order's fence, its
// postings, the account's balance) in one statement, after the account's
// lock; the capture reads no posting at all.
func TestAChargeReadsItsLedgerInOneStatement(t *testing.T) {
	t.Parallel()
	_, _, reads := chargeReads(t, func(sql string) bool {
		return strings.Contains(sql, "account_postings") || strings.Contains(sql, "charge_fences")
	})
	assert.Len(t, reads, 1, "the ledger's reads of one charge: %q", reads)
}

// A charge appends to the account's stream after whatever it holds
// (events.AnyVersion): under the account's lock no one else appends, so
// neither of its transactions reads the stream's version first.
func TestAChargeReadsNoStreamVersion(t *testing.T) {
	t.Parallel()
	e, acct, reads := chargeReads(t, func(sql string) bool { return strings.Contains(sql, "domain_events") })
	assert.Empty(t, reads, "reads of the event store by one charge")
	assert.Equal(t, 3, e.count(`SELECT count(*) FROM domain_events WHERE stream_id = $1`, payments.Stream(acct)), "deposited, charged, captured")
	assert.Equal(t, 3, e.count(`SELECT max(version) FROM domain_events WHERE stream_id = $1`, payments.Stream(acct)), "gapless")
}

func TestInsufficientFundsIsABusinessFailure(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	acct := e.account(1000)
	order := uuid.New()
	key := "k-" + order.String()
	for range 2 {
		r := e.execute(e.svc.ChargeStep(), charge(order, acct, 2000), key)
		assert.Equal(t, steps.OutcomeFailed, r.env.Outcome)
		assert.Equal(t, "payments.PaymentFailed", r.env.Type)
		assert.Equal(t, payments.ReasonInsufficientFunds, r.payload["reason"])
	}
	assert.Equal(t, int64(1000), e.balance(acct))
	rec, err := e.store.Get(context.Background(), "payments.charge", key)
	require.NoError(t, err)
	assert.Equal(t, idempotency.StatusFailed, rec.Status)
	_, called, err := e.gw.Operation(context.Background(), key)
	require.NoError(t, err)
	assert.False(t, called, "the gateway was never called")

	r := e.execute(e.svc.ChargeStep(), charge(uuid.New(), "nobody-"+uuid.NewString()[:6], 10), "k-unknown-"+acct)
	assert.Equal(t, payments.ReasonUnknownAccount, r.payload["reason"])
	r = e.execute(e.svc.ChargeStep(), charge(uuid.New(), acct, -5), "k-negative-"+acct)
	assert.Equal(t, payments.ReasonInvalidCharge, r.payload["reason"])
}

// Dozens of concurrent charges on one account whose balance covers only some:
// exactly that many succeed, and the balance never goes below zero. (Each
// execution holds a connection while it waits for the account and needs a
// second one for its gateway lease: the pool is sized for 16 at once.)
func TestConcurrentChargesNeverOverdraw(t *testing.T) {
	t.Parallel()
	e := newEnvWithPool(t, 36)
	acct := e.account(1000)
	const charges, concurrency = 40, 16
	var (
		wg      sync.WaitGroup
		slots   = make(chan struct{}, concurrency)
		results = make([]reply, charges)
	)
	for i := range charges {
		wg.Go(func() {
			slots <- struct{}{}
			defer func() { <-slots }()
			order := uuid.New()
			results[i] = e.execute(e.svc.ChargeStep(), charge(order, acct, 100), "c-"+order.String())
		})
	}
	wg.Wait()
	ok, failed := 0, 0
	for _, r := range results {
		switch r.env.Outcome {
		case steps.OutcomeOK:
			ok++
		case steps.OutcomeFailed:
			assert.Equal(t, payments.ReasonInsufficientFunds, r.payload["reason"])
			failed++
		}
	}
	assert.Equal(t, 10, ok, "exactly the charges the balance covers")
	assert.Equal(t, 30, failed)
	assert.Equal(t, int64(0), e.balance(acct))
	assert.Equal(t, 10, e.count(`SELECT count(*) FROM account_postings WHERE account_id = $1 AND kind = 'charge'`, acct))
	assert.Equal(t, 10, e.count(`SELECT count(*) FROM fake_gateway_operations WHERE account_id = $1 AND op = 'charge' AND outcome = 'succeeded'`, acct))
}

// The same, through three routers consuming one group: batches that race on
// the account wait for each other's postings on the account's row lock.
func TestConcurrentChargesAcrossConsumersNeverOverdraw(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	acct := e.account(1000)
	step := e.svc.ChargeStepOn("charges_" + uuid.NewString()[:6])
	for range 3 {
		r, err := e.tr.NewRouter()
		require.NoError(t, err)
		require.NoError(t, e.rt.Register(r, step))
		done := make(chan error, 1)
		go func() { done <- r.Run(context.Background()) }()
		select {
		case <-r.Running():
		case err := <-done:
			t.Fatalf("router stopped at start: %v", err)
		}
		t.Cleanup(func() { _ = r.Close(); <-done })
	}
	const charges = 45
	tx, err := e.db.SQL.Begin()
	require.NoError(t, err)
	for i := range charges {
		order := uuid.New()
		msg, err := steps.NewMessage(charge(order, acct, 100), steps.Envelope{Key: fmt.Sprintf("par-%s-%d", acct, i), ReplyTo: e.replies})
		require.NoError(t, err)
		require.NoError(t, e.tr.Publisher(tx).Publish(step.Topic(), msg))
	}
	require.NoError(t, tx.Commit())
	deadline := time.Now().Add(60 * time.Second)
	for e.count(`SELECT count(DISTINCT metadata->>'idempotency_key') FROM pgsaga_queue WHERE topic = $1 AND metadata->>'idempotency_key' LIKE $2`, e.replies, "par-"+acct+"-%") < charges {
		require.True(t, time.Now().Before(deadline), "all charges answered")
		time.Sleep(20 * time.Millisecond)
	}
	assert.Equal(t, int64(0), e.balance(acct))
	assert.Equal(t, 10, e.count(`SELECT count(*) FROM account_postings WHERE account_id = $1 AND kind = 'charge'`, acct))
	assert.Equal(t, 10, e.count(`SELECT count(*) FROM fake_gateway_operations WHERE account_id = $1 AND op = 'charge' AND outcome = 'succeeded'`, acct),
		"the gateway charged exactly what the ledger holds: no batch called it on a stale balance")
	assert.Equal(t, 35, e.count(`SELECT count(DISTINCT metadata->>'idempotency_key') FROM pgsaga_queue
		WHERE topic = $1 AND metadata->>'idempotency_key' LIKE $2 AND metadata->>'outcome' = 'failed'`, e.replies, "par-"+acct+"-%"))
}

// The charge's gateway call runs outside its delivery batch: with one
// consumer, a charge queued behind one whose gateway call hangs is answered
// while that call still runs; the hung charge is answered once its call
// returns, charged once.
func TestChargeCallsTheGatewayOutsideItsDeliveryBatch(t *testing.T) {
	t.Parallel()
	started, release := make(chan struct{}), make(chan struct{})
	var once, releaseOnce sync.Once
	slowKey := "slow-" + uuid.NewString()
	e := newEnvWith(t, envOptions{gatewayTimeout: 20 * time.Second, gatewayLease: 30 * time.Second, hook: func(c fakegateway.Call) {
		if c.Key == slowKey {
			once.Do(func() { close(started) })
			<-release
		}
	}})
	t.Cleanup(func() { releaseOnce.Do(func() { close(release) }) }) // before the gateway closes
	acct := e.account(1000)
	step := e.svc.ChargeStepOn("charges_" + uuid.NewString()[:6])
	r, err := e.tr.NewRouter()
	require.NoError(t, err)
	require.NoError(t, e.rt.Register(r, step, transport.WithConsumers(1)))
	require.NoError(t, r.Start(context.Background()))
	t.Cleanup(func() { _ = r.Stop() })

	quickKey, declinedKey := "quick-"+uuid.NewString(), "declined-"+uuid.NewString()
	e.plan(declinedKey, fakegateway.Decline)
	tx, err := e.db.SQL.Begin()
	require.NoError(t, err)
	for _, key := range []string{slowKey, quickKey, declinedKey} { // one batch, the slow one first
		msg, err := steps.NewMessage(charge(uuid.New(), acct, 100), steps.Envelope{Key: key, ReplyTo: e.replies})
		require.NoError(t, err)
		require.NoError(t, e.tr.Publisher(tx).Publish(step.Topic(), msg))
	}
	require.NoError(t, tx.Commit())

	<-started
	answered := func(key string) bool {
		return e.count(`SELECT count(*) FROM pgsaga_queue WHERE topic = $1 AND metadata->>'idempotency_key' = $2`, e.replies, key) > 0
	}
	deadline := time.Now().Add(15 * time.Second)
	for !answered(quickKey) || !answered(declinedKey) {
		require.True(t, time.Now().Before(deadline), "the charges behind the hung call are answered while it hangs")
		time.Sleep(10 * time.Millisecond)
	}
	declined := e.reply(declinedKey)
	assert.Equal(t, steps.OutcomeFailed, declined.env.Outcome)
	assert.Equal(t, payments.ReasonDeclined, declined.payload["reason"])
	assert.False(t, answered(slowKey))
	releaseOnce.Do(func() { close(release) })
	for !answered(slowKey) {
		require.True(t, time.Now().Before(deadline.Add(15*time.Second)), "the hung charge is answered once its call returns")
		time.Sleep(10 * time.Millisecond)
	}
	for _, key := range []string{slowKey, quickKey} {
		r := e.reply(key)
		assert.Equal(t, steps.OutcomeOK, r.env.Outcome, key)
		assert.Equal(t, 1, e.count(`SELECT count(*) FROM fake_gateway_operations WHERE key = $1 AND outcome = 'succeeded' AND id = $2`, key, r.payload["charge_id"]), key)
	}
	assert.Equal(t, int64(800), e.balance(acct))
	assert.Equal(t, 2, e.count(`SELECT count(*) FROM account_postings WHERE account_id = $1 AND kind = 'charge' AND reference IS NOT NULL`, acct))
}

// The refund's gateway call runs outside its delivery batch, as the
// charge's does: with one consumer, a refund queued behind one whose
// gateway call hangs is answered while that call still runs (a slow
// gateway used to hold every refund behind it); the hung refund is
// answered once its call returns, refunded once.
func TestRefundCallsTheGatewayOutsideItsDeliveryBatch(t *testing.T) {
	t.Parallel()
	started, release := make(chan struct{}), make(chan struct{})
	var once, releaseOnce sync.Once
	slowOrder, quickOrder := uuid.New(), uuid.New()
	e := newEnvWith(t, envOptions{gatewayTimeout: 20 * time.Second, gatewayLease: 30 * time.Second, hook: func(c fakegateway.Call) {
		if c.Key == payments.RefundKey(slowOrder) {
			once.Do(func() { close(started) })
			<-release
		}
	}})
	t.Cleanup(func() { releaseOnce.Do(func() { close(release) }) }) // before the gateway closes
	acct := e.account(1000)
	for _, order := range []uuid.UUID{slowOrder, quickOrder} {
		r := e.execute(e.svc.ChargeStep(), charge(order, acct, 100), "charge-"+order.String())
		require.Equal(t, steps.OutcomeOK, r.env.Outcome, "%+v", r)
	}
	step := e.svc.RefundStepOn("refunds_" + uuid.NewString()[:6])
	r, err := e.tr.NewRouter()
	require.NoError(t, err)
	require.NoError(t, e.rt.Register(r, step, transport.WithConsumers(1)))
	require.NoError(t, r.Start(context.Background()))
	t.Cleanup(func() { _ = r.Stop() })

	slowKey, quickKey := "refund-"+slowOrder.String(), "refund-"+quickOrder.String()
	tx, err := e.db.SQL.Begin()
	require.NoError(t, err)
	for key, order := range map[string]uuid.UUID{slowKey: slowOrder, quickKey: quickOrder} {
		msg, err := steps.NewMessage(payments.RefundPayment{OrderID: order, AccountID: acct}, steps.Envelope{Key: key, ReplyTo: e.replies})
		require.NoError(t, err)
		require.NoError(t, e.tr.Publisher(tx).Publish(step.Topic(), msg))
	}
	require.NoError(t, tx.Commit())

	answered := func(key string) bool {
		return e.count(`SELECT count(*) FROM pgsaga_queue WHERE topic = $1 AND metadata->>'idempotency_key' = $2`, e.replies, key) > 0
	}
	<-started
	deadline := time.Now().Add(15 * time.Second)
	for !answered(quickKey) {
		require.True(t, time.Now().Before(deadline), "the refund behind the hung call is answered while it hangs")
		time.Sleep(10 * time.Millisecond)
	}
	assert.False(t, answered(slowKey))
	releaseOnce.Do(func() { close(release) })
	for !answered(slowKey) {
		require.True(t, time.Now().Before(deadline.Add(15*time.Second)), "the hung refund is answered once its call returns")
		time.Sleep(10 * time.Millisecond)
	}
	for key, order := range map[string]uuid.UUID{slowKey: slowOrder, quickKey: quickOrder} {
		r := e.reply(key)
		assert.Equal(t, steps.OutcomeOK, r.env.Outcome, key)
		assert.EqualValues(t, 100, r.payload["amount_cents"], key)
		assert.Nil(t, r.payload["already"], "refunded by this command: %s", key)
		assert.Equal(t, 1, e.count(`SELECT count(*) FROM fake_gateway_operations WHERE key = $1 AND op = 'refund'`, payments.RefundKey(order)), key)
	}
	assert.Equal(t, int64(1000), e.balance(acct))
}

func TestGatewayDecline(t *testing.T) {
	t.Parallel()
	// The decline is planned for the first call: a call that outlived the
	// 300 ms client timeout on a loaded machine (a full -count=3 run) was
	// made again, not declined, and charged.
	e := newEnvWith(t, envOptions{gatewayTimeout: 10 * time.Second, gatewayLease: 20 * time.Second})
	acct := e.account(1000)
	order := uuid.New()
	key := "k-" + order.String()
	e.plan(key, fakegateway.Decline)
	r := e.execute(e.svc.ChargeStep(), charge(order, acct, 100), key)
	assert.Equal(t, steps.OutcomeFailed, r.env.Outcome)
	assert.Equal(t, payments.ReasonDeclined, r.payload["reason"])
	assert.Equal(t, int64(1000), e.balance(acct), "the reserved charge was given back")
	assert.Equal(t, 1, e.count(`SELECT count(*) FROM account_postings WHERE order_id = $1 AND kind = 'charge'`, order))
	assert.Equal(t, 1, e.count(`SELECT count(*) FROM account_postings WHERE order_id = $1 AND kind = 'void'`, order))
	op, _, err := e.gw.Operation(context.Background(), key)
	require.NoError(t, err)
	assert.Equal(t, "declined", op.Outcome)
	assert.Equal(t, 1, op.Calls)

	// A re-sent command replays the decline without calling the gateway.
	r = e.execute(e.svc.ChargeStep(), charge(order, acct, 100), key)
	assert.Equal(t, payments.ReasonDeclined, r.payload["reason"])
	op, _, _ = e.gw.Operation(context.Background(), key)
	assert.Equal(t, 1, op.Calls)

	// Refunding a declined order refunds nothing.
	r = e.execute(e.svc.RefundStep(), payments.RefundPayment{OrderID: order, AccountID: acct}, "refund-"+key)
	assert.EqualValues(t, 0, r.payload["amount_cents"])
	assert.Equal(t, int64(1000), e.balance(acct))
}

// The gateway charged but the answer was lost (a client timeout): the step
// retries with the same key, the gateway answers with its first charge, and
// exactly one charge exists there and in the ledger. The same for a 503 and a
// slow answer.
func TestGatewayFaultsChargeOnce(t *testing.T) {
	t.Parallel()
	for _, plan := range [][]fakegateway.Fault{
		{fakegateway.Lost},
		{fakegateway.Unavailable, fakegateway.Unavailable},
		{fakegateway.Lost, fakegateway.Unavailable, fakegateway.Lost},
		{fakegateway.Slow},
	} {
		t.Run(fmt.Sprint(plan), func(t *testing.T) {
			t.Parallel()
			e := newEnv(t)
			acct := e.account(1000)
			order := uuid.New()
			key := "k-" + order.String()
			e.plan(key, plan...)
			r := e.execute(e.svc.ChargeStep(), charge(order, acct, 100), key)
			require.Equal(t, steps.OutcomeOK, r.env.Outcome, "%+v", r)
			op, _, err := e.gw.Operation(context.Background(), key)
			require.NoError(t, err)
			assert.Equal(t, r.payload["charge_id"], op.ID, "the reply carries the gateway's one charge")
			assert.Equal(t, 1, e.count(`SELECT count(*) FROM fake_gateway_operations WHERE key = $1`, key), "one charge at the gateway")
			assert.Equal(t, len(plan)+boolInt(plan[0] == fakegateway.Slow, -1)+1, op.Calls, "each fault cost one more call with the same key")
			assert.Equal(t, int64(900), e.balance(acct))
			assert.Equal(t, 1, e.count(`SELECT count(*) FROM account_postings WHERE order_id = $1`, order))
		})
	}
}

func boolInt(b bool, v int) int {
	if b {
		return v
	}
	return 0
}

// A worker dies after calling the gateway, before recording anything: its
// lease is left pending. The next execution waits the lease out, takes over,
// calls the gateway again with the same key, and the gateway charges once.
func TestCrashAfterGatewayCallIsTakenOver(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ctx := context.Background()
	acct := e.account(1000)
	order := uuid.New()
	key := "k-" + order.String()

	// The dead worker: lease committed, gateway charged, then nothing.
	acq, err := e.store.AcquireFor(ctx, payments.GatewayRequest("charge", key, acct, order, 100), time.Second)
	require.NoError(t, err)
	require.NotNil(t, acq.Lease)
	client := &payments.GatewayClient{BaseURL: e.gw.URL()}
	firstID, err := client.Charge(ctx, key, acct, order, 100)
	require.NoError(t, err)

	start := time.Now()
	r := e.execute(e.svc.ChargeStep(), charge(order, acct, 100), key)
	require.Equal(t, steps.OutcomeOK, r.env.Outcome)
	assert.Equal(t, firstID, r.payload["charge_id"], "the takeover got the first charge back")
	assert.GreaterOrEqual(t, time.Since(start), 500*time.Millisecond, "it waited for the lease")
	op, _, err := e.gw.Operation(ctx, key)
	require.NoError(t, err)
	assert.Equal(t, 2, op.Calls)
	assert.Equal(t, 1, e.count(`SELECT count(*) FROM fake_gateway_operations WHERE key = $1`, key))
	rec, err := e.store.Get(ctx, "payments.gateway.charge", key)
	require.NoError(t, err)
	assert.Equal(t, idempotency.StatusCompleted, rec.Status)
	assert.Equal(t, 2, rec.Attempts)
	assert.Equal(t, int64(900), e.balance(acct))
}

func TestNewValidatesConfig(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	_, err := payments.New(payments.Config{})
	require.Error(t, err)
	reg := events.NewRegistry()
	es, _ := events.NewStore(events.Config{Registry: reg})
	_, err = payments.New(payments.Config{DB: e.db.SQL, Events: es, Idempotency: e.store, Gateway: &payments.GatewayClient{}})
	require.ErrorContains(t, err, "RegisterEvents")
	require.NoError(t, payments.RegisterEvents(reg))
	_, err = payments.New(payments.Config{DB: e.db.SQL, Events: es, Idempotency: e.store, Gateway: &payments.GatewayClient{}, GatewayLease: time.Second})
	require.ErrorContains(t, err, "must exceed")
}

// A charge whose gateway call never resolved (every attempt got a 503, the
// command was dead-lettered) leaves its money reserved. The saga's
// compensation, a refund, finishes the charge with its own key first, then
// refunds it: the gateway and the ledger agree, and the money is back.
func TestRefundFinishesReservedCharge(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	acct := e.account(1000)
	order := uuid.New()
	key := "k-" + order.String()
	plan := make([]fakegateway.Fault, 6) // the step's six attempts
	for i := range plan {
		plan[i] = fakegateway.Unavailable
	}
	e.plan(key, plan...)
	msg, err := steps.NewMessage(charge(order, acct, 300), steps.Envelope{Key: key, ReplyTo: e.replies})
	require.NoError(t, err)
	err = e.rt.Execute(context.Background(), e.svc.ChargeStep(), msg)
	require.ErrorIs(t, err, transport.ErrDeadLettered)
	assert.Equal(t, int64(700), e.balance(acct), "the charge is reserved")
	assert.Equal(t, 0, e.count(`SELECT count(*) FROM fake_gateway_operations WHERE key = $1`, key), "nothing charged yet")

	r := e.execute(e.svc.RefundStep(), payments.RefundPayment{OrderID: order, AccountID: acct}, "refund-"+key)
	require.Equal(t, steps.OutcomeOK, r.env.Outcome)
	assert.EqualValues(t, 300, r.payload["amount_cents"])
	assert.Equal(t, int64(1000), e.balance(acct))
	assert.Equal(t, 1, e.count(`SELECT count(*) FROM fake_gateway_operations WHERE key = $1 AND op = 'charge' AND outcome = 'succeeded'`, key))
	assert.Equal(t, 1, e.count(`SELECT count(*) FROM fake_gateway_operations WHERE key = $1 AND op = 'refund'`, payments.RefundKey(order)))
	assert.Equal(t, 0, e.count(`SELECT count(*) FROM idempotency_keys WHERE status = 'pending' AND key IN ($1, $2, $3)`, key, "refund-"+key, payments.RefundKey(order)))
}

// A refund that finds no charge fences the order: a charge that arrives
// afterwards (a retry or a re-sent command still queued when the saga gave up
// on it) is refused and moves no money.
func TestRefundFencesLateCharges(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	acct := e.account(1000)
	order := uuid.New()
	r := e.execute(e.svc.RefundStep(), payments.RefundPayment{OrderID: order, AccountID: acct}, "refund-first-"+order.String())
	require.Equal(t, steps.OutcomeOK, r.env.Outcome)
	assert.EqualValues(t, 0, r.payload["amount_cents"])

	key := "late-charge-" + order.String()
	r = e.execute(e.svc.ChargeStep(), charge(order, acct, 300), key)
	assert.Equal(t, steps.OutcomeFailed, r.env.Outcome)
	assert.Equal(t, payments.ReasonAbandoned, r.payload["reason"])
	assert.Equal(t, int64(1000), e.balance(acct))
	assert.Zero(t, e.count(`SELECT count(*) FROM account_postings WHERE order_id = $1`, order))
	_, called, err := e.gw.Operation(context.Background(), key)
	require.NoError(t, err)
	assert.False(t, called, "the gateway was never called")
}

// Several refund commands for one order (an operator retry gets a new
// command key): the gateway refunds once, keyed by the order.
func TestRefundOncePerOrderWhateverTheCommandKey(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	acct := e.account(1000)
	order := uuid.New()
	require.Equal(t, steps.OutcomeOK, e.execute(e.svc.ChargeStep(), charge(order, acct, 400), "c-"+order.String()).env.Outcome)
	for i := range 3 {
		r := e.execute(e.svc.RefundStep(), payments.RefundPayment{OrderID: order, AccountID: acct}, fmt.Sprintf("refund-%d-%s", i, order))
		require.Equal(t, steps.OutcomeOK, r.env.Outcome)
		assert.EqualValues(t, 400, r.payload["amount_cents"])
	}
	assert.Equal(t, int64(1000), e.balance(acct))
	assert.Equal(t, 1, e.count(`SELECT count(*) FROM fake_gateway_operations WHERE account_id = $1 AND op = 'refund'`, acct))
	assert.Equal(t, 1, e.count(`SELECT count(*) FROM account_postings WHERE order_id = $1 AND kind = 'refund'`, order))
}

// A refund the gateway declines is a final business failure for the
// command that asked: recorded (no claim left pending), answered with
// RefundFailed, and answered so again should the command run again (its
// stored reply lost), without asking the gateway. Another command for the
// order, as an operator's retry sends under a fresh key, asks the gateway
// again under the order's next refund key, each key used once: declined
// again, then refunded, once; later commands find it refunded.
func TestDeclinedRefund(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	acct := e.account(1000)
	order := uuid.New()
	require.Equal(t, steps.OutcomeOK, e.execute(e.svc.ChargeStep(), charge(order, acct, 300), "c-"+order.String()).env.Outcome)
	e.plan(payments.RefundAttemptKey(order, 1), fakegateway.Decline)
	e.plan(payments.RefundAttemptKey(order, 2), fakegateway.Decline)
	first := "r-" + order.String()
	r := e.execute(e.svc.RefundStep(), payments.RefundPayment{OrderID: order, AccountID: acct}, first)
	assert.Equal(t, steps.OutcomeFailed, r.env.Outcome)
	assert.Equal(t, "payments.RefundFailed", r.env.Type)
	assert.Equal(t, payments.ReasonRefundDeclined, r.payload["reason"])
	assert.Equal(t, int64(700), e.balance(acct), "the money stays charged")
	assert.Zero(t, e.count(`SELECT count(*) FROM idempotency_keys WHERE status = 'pending' AND key = $1`, payments.RefundKey(order)))

	// The same command again, its stored reply gone: declined from the
	// record; the gateway is not asked.
	_, err := e.db.SQL.Exec(`DELETE FROM idempotency_keys WHERE scope = 'payments.refund' AND key = $1`, first)
	require.NoError(t, err)
	again := e.execute(e.svc.RefundStep(), payments.RefundPayment{OrderID: order, AccountID: acct}, first)
	assert.Equal(t, steps.OutcomeFailed, again.env.Outcome, "the command that was declined stays declined")
	calls := `SELECT count(*) FROM fake_gateway_calls WHERE key LIKE 'refund:' || $1 || '%'`
	assert.Equal(t, 1, e.count(calls, order.String()), "the gateway was asked once")

	retry := e.execute(e.svc.RefundStep(), payments.RefundPayment{OrderID: order, AccountID: acct}, first+"#1")
	assert.Equal(t, steps.OutcomeFailed, retry.env.Outcome, "a retry the gateway declines again fails again")
	assert.Equal(t, 2, e.count(calls, order.String()))
	retry = e.execute(e.svc.RefundStep(), payments.RefundPayment{OrderID: order, AccountID: acct}, first+"#2")
	require.Equal(t, steps.OutcomeOK, retry.env.Outcome, "a retry the gateway accepts refunds")
	assert.EqualValues(t, 300, retry.payload["amount_cents"])
	assert.Equal(t, 1, e.count(`SELECT count(*) FROM fake_gateway_calls WHERE key = $1`, payments.RefundAttemptKey(order, 3)))

	later := e.execute(e.svc.RefundStep(), payments.RefundPayment{OrderID: order, AccountID: acct}, first+"#3")
	require.Equal(t, steps.OutcomeOK, later.env.Outcome)
	assert.Equal(t, true, later.payload["already"])
	assert.Equal(t, 3, e.count(calls, order.String()), "a refunded order is not sent to the gateway again")
	assert.Equal(t, int64(1000), e.balance(acct), "refunded once")
	assert.Equal(t, 1, e.count(`SELECT count(*) FROM fake_gateway_operations WHERE account_id = $1 AND op = 'refund' AND outcome = 'succeeded'`, acct))
	assert.Equal(t, 1, e.count(`SELECT count(*) FROM account_postings WHERE order_id = $1 AND kind = 'refund'`, order))
}
