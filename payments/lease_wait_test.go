package payments_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/idempotency"
	"github.com/pgsaga/pgsaga/internal/transport"
	"github.com/pgsaga/pgsaga/payments"
	"github.com/pgsaga/pgsaga/payments/fakegateway"
	"github.com/pgsaga/pgsaga/steps"
)

// deadWorkerLease is how long the gateway lease of the worker these tests
// kill runs: long enough that a loaded machine answers the command queued
// behind it well within it.
const deadWorkerLease = 6 * time.Second

// A worker killed in the middle of a gateway call leaves its lease behind.
// The command that comes back for that key waits the lease out outside its
// delivery batch: with one consumer, the charge queued behind it is answered
// while the lease still holds (attempts 1: not taken over yet). The batch
// used to wait the whole lease inline, holding every command behind it: the
// stall of about 9 s after every restart of the sample. Then the waiting
// charge takes the key over and gets the dead worker's charge back, charged
// once.
func TestALeftLeaseIsWaitedOutOutsideTheChargesBatch(t *testing.T) {
	t.Parallel()
	e := newEnvWith(t, envOptions{gatewayLease: deadWorkerLease})
	ctx := context.Background()
	acct := e.account(1000)
	leased, quick := uuid.New(), uuid.New()
	leasedKey, quickKey := "leased-"+leased.String(), "quick-"+quick.String()

	// The dead worker: lease committed, gateway charged, then nothing.
	req := payments.GatewayRequest("charge", leasedKey, acct, leased, 100)
	acq, err := e.store.AcquireFor(ctx, req, deadWorkerLease)
	require.NoError(t, err)
	require.NotNil(t, acq.Lease)
	firstID, err := (&payments.GatewayClient{BaseURL: e.gw.URL()}).Charge(ctx, leasedKey, acct, leased, 100)
	require.NoError(t, err)

	step := e.svc.ChargeStepOn("charges_" + uuid.NewString()[:6])
	e.serveOneConsumer(step)
	e.publishInOneBatch(step.Topic(), map[string]steps.Message{leasedKey: charge(leased, acct, 100)}, map[string]steps.Message{quickKey: charge(quick, acct, 100)})

	e.waitAnswered(quickKey, "the charge queued behind the left lease")
	assert.Equal(t, 1, e.leaseAttempts(req), "the quick charge was answered while the left lease held")
	e.waitAnswered(leasedKey, "the charge whose lease was left, once the lease ran out")
	r := e.reply(leasedKey)
	require.Equal(t, steps.OutcomeOK, r.env.Outcome, "%+v", r)
	assert.Equal(t, firstID, r.payload["charge_id"], "the takeover got the dead worker's charge back")
	assert.Equal(t, 2, e.leaseAttempts(req), "taken over once")
	assert.Equal(t, 1, e.count(`SELECT count(*) FROM fake_gateway_operations WHERE key = $1`, leasedKey))
	assert.Equal(t, int64(800), e.balance(acct))
}

// The same for a refund whose gateway call was left by a killed worker.
func TestALeftLeaseIsWaitedOutOutsideTheRefundsBatch(t *testing.T) {
	t.Parallel()
	e := newEnvWith(t, envOptions{gatewayLease: deadWorkerLease})
	ctx := context.Background()
	acct := e.account(1000)
	leased, quick := uuid.New(), uuid.New()
	var leasedCharge string
	for _, order := range []uuid.UUID{leased, quick} {
		r := e.execute(e.svc.ChargeStep(), charge(order, acct, 100), "charge-"+order.String())
		require.Equal(t, steps.OutcomeOK, r.env.Outcome, "%+v", r)
		if order == leased {
			leasedCharge = r.payload["charge_id"].(string)
		}
	}
	// The dead worker: the refund's lease committed, the gateway asked, then
	// nothing.
	req := payments.GatewayRequest("refund", payments.RefundKey(leased), acct, leased, 100)
	acq, err := e.store.AcquireFor(ctx, req, deadWorkerLease)
	require.NoError(t, err)
	require.NotNil(t, acq.Lease)
	firstID, err := (&payments.GatewayClient{BaseURL: e.gw.URL()}).Refund(ctx, payments.RefundKey(leased), acct, leasedCharge, 100)
	require.NoError(t, err)

	step := e.svc.RefundStepOn("refunds_" + uuid.NewString()[:6])
	e.serveOneConsumer(step)
	leasedKey, quickKey := "refund-"+leased.String(), "refund-"+quick.String()
	e.publishInOneBatch(step.Topic(), map[string]steps.Message{leasedKey: payments.RefundPayment{OrderID: leased, AccountID: acct}},
		map[string]steps.Message{quickKey: payments.RefundPayment{OrderID: quick, AccountID: acct}})

	e.waitAnswered(quickKey, "the refund queued behind the left lease")
	assert.Equal(t, 1, e.leaseAttempts(req), "the quick refund was answered while the left lease held")
	e.waitAnswered(leasedKey, "the refund whose lease was left, once the lease ran out")
	r := e.reply(leasedKey)
	require.Equal(t, steps.OutcomeOK, r.env.Outcome, "%+v", r)
	assert.Equal(t, firstID, r.payload["refund_id"], "the takeover got the dead worker's refund back")
	assert.Equal(t, 2, e.leaseAttempts(req), "taken over once")
	assert.Equal(t, 1, e.count(`SELECT count(*) FROM fake_gateway_operations WHERE key = $1 AND op = 'refund'`, payments.RefundKey(leased)))
	assert.Equal(t, int64(1000), e.balance(acct))
}

// serveOneConsumer runs step with one consumer until the test ends: one
// batch at a time, in order.
func (e *env) serveOneConsumer(step steps.AnyStep) {
	e.t.Helper()
	r, err := e.tr.NewRouter()
	require.NoError(e.t, err)
	require.NoError(e.t, e.rt.Register(r, step, transport.WithConsumers(1)))
	require.NoError(e.t, r.Start(context.Background()))
	e.t.Cleanup(func() { _ = r.Stop() })
}

// publishInOneBatch publishes the commands of each map, by key, in one
// transaction, the first map's first.
func (e *env) publishInOneBatch(topic string, cmds ...map[string]steps.Message) {
	e.t.Helper()
	tx, err := e.db.SQL.Begin()
	require.NoError(e.t, err)
	for _, m := range cmds {
		for key, cmd := range m {
			msg, err := steps.NewMessage(cmd, steps.Envelope{Key: key, ReplyTo: e.replies})
			require.NoError(e.t, err)
			require.NoError(e.t, e.tr.Publisher(tx).Publish(topic, msg))
		}
	}
	require.NoError(e.t, tx.Commit())
}

// waitAnswered waits for the reply to the command of key, for as long as
// the test may run.
func (e *env) waitAnswered(key, what string) {
	e.t.Helper()
	for e.count(`SELECT count(*) FROM pgsaga_queue WHERE topic = $1 AND metadata->>'idempotency_key' = $2`, e.replies, key) == 0 {
		if d, ok := e.t.Deadline(); ok && time.Until(d) < 5*time.Second {
			e.t.Fatalf("no answer to %s (%s)", what, key)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// leaseAttempts is how many times the gateway call of req was leased.
func (e *env) leaseAttempts(req idempotency.Request) int {
	e.t.Helper()
	rec, err := e.store.Get(context.Background(), req.Scope, req.Key)
	require.NoError(e.t, err)
	return rec.Attempts
}

// A duplicate of a charge whose gateway call is still under way (its worker
// alive) waits for that call, not for the end of its lease: once the call
// returns, the duplicate is done at the next look, while the lease would
// still hold. It used to sleep out the whole lease (30 s here), and a
// stopping worker waited for it: 10 s added to the sample's every resume
// after a kill.
func TestADuplicateTakesALiveCallsAnswerBeforeItsLeaseRunsOut(t *testing.T) {
	t.Parallel()
	const lease = 30 * time.Second
	started, release := make(chan struct{}), make(chan struct{})
	var once, releaseOnce sync.Once
	order := uuid.New()
	key := "charge-" + order.String()
	e := newEnvWith(t, envOptions{gatewayTimeout: 20 * time.Second, gatewayLease: lease, hook: func(c fakegateway.Call) {
		if c.Key == key {
			once.Do(func() { close(started) })
			<-release
		}
	}})
	t.Cleanup(func() { releaseOnce.Do(func() { close(release) }) }) // before the gateway closes
	acct := e.account(1000)
	step := e.svc.ChargeStepOn("charges_" + uuid.NewString()[:6])
	e.serveOneConsumer(step)
	// The same command twice, as a redelivery brings it: one batch.
	e.publishInOneBatch(step.Topic(), map[string]steps.Message{key: charge(order, acct, 100)}, map[string]steps.Message{key: charge(order, acct, 100)})

	<-started
	req := payments.GatewayRequest("charge", key, acct, order, 100)
	waiting := func() int {
		return e.count(`SELECT count(*) FROM pgsaga_queue WHERE topic = $1 AND metadata ? '_pgsaga_awaited'`, step.Topic())
	}
	for waiting() < 2 { // the call's command, and the duplicate waiting for its lease
		if d, ok := t.Deadline(); ok && time.Until(d) < 5*time.Second {
			t.Fatal("both commands are not handed back while the call runs")
		}
		time.Sleep(10 * time.Millisecond)
	}
	rec, err := e.store.Get(context.Background(), req.Scope, req.Key)
	require.NoError(t, err)
	releaseOnce.Do(func() { close(release) })
	for e.count(`SELECT count(*) FROM pgsaga_queue WHERE topic = $1`, step.Topic()) > 0 {
		if d, ok := t.Deadline(); ok && time.Until(d) < 5*time.Second {
			t.Fatal("the commands are not done")
		}
		time.Sleep(10 * time.Millisecond)
	}
	assert.Equal(t, 1, e.count(`SELECT count(*) FROM idempotency_keys WHERE scope = $1 AND key = $2 AND $3 > clock_timestamp()`, req.Scope, req.Key, rec.LockedUntil),
		"both are done while the call's lease would still hold")
	r := e.reply(key)
	require.Equal(t, steps.OutcomeOK, r.env.Outcome, "%+v", r)
	assert.Equal(t, 1, e.count(`SELECT count(*) FROM fake_gateway_operations WHERE key = $1`, key))
	assert.Equal(t, int64(900), e.balance(acct))
}
