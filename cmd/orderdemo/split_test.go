package main

import (
	"bytes"
	"context"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/internal/testdb"
	"github.com/pgsaga/pgsaga/internal/testnats"
	"github.com/pgsaga/pgsaga/internal/transport"
	"github.com/pgsaga/pgsaga/payments"
)

// -payments-service runs the payment step as a service of its own, on a
// database of its own, over the broker: the sagas finish, every invariant
// holds across the two databases, and the report says what crossed the
// broker. Under chaos the broker's redeliveries and relay crashes are
// absorbed too.
func TestPaymentsService(t *testing.T) {
	t.Parallel()               // beside the package's other runs of the sample
	srv := testnats.Private(t) // the sample's subjects are fixed: a server of the test's own
	for _, c := range []struct {
		name string
		args []string
	}{
		{"calm", []string{"-orders", "30"}},
		{"chaos", []string{"-orders", "40", "-workers", "2", "-duplicate-rate", "0.3", "-crash-rate", "0.2", "-gateway-fault-rate", "0.1", "-seed", "11"}},
	} {
		t.Run(c.name, func(t *testing.T) {
			getenv := env("DATABASE_URL", testdb.Fresh(t).URL, paymentsDatabaseEnv, testdb.Fresh(t).URL)
			var stdout, stderr bytes.Buffer
			args := append([]string{"-json", "-payments-service", srv.URL()}, c.args...)
			code := runEnv(context.Background(), getenv, args, &stdout, &stderr)
			require.Equal(t, exitOK, code, "stdout:\n%s\nstderr:\n%s", stdout.String(), stderr.String())
			s := lastJSON(t, stdout.String())
			assert.True(t, s.InvariantsOK, "%v", s.Violations)
			assert.Zero(t, s.Unfinished)
			assert.Equal(t, s.Sagas, s.Completed+s.Compensated)
			require.NotNil(t, s.PaymentsService)
			assert.Equal(t, srv.URL(), s.PaymentsService.Broker)
			assert.GreaterOrEqual(t, s.PaymentsService.Relayed, int64(2*s.Sagas-s.Compensated), "a command and a reply for each charge at least")
			assert.Positive(t, s.PaymentsService.Received)
			assert.Positive(t, s.GatewayCharges, "the payment service's gateway charged")
			assert.Regexp(t, `payment service: database \S+ as \S+ on 127.0.0.1:\d+ from PAYMENTS_DATABASE_URL, reached through `+srv.URL(), stderr.String())
			if c.name == "chaos" {
				require.NotNil(t, s.Chaos)
				require.NotNil(t, s.Chaos.Broker)
				assert.Positive(t, s.Chaos.Broker.Redelivered, "the broker delivered messages twice")
			}
		})
	}
}

// Switching a database between the two modes while sagas of the other
// mode are unfinished is refused, saying what to do: their payment
// commands wait in the other mode's queues (the local step's, or the
// relay's and the payment service's), and the switch used to drop them
// and re-send each charge where the accounts are not, compensating every
// saga while the payment service went on charging (customers charged for
// cancelled orders, and the one-database check, blind to the other
// database, said every invariant held). With every saga finished, the
// switch goes ahead and drops the other mode's groups.
func TestSwitchingModesWaitsForTheUnfinishedSagas(t *testing.T) {
	t.Parallel() // beside the package's other runs of the sample
	srv := testnats.Private(t)
	db := testdb.Fresh(t)
	getenv := env("DATABASE_URL", db.URL, paymentsDatabaseEnv, testdb.Fresh(t).URL)
	one := []string{"-orders", "3"}
	two := []string{"-orders", "3", "-payments-service", srv.URL()}
	runOK := func(args []string) string {
		var stdout, stderr bytes.Buffer
		code := runEnv(context.Background(), getenv, args, &stdout, &stderr)
		require.Equal(t, exitOK, code, "stdout:\n%s\nstderr:\n%s", stdout.String(), stderr.String())
		return stdout.String() + stderr.String()
	}
	unfinish := func() {
		_, err := db.SQL.Exec(`UPDATE saga_instances SET status = 'running', finished_at = NULL WHERE id = (SELECT id FROM saga_instances ORDER BY id LIMIT 1)`)
		require.NoError(t, err)
	}
	finish := func() {
		_, err := db.SQL.Exec(`UPDATE saga_instances SET status = 'completed', finished_at = now() WHERE status = 'running'`)
		require.NoError(t, err)
	}
	groups := func(topic string) []string {
		var out []string
		rows, err := db.SQL.Query(`SELECT consumer_group FROM pgsaga_subscriptions WHERE topic = $1 ORDER BY 1`, topic)
		require.NoError(t, err)
		defer rows.Close()
		for rows.Next() {
			var g string
			require.NoError(t, rows.Scan(&g))
			out = append(out, g)
		}
		return out
	}

	runOK(one)
	for _, c := range []struct {
		name                      string
		args, resume, advised     []string
		keeps, records, otherMode string
	}{
		{"to the payment service", two, []string{"-resume", "-payments-service", srv.URL()}, []string{"-resume"},
			payments.ChargeStepName, transport.RelayGroup, "without -payments-service"},
		{"back to one database", one, []string{"-resume"}, []string{"-resume", "-payments-service", srv.URL()},
			transport.RelayGroup, payments.ChargeStepName, "with -payments-service"},
	} {
		t.Run(c.name, func(t *testing.T) {
			unfinish()
			for _, args := range [][]string{c.args, c.resume} {
				var stdout, stderr bytes.Buffer
				code := runEnv(context.Background(), getenv, args, &stdout, &stderr)
				assert.Equal(t, exitNoService, code, "%v", args)
				assert.Contains(t, stderr.String(), "1 saga of this database is unfinished and ran "+c.otherMode, "%v", args)
				assert.Contains(t, stderr.String(), "finish it in that mode first", "%v", args)
				assert.Contains(t, groups(payments.ChargeTopic), c.keeps, "the other mode's group is kept, with what it holds")
				assert.NotContains(t, groups(payments.ChargeTopic), c.records, "nothing of the refused mode is recorded")
			}
			// The advice is followed: a run in the other mode starts (and
			// gives up on the saga made unfinished by hand).
			var stdout, stderr bytes.Buffer
			code := runEnv(context.Background(), getenv, append(c.advised, "-timeout", "1s"), &stdout, &stderr)
			assert.Equal(t, exitFailed, code, "stdout:\n%s\nstderr:\n%s", stdout.String(), stderr.String())
			assert.Contains(t, stdout.String()+stderr.String(), "gave up waiting")
			finish()
			out := runOK(c.args)
			assert.Contains(t, out, "dropped consumer group "+c.keeps)
			assert.NotContains(t, groups(payments.ChargeTopic), c.keeps)
		})
	}
}
