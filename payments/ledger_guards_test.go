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
	"github.com/pgsaga/pgsaga/internal/testdb"
	"github.com/pgsaga/pgsaga/internal/transport"
	"github.com/pgsaga/pgsaga/payments"
	"github.com/pgsaga/pgsaga/payments/fakegateway"
	"github.com/pgsaga/pgsaga/steps"
)

// reap makes key's retention pass: it ages the key's finished idempotency
// records (the step's and the gateway call's) past the reaper's TTL and runs
// the real reaper, which deletes them as it would a week later. Other
// tests' keys are recent, so the reaper leaves them alone.
func (e *env) reap(key string) {
	e.t.Helper()
	const ttl = 7 * 24 * time.Hour
	_, err := e.db.SQL.Exec(`UPDATE idempotency_keys SET completed_at = completed_at - make_interval(secs => $2)
		WHERE key = $1 AND status <> 'pending'`, key, (ttl + time.Hour).Seconds())
	require.NoError(e.t, err)
	r, err := idempotency.NewReaper(idempotency.ReaperConfig{DB: e.db.SQL, TTL: ttl, Logger: logger()})
	require.NoError(e.t, err)
	_, _, err = r.RunOnce(context.Background())
	require.NoError(e.t, err)
	require.Zero(e.t, e.count(`SELECT count(*) FROM idempotency_keys WHERE key = $1`, key), "the reaper removed the key")
}

func (e *env) events(account, eventType string) int {
	e.t.Helper()
	return e.count(`SELECT count(*) FROM domain_events WHERE stream_id = $1 AND event_type LIKE $2`, payments.Stream(account), eventType)
}

func (e *env) chargeReference(order uuid.UUID) string {
	e.t.Helper()
	var ref string
	require.NoError(e.t, e.db.SQL.QueryRow(`SELECT coalesce(reference, '') FROM account_postings WHERE order_id = $1 AND kind = 'charge'`, order).Scan(&ref))
	return ref
}

// A charge command redelivered after the idempotency reaper removed its key,
// to a gateway that has forgotten the key too: the captured charge is final.
// The ledger answers with it, and nobody calls the gateway (which would
// charge again and orphan the first charge) or records another capture.
func TestLateDuplicateOfCapturedChargeAnswersFromTheLedger(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ctx := context.Background()
	acct := e.account(1000)
	order := uuid.New()
	key := "late-" + order.String()

	first := e.execute(e.svc.ChargeStep(), charge(order, acct, 300), key)
	require.Equal(t, steps.OutcomeOK, first.env.Outcome, "%+v", first)
	chargeID := first.payload["charge_id"].(string)
	eventsBefore := e.events(acct, "%")

	e.reap(key)
	forgotten, err := e.gw.ForgetKeys(ctx, key)
	require.NoError(t, err)
	require.Equal(t, 1, forgotten)

	again := e.execute(e.svc.ChargeStep(), charge(order, acct, 300), key)
	assert.Equal(t, steps.OutcomeOK, again.env.Outcome)
	assert.Equal(t, first.env.Type, again.env.Type)
	assert.Equal(t, first.payload, again.payload, "the same reply")

	assert.Equal(t, 1, e.count(`SELECT count(*) FROM fake_gateway_calls WHERE key = $1`, key), "one gateway call in all")
	assert.Equal(t, 1, e.count(`SELECT count(*) FROM fake_gateway_operations WHERE order_id = $1 AND op = 'charge' AND outcome = 'succeeded'`, order.String()),
		"one charge of the order at the gateway")
	assert.Equal(t, 1, e.events(acct, "payments.charge_captured"), "no second capture")
	assert.Equal(t, eventsBefore, e.events(acct, "%"), "no event at all")
	assert.Equal(t, chargeID, e.chargeReference(order), "the ledger's reference is unchanged")
	assert.Equal(t, int64(700), e.balance(acct))
	assert.Zero(t, e.count(`SELECT count(*) FROM idempotency_keys WHERE key = $1 AND status = 'pending'`, key), "no claim left pending")
}

// The same for a charge the gateway declined and the ledger voided: a late
// duplicate (its key reaped, the gateway's forgotten) is declined from the
// ledger, and so is a charge of the order under another key; the gateway,
// which would now charge, is never called again.
func TestLateDuplicateOfDeclinedChargeIsDeclinedFromTheLedger(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ctx := context.Background()
	acct := e.account(1000)
	order := uuid.New()
	key := "late-declined-" + order.String()
	e.plan(key, fakegateway.Decline)

	first := e.execute(e.svc.ChargeStep(), charge(order, acct, 300), key)
	require.Equal(t, steps.OutcomeFailed, first.env.Outcome, "%+v", first)
	require.Equal(t, payments.ReasonDeclined, first.payload["reason"])
	eventsBefore := e.events(acct, "%")

	e.reap(key)
	_, err := e.gw.ForgetKeys(ctx, key)
	require.NoError(t, err)

	again := e.execute(e.svc.ChargeStep(), charge(order, acct, 300), key)
	assert.Equal(t, steps.OutcomeFailed, again.env.Outcome)
	assert.Equal(t, first.payload, again.payload, "the same refusal")

	other := "other-" + order.String()
	r := e.execute(e.svc.ChargeStep(), charge(order, acct, 300), other)
	assert.Equal(t, steps.OutcomeFailed, r.env.Outcome)
	assert.Equal(t, payments.ReasonDeclined, r.payload["reason"], "another command for the declined order is declined too")

	assert.Equal(t, 1, e.count(`SELECT count(*) FROM fake_gateway_calls WHERE key IN ($1, $2)`, key, other), "one gateway call in all")
	assert.Zero(t, e.count(`SELECT count(*) FROM fake_gateway_operations WHERE order_id = $1 AND outcome = 'succeeded'`, order.String()),
		"nothing charged at the gateway")
	assert.Equal(t, eventsBefore, e.events(acct, "%"), "no event")
	assert.Empty(t, e.chargeReference(order), "the voided charge was never captured")
	assert.Equal(t, int64(1000), e.balance(acct))
}

// A capture that finds the order's charge already captured never
// overwrites the reference (captureSQL's guard): the ledger keeps the charge
// it recorded first and the capture fails loudly. The reserve phase never
// starts such a capture, so the test stages one: a lease under another key
// for the captured order, whose gateway call charges a second time.
func TestCaptureNeverOverwritesTheChargeReference(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ctx := context.Background()
	acct := e.account(1000)
	order := uuid.New()
	r := e.execute(e.svc.ChargeStep(), charge(order, acct, 300), "c-"+order.String())
	require.Equal(t, steps.OutcomeOK, r.env.Outcome)
	chargeID := r.payload["charge_id"].(string)

	rogue := "rogue-" + order.String()
	acq, err := e.store.AcquireFor(ctx, payments.GatewayRequest("charge", rogue, acct, order, 300), time.Second)
	require.NoError(t, err)
	require.NotNil(t, acq.Lease)
	id, err := e.svc.CaptureUnder(ctx, acq.Lease, charge(order, acct, 300))
	require.Error(t, err, "a second capture of the order must fail, got %q", id)
	assert.ErrorContains(t, err, chargeID, "the error names the charge the ledger holds")

	assert.Equal(t, chargeID, e.chargeReference(order), "the first reference stays")
	assert.Equal(t, 1, e.events(acct, "payments.charge_captured"), "no second capture event")
	rec, err := e.store.Get(ctx, "payments.gateway.charge", rogue)
	require.NoError(t, err)
	assert.Equal(t, idempotency.StatusPending, rec.Status, "the claim is not completed with the orphaned charge")
	assert.False(t, rec.LockedUntil.After(time.Now()), "its lease was released, so a retry answers from the ledger at once")
	assert.False(t, payments.Kept(e.svc, rogue), "no answer kept for a capture that did not commit")
}

// The unique index account_postings_one_charge_idx is the only guard
// against one order charged to two accounts: the account row lock and the
// ledger lookup of a reserve are per account, so two commands charging one
// order to two accounts (different keys, started together) both pass them.
// The index lets one posting in; the other command is refused as a business
// failure, and the gateway charges once. (On one account the row lock
// already serialises the two, and the second finds the first's posting.)
func TestOneChargePostingPerOrderAcrossAccounts(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ctx := context.Background()
	accounts := []string{e.account(1000), e.account(1000)}
	order := uuid.New()
	keys := []string{"twice-0-" + order.String(), "twice-1-" + order.String()}

	start := make(chan struct{})
	errs := make([]error, len(accounts))
	var wg sync.WaitGroup
	for i := range accounts {
		msg, err := steps.NewMessage(charge(order, accounts[i], 300), steps.Envelope{Key: keys[i], ReplyTo: e.replies})
		require.NoError(t, err)
		wg.Go(func() {
			<-start
			errs[i] = e.rt.Execute(ctx, e.svc.ChargeStep(), msg)
		})
	}
	close(start)
	wg.Wait()
	for i, err := range errs {
		require.NoError(t, err, "command %d", i)
	}

	outcomes := map[string]int{}
	for i, key := range keys {
		r := e.reply(key)
		outcomes[r.env.Outcome]++
		if r.env.Outcome == steps.OutcomeFailed {
			assert.Equal(t, payments.ReasonChargedElsewhere, r.payload["reason"])
			assert.Equal(t, int64(1000), e.balance(accounts[i]), "the refused account keeps its money")
		}
	}
	assert.Equal(t, map[string]int{steps.OutcomeOK: 1, steps.OutcomeFailed: 1}, outcomes)
	assert.Equal(t, 1, e.count(`SELECT count(*) FROM account_postings WHERE order_id = $1 AND kind = 'charge'`, order), "one charge posting")
	assert.Equal(t, 1, e.count(`SELECT count(*) FROM fake_gateway_operations WHERE order_id = $1 AND op = 'charge' AND outcome = 'succeeded'`, order.String()),
		"one charge at the gateway")
	assert.Equal(t, int64(1700), e.balance(accounts[0])+e.balance(accounts[1]))
}

// The account row lock (lockAccount's UPDATE) makes the writers of one
// account queue, and it is what keeps a charge from being decided on a
// balance that changed meanwhile: the ledger appends to the account's
// stream at events.AnyVersion, after whatever is there, with no version
// read of its own to check against. Without the lock, two charges racing
// for one balance both read it, and then either both append (the second
// after the first's commit: an overdraft) or the second loses the
// stream's unique version to the first's uncommitted append and fails with
// a version conflict, an error the step can only retry (and a capture that
// loses it after the gateway charged must wait out its lease). So with
// retries off, two charges racing for one balance must end as one charge
// and one business refusal, never as an error.
//
// The race is forced: the test holds a SHARE lock on domain_events, which
// every charge's reserve needs (to append its Charged event) after it has
// read the balance, and releases it once both charges wait on a lock. With
// the row lock the second waits on the account's row, then reads the first
// one's posting; without it both read the same balance and one loses.
func TestRacingChargesOfOneAccountWaitForTheAccount(t *testing.T) {
	t.Parallel()
	// A database of its own: the barrier locks a whole table.
	db := testdb.Fresh(t)
	e := newEnvWith(t, envOptions{db: db, retry: &transport.RetryPolicy{MaxAttempts: 1}})
	ctx := context.Background()
	acct := e.account(100)
	orders := []uuid.UUID{uuid.New(), uuid.New()}

	barrier, err := db.SQL.BeginTx(ctx, nil)
	require.NoError(t, err)
	defer barrier.Rollback() //nolint:errcheck // no-op after Commit
	_, err = barrier.ExecContext(ctx, `LOCK TABLE domain_events IN SHARE MODE`)
	require.NoError(t, err)

	start := make(chan struct{})
	errs := make([]error, len(orders))
	var wg sync.WaitGroup
	for i, order := range orders {
		msg, err := steps.NewMessage(charge(order, acct, 100), steps.Envelope{Key: "race-" + order.String(), ReplyTo: e.replies})
		require.NoError(t, err)
		wg.Go(func() {
			<-start
			errs[i] = e.rt.Execute(ctx, e.svc.ChargeStep(), msg)
		})
	}
	close(start)
	// Both charges are in their reserve transaction and blocked: the first
	// on the barrier, the second on the barrier too (no row lock) or on the
	// first one's account row. Nothing else runs in this database.
	deadline := time.Now().Add(30 * time.Second)
	for e.count(`SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'`) < len(orders) {
		require.True(t, time.Now().Before(deadline), "both charges reached the barrier")
		time.Sleep(5 * time.Millisecond)
	}
	require.NoError(t, barrier.Commit())
	wg.Wait()

	for i, err := range errs {
		assert.NoError(t, err, "charge %d failed with a non-business error instead of waiting for the account", i)
	}
	if t.Failed() {
		return
	}
	outcomes := map[string]int{}
	for _, order := range orders {
		r := e.reply("race-" + order.String())
		outcomes[r.env.Outcome]++
		if r.env.Outcome == steps.OutcomeFailed {
			assert.Equal(t, payments.ReasonInsufficientFunds, r.payload["reason"])
		}
	}
	assert.Equal(t, map[string]int{steps.OutcomeOK: 1, steps.OutcomeFailed: 1}, outcomes, "%v", errs)
	assert.Equal(t, int64(0), e.balance(acct))
	assert.Equal(t, 1, e.count(`SELECT count(*) FROM account_postings WHERE account_id = $1 AND kind = 'charge'`, acct))
	assert.Equal(t, 1, e.count(`SELECT count(*) FROM fake_gateway_operations WHERE account_id = $1 AND outcome = 'succeeded'`, acct))
}

// The account's lock is queued with the reservation's read, two
// statements with a snapshot each: the read must find the account locked
// by its own transaction, not merely existing. An account opened and
// funded between the two (the lock matched no row, so it holds nothing)
// is refused as unknown, as the lock found it; reading it as funded would
// reserve without the lock, and two such charges overdraw it.
//
// The window is forced: a statement trigger on accounts waits on an
// advisory lock the test holds whenever an update matched no row; the
// account is opened and funded meanwhile.
func TestAChargeReservesOnlyUnderTheAccountsLock(t *testing.T) {
	t.Parallel()
	db := testdb.Fresh(t) // its own database: the trigger is the test's
	_, err := db.SQL.Exec(`CREATE FUNCTION test_hold_unlocked() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NOT EXISTS (SELECT FROM changed) THEN
        PERFORM pg_advisory_xact_lock(4242);
    END IF;
    RETURN NULL;
END $$;
CREATE TRIGGER test_hold_unlocked AFTER UPDATE ON accounts REFERENCING NEW TABLE AS changed
    FOR EACH STATEMENT EXECUTE FUNCTION test_hold_unlocked();`)
	require.NoError(t, err)
	e := newEnvWith(t, envOptions{db: db, retry: &transport.RetryPolicy{MaxAttempts: 1}})
	ctx := context.Background()

	hold, err := db.SQL.BeginTx(ctx, nil)
	require.NoError(t, err)
	defer hold.Rollback() //nolint:errcheck // no-op after Commit
	_, err = hold.ExecContext(ctx, `SELECT pg_advisory_xact_lock(4242)`)
	require.NoError(t, err)

	acct := "acct-" + uuid.NewString()[:8]
	order := uuid.New()
	key := "late-" + order.String()
	msg, err := steps.NewMessage(charge(order, acct, 100), steps.Envelope{Key: key, ReplyTo: e.replies})
	require.NoError(t, err)
	done := make(chan error, 1)
	go func() { done <- e.rt.Execute(ctx, e.svc.ChargeStep(), msg) }()
	db.WaitForLockWait(t) // the charge's lock matched no row, and waits
	require.NoError(t, e.svc.OpenAccount(ctx, acct))
	require.NoError(t, e.svc.Deposit(ctx, acct, 1000, "seed-"+acct))
	require.NoError(t, hold.Commit())
	require.NoError(t, <-done)

	r := e.reply(key)
	require.Equal(t, steps.OutcomeFailed, r.env.Outcome, "%+v", r)
	assert.Equal(t, payments.ReasonUnknownAccount, r.payload["reason"])
	assert.Equal(t, int64(1000), e.balance(acct), "nothing reserved")
}

// The capture appends to the account's stream at events.AnyVersion too,
// under the account's lock, as does the void of a declined charge: a
// reservation of another order of the account that comes meanwhile waits
// for it, and both append in turn. Without that lock the two appends take
// the same version and one of them fails. The race is forced as in
// TestRacingChargesOfOneAccountWaitForTheAccount: the first charge's
// gateway call is held until the test holds a SHARE lock on
// domain_events, so that its record waits there for the append, and the
// second charge is started then; the barrier is released once both wait.
func TestARecordAndAReservationOfOneAccountTakeTurns(t *testing.T) {
	t.Parallel()
	for name, fault := range map[string]fakegateway.Fault{"captured": fakegateway.None, "declined": fakegateway.Decline} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			recordAndReservationTakeTurns(t, fault)
		})
	}
}

func recordAndReservationTakeTurns(t *testing.T, fault fakegateway.Fault) {
	db := testdb.Fresh(t) // its own database: the barrier locks a whole table
	reached, release := make(chan struct{}), make(chan struct{})
	first := uuid.New()
	firstKey := "record-" + first.String()
	e := newEnvWith(t, envOptions{db: db, retry: &transport.RetryPolicy{MaxAttempts: 1}, gatewayTimeout: 20 * time.Second, gatewayLease: 30 * time.Second,
		hook: func(c fakegateway.Call) {
			if c.Op == "charge" && c.Key == firstKey {
				close(reached)
				<-release
			}
		}})
	e.plan(firstKey, fault)
	ctx := context.Background()
	acct := e.account(1000)
	second := uuid.New()
	secondKey := "reserve-" + second.String()

	errs := make(chan error, 2)
	run := func(order uuid.UUID, key string) {
		msg, err := steps.NewMessage(charge(order, acct, 100), steps.Envelope{Key: key, ReplyTo: e.replies})
		if err != nil {
			errs <- err
			return
		}
		errs <- e.rt.Execute(ctx, e.svc.ChargeStep(), msg)
	}
	waiting := func(n int, what string) {
		deadline := time.Now().Add(30 * time.Second)
		for e.count(`SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'`) < n {
			require.True(t, time.Now().Before(deadline), what)
			time.Sleep(5 * time.Millisecond)
		}
	}
	go run(first, firstKey)
	<-reached // reserved; its gateway call is held
	barrier, err := db.SQL.BeginTx(ctx, nil)
	require.NoError(t, err)
	defer barrier.Rollback() //nolint:errcheck // no-op after Commit
	_, err = barrier.ExecContext(ctx, `LOCK TABLE domain_events IN SHARE MODE`)
	require.NoError(t, err)
	close(release)
	waiting(1, "the record locked the account and waits for its append")
	go run(second, secondKey)
	waiting(2, "the reservation waits too (on the account, or on the barrier without the lock)")
	require.NoError(t, barrier.Commit())
	for range 2 {
		require.NoError(t, <-errs)
	}
	want, balance := steps.OutcomeOK, int64(800)
	if fault == fakegateway.Decline {
		want, balance = steps.OutcomeFailed, 900
	}
	r := e.reply(firstKey)
	assert.Equal(t, want, r.env.Outcome, "%+v", r)
	r = e.reply(secondKey)
	assert.Equal(t, steps.OutcomeOK, r.env.Outcome, "%+v", r)
	assert.Equal(t, balance, e.balance(acct))
}
