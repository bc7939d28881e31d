package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/internal/testdb"
	"github.com/pgsaga/pgsaga/internal/testout"
	"github.com/pgsaga/pgsaga/payments/fakegateway"
	"github.com/pgsaga/pgsaga/saga"
	"github.com/pgsaga/pgsaga/saga/orderpayment"
)

// The new flags parse into their options, and bad values or combinations
// are refused.
func TestOperatingFlags(t *testing.T) {
	t.Parallel()
	o, err := parseFlags(strings.Fields("-orders 0 -serve -decline-refunds -log-format json -log-level debug"), io.Discard)
	require.NoError(t, err)
	assert.True(t, o.serve)
	assert.True(t, o.declineRefunds)
	assert.Equal(t, "json", o.log.Format)
	assert.Equal(t, slog.LevelDebug, o.log.LevelOr(slog.LevelWarn))
	assert.False(t, o.chaos(), "declining refunds is no chaos: it injects nothing the run absorbs")

	for args, want := range map[string]slog.Level{
		"":                 slog.LevelWarn,
		"-v":               slog.LevelInfo,
		"-log-level error": slog.LevelError,
		"-log-level INFO":  slog.LevelInfo,
		"-log-level warn":  slog.LevelWarn,
	} {
		o, err := parseFlags(strings.Fields(args), io.Discard)
		require.NoError(t, err, args)
		assert.Equal(t, want, o.log.LevelOr(slog.LevelWarn), args)
		assert.Equal(t, "text", o.log.Format, args)
		assert.False(t, o.serve || o.declineRefunds, args)
	}

	for args, want := range map[string]string{
		"-log-format xml":        `-log-format must be text or json, got "xml"`,
		"-log-level loud":        `-log-level must be debug, info, warn or error, got "loud"`,
		"-v -log-level debug":    "-v is short for -log-level info",
		"-decline-refunds=maybe": "invalid boolean value",
		"-serve=2":               "invalid boolean value",
	} {
		var stdout, stderr bytes.Buffer
		assert.Equal(t, exitUsage, run(context.Background(), strings.Fields(args), &stdout, &stderr), args)
		assert.Contains(t, stderr.String(), want, args)
		assert.Equal(t, 1, strings.Count(stderr.String(), "\n"), "%s: one line: %q", args, stderr.String())
	}
	var stdout, stderr bytes.Buffer
	require.Equal(t, exitOK, run(context.Background(), []string{"-h"}, &stdout, &stderr))
	for _, flag := range []string{"serve", "decline-refunds", "log-format", "log-level", "v"} {
		assert.Regexp(t, `(?m)^  -`+flag+`([ \t]|$)`, stderr.String(), "-h lists -%s", flag)
	}
}

// parkSomeSagas runs the demo with -decline-refunds on db until a run parks
// at least one saga and returns that run's summary. Which sagas need a
// refund is a race (the customer's cancellation against the saga's
// confirmation); a run of 60 orders cancels about eight, and nearly always
// one of them wins.
func parkSomeSagas(t *testing.T, db *testdb.DB) summary {
	t.Helper()
	for attempt := range 5 {
		var stdout, stderr bytes.Buffer
		args := []string{"-orders", "60", "-decline-refunds", "-json", "-seed", fmt.Sprint(1000 + attempt)}
		code := runEnv(context.Background(), env("DATABASE_URL", db.URL), args, &stdout, &stderr)
		require.Equal(t, exitOK, code, "parked sagas explained by a declined refund break no invariant\nstdout:\n%s\nstderr:\n%s", stdout.String(), stderr.String())
		assert.Contains(t, stderr.String(), "the gateway declines every refund (-decline-refunds)")
		s := lastJSON(t, stdout.String())
		if s.Failed > 0 {
			return s
		}
		t.Logf("run %d parked no saga: every customer's cancellation lost its race", attempt+1)
	}
	t.Fatal("five runs of 60 orders with -decline-refunds parked no saga")
	return summary{}
}

// With -decline-refunds the sagas whose compensation needs a refund park
// as failed: the report lists them with their reason, the invariants hold
// (the ledger still holds each one's charge, once, as the gateway says),
// and the exit status is 0. A parked saga that a declined refund does not
// explain is still a broken invariant.
func TestDeclinedRefundsParkSagas(t *testing.T) {
	db := testdb.Fresh(t)
	s := parkSomeSagas(t, db)
	assert.True(t, s.InvariantsOK, "%v", s.Violations)
	assert.Zero(t, s.Unfinished)
	require.Len(t, s.Parked, s.Failed)
	assert.Equal(t, map[string]int{orderpayment.ParkedByDeclinedRefund: s.Failed}, s.FailedReasons)
	for _, p := range s.Parked {
		assert.True(t, strings.HasSuffix(p.Reason, "; then "+orderpayment.ParkedByDeclinedRefund), p.Reason)
		// The charge stays held, once: one captured charge of the order's
		// amount, nothing refunded or voided; the gateway declined the
		// refund and charged the order once.
		var net, amount int64
		var charges, refunds, gatewayCharges, declined int
		require.NoError(t, db.SQL.QueryRow(`SELECT coalesce(sum(p.delta_cents), 0), (s.data->>'amount_cents')::bigint,
			count(*) FILTER (WHERE p.kind = 'charge'), count(*) FILTER (WHERE p.kind IN ('refund', 'void')),
			(SELECT count(*) FROM fake_gateway_operations g WHERE g.op = 'charge' AND g.outcome = 'succeeded' AND g.order_id = s.data->>'order_id'),
			(SELECT count(*) FROM fake_gateway_operations g WHERE g.op = 'refund' AND g.outcome = 'declined'
				AND g.charge_id = max(p.reference) FILTER (WHERE p.kind = 'charge'))
			FROM saga_instances s JOIN account_postings p ON p.order_id = (s.data->>'order_id')::uuid
			WHERE s.id = $1 GROUP BY s.data`, p.SagaID).Scan(&net, &amount, &charges, &refunds, &gatewayCharges, &declined))
		assert.Equal(t, -amount, net, p.SagaID)
		assert.Equal(t, []int{1, 0, 1, 1}, []int{charges, refunds, gatewayCharges, declined}, "%s: charges, refunds, gateway charges, declined refunds", p.SagaID)
	}

	// The table says the same in words.
	var out bytes.Buffer
	(&demo{out: &out}).printTable(s)
	table := out.String()
	assert.Contains(t, table, fmt.Sprintf("failed       %d (parked for an operator: %s: %d)", s.Failed, orderpayment.ParkedByDeclinedRefund, s.Failed))
	assert.Contains(t, table, s.Parked[0].SagaID+"  "+s.Parked[0].Reason)
	assert.Contains(t, table, "pgsaga retry <id>")
	assert.Contains(t, table, "invariants   all hold: every saga finished, and the")
	assert.Contains(t, table, "explained by a declined refund")

	// Anything else parked breaks the invariants: here a parked saga whose
	// refund the gateway says it made after all.
	id := uuid.MustParse(s.Parked[0].SagaID)
	_, err := db.SQL.Exec(`UPDATE fake_gateway_operations SET outcome = 'succeeded' WHERE op = 'refund' AND outcome = 'declined'
		AND charge_id = (SELECT p.reference FROM saga_instances s JOIN account_postings p ON p.order_id = (s.data->>'order_id')::uuid
			WHERE s.id = $1 AND p.kind = 'charge')`, id)
	require.NoError(t, err)
	r, err := orderpayment.Check(context.Background(), db.SQL, []uuid.UUID{id})
	require.NoError(t, err)
	require.False(t, r.OK())
	assert.Contains(t, fmt.Sprint(r.Violations), "sagas parked as failed (an operator must look): "+id.String())
	assert.Empty(t, r.Parked)
}

// A saga parked by a declined refund is retried through the operator's
// path (saga.Client.Ask, as pgsaga retry does) while `orderdemo -orders 0 -serve`
// runs in another process, without -decline-refunds: its worker carries
// the request out, the refund now goes through a gateway that process
// started (the charge was made by an earlier one), and the saga ends
// compensated with its refund recorded exactly once. SIGTERM then ends the
// serving with exit status 0.
func TestParkedSagaRetriedAgainstServingDemo(t *testing.T) {
	t.Parallel() // beside the package's other runs of the sample
	db := testdb.Fresh(t)
	s := parkSomeSagas(t, db)
	id := uuid.MustParse(s.Parked[0].SagaID)

	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), "ORDERDEMO_ARGS=-orders 0 -serve", "DATABASE_URL="+db.URL)
	out := &testout.Buffer{}
	cmd.Stdout, cmd.Stderr = out, out
	require.NoError(t, cmd.Start())
	var waitErr error
	exited := make(chan struct{})
	go func() { waitErr = cmd.Wait(); close(exited) }()
	t.Cleanup(func() {
		select {
		case <-exited:
		default:
			_ = cmd.Process.Kill()
			<-exited
		}
	})
	bound, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	out.WaitFor(bound, t, "serving operator requests")
	assert.NotContains(t, out.String(), "sagas ", "-orders 0 -serve serves only: no run, no report")

	req, err := operator(t, db).Ask(bound, id, saga.RequestRetry, "")
	require.NoError(t, err)
	req = awaitDone(bound, t, db, req.ID)
	require.Equal(t, saga.RequestDone, req.Outcome, "detail: %s\noutput:\n%s", req.Detail, out.String())

	inst := awaitStatus(bound, t, db, id, saga.StatusCompensated, out)
	assert.Equal(t, "confirm: order cancelled by customer", inst.FailureReason, "the park is behind it")
	var data orderpayment.Data
	require.NoError(t, json.Unmarshal(inst.Data, &data))
	var refunds, gatewayRefunds, declined int
	var net int64
	require.NoError(t, db.SQL.QueryRow(`SELECT count(*) FILTER (WHERE p.kind = 'refund'), coalesce(sum(p.delta_cents), 0),
		(SELECT count(*) FROM fake_gateway_operations g WHERE g.op = 'refund' AND g.outcome = 'succeeded'
			AND g.charge_id = max(p.reference) FILTER (WHERE p.kind = 'charge')),
		(SELECT count(*) FROM fake_gateway_operations g WHERE g.op = 'refund' AND g.outcome = 'declined'
			AND g.charge_id = max(p.reference) FILTER (WHERE p.kind = 'charge'))
		FROM account_postings p WHERE p.order_id = $1`, data.OrderID).Scan(&refunds, &net, &gatewayRefunds, &declined))
	assert.Equal(t, []int{1, 1, 1}, []int{refunds, gatewayRefunds, declined}, "refund postings, gateway refunds, declined refunds")
	assert.Zero(t, net, "the money is back")
	r, err := orderpayment.Check(context.Background(), db.SQL, []uuid.UUID{id})
	require.NoError(t, err)
	assert.True(t, r.OK(), "%v", r.Violations)
	assert.Empty(t, r.Parked)

	require.NoError(t, cmd.Process.Signal(syscall.SIGTERM))
	select {
	case <-exited:
		require.NoError(t, waitErr, "SIGTERM ends the serving with exit status 0:\n%s", out.String())
		assert.Contains(t, out.String(), "stopping the workers")
	case <-bound.Done():
		t.Fatalf("still serving after SIGTERM:\n%s", testout.Tail(out.String(), 10))
	}
}

// awaitDone waits for a worker to carry out request id.
func awaitDone(ctx context.Context, t *testing.T, db *testdb.DB, id uuid.UUID) saga.Request {
	t.Helper()
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	for {
		reqs, err := operator(t, db).RequestStatuses(ctx, []uuid.UUID{id})
		require.NoError(t, err)
		if req := reqs[id]; req.DoneAt != nil {
			return req
		}
		select {
		case <-ctx.Done():
			t.Fatalf("request %s never carried out", id)
		case <-tick.C:
		}
	}
}

// awaitStatus waits for saga id to reach want.
func awaitStatus(ctx context.Context, t *testing.T, db *testdb.DB, id uuid.UUID, want saga.Status, out *testout.Buffer) saga.Instance {
	t.Helper()
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	for {
		inst, err := operator(t, db).Get(ctx, id)
		require.NoError(t, err)
		if inst.Status == want {
			return inst
		}
		select {
		case <-ctx.Done():
			t.Fatalf("saga %s is %s, never %s:\n%s", id, inst.Status, want, testout.Tail(out.String(), 20))
		case <-tick.C:
		}
	}
}

// -serve after a run: the report, then one line saying the workers serve
// and how to stop them; the end of the context (SIGINT, SIGTERM) ends the
// serving, and the exit status is the run's. With -json the line goes to
// stderr, and stdout's last line stays the summary.
func TestServeAfterTheRun(t *testing.T) {
	t.Setenv("DATABASE_URL", testdb.Fresh(t).URL)
	var stdout, stderr testout.Buffer
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan int, 1)
	go func() { done <- run(ctx, []string{"-orders", "3", "-serve", "-json"}, &stdout, &stderr) }()
	bound, cancelBound := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancelBound()
	stderr.WaitFor(bound, t, "serving operator requests (pgsaga retry <id>, pgsaga cancel <id>) with 1 worker; stop with Ctrl-C (SIGINT) or SIGTERM\n")
	s := lastJSON(t, stdout.String())
	assert.Equal(t, 3, s.Sagas)
	assert.True(t, s.InvariantsOK)
	cancel()
	select {
	case code := <-done:
		assert.Equal(t, exitOK, code, stderr.String())
	case <-bound.Done():
		t.Fatal("still serving after its context ended")
	}
	assert.Equal(t, s, lastJSON(t, stdout.String()), "nothing follows the summary on stdout")
	assert.Contains(t, stderr.String(), "stopping the workers")
}

// -log-format json writes every log record as one JSON object a line on
// stderr; -v logs at info, where Watermill's router start and stop chatter
// no longer shows (it is at debug).
func TestLogFormatAndLevel(t *testing.T) {
	t.Setenv("DATABASE_URL", testdb.Fresh(t).URL)
	var stdout, stderr testout.Buffer
	require.Equal(t, exitOK, run(context.Background(), []string{"-orders", "2", "-log-format", "json", "-log-level", "debug"}, &stdout, &stderr), stderr.String())
	lines := strings.Split(strings.TrimSpace(stderr.String()), "\n")
	require.NotEmpty(t, lines[0], "debug logs something")
	levels := map[string]int{}
	for _, line := range lines {
		var rec map[string]any
		require.NoError(t, json.Unmarshal([]byte(line), &rec), "not a JSON line: %q", line)
		for _, key := range []string{"time", "level", "msg"} {
			assert.Contains(t, rec, key, line)
		}
		level, _ := rec["level"].(string)
		levels[level]++
	}
	assert.Positive(t, levels["DEBUG"], "%v", levels)
	assert.Contains(t, stderr.String(), `"msg":"Starting handler"`, "the router's chatter is at debug")
	assert.Contains(t, stdout.String(), "invariants   all hold", "the report is no log record: unchanged")

	var vout, verr testout.Buffer
	require.Equal(t, exitOK, run(context.Background(), []string{"-orders", "2", "-v"}, &vout, &verr), verr.String())
	for _, line := range strings.Split(verr.String(), "\n") {
		assert.NotContains(t, line, "level=DEBUG", "-v logs at info and above")
		for _, chatter := range []string{"Starting handler", "Running router handlers", "Closing router", "Router closed",
			"Subscribing to topic", "Subscriber stopped", "Router handler stopped", "Adding handler", "All messages processed"} {
			assert.NotContains(t, line, `msg="`+chatter+`"`, "router chatter at info")
		}
	}
}

// declineRefunds declines refunds only, and leaves the other calls to the
// chaos faults.
func TestDeclineRefundsFaults(t *testing.T) {
	t.Parallel()
	refund, charge := fakegateway.Call{Op: "refund"}, fakegateway.Call{Op: "charge"}
	f := declineRefunds(nil)
	assert.Equal(t, fakegateway.Decline, f(refund))
	assert.Equal(t, fakegateway.None, f(charge))
	slow := declineRefunds(func(fakegateway.Call) fakegateway.Fault { return fakegateway.Slow })
	assert.Equal(t, fakegateway.Decline, slow(refund))
	assert.Equal(t, fakegateway.Slow, slow(charge))
}

// operator is an unstarted client over db, as pgsaga's commands use.
func operator(t *testing.T, db *testdb.DB) *saga.Client {
	t.Helper()
	c, err := saga.NewClientFromDB(db.SQL, saga.ClientConfig{Logger: slog.New(slog.DiscardHandler)})
	require.NoError(t, err)
	return c
}
