package main

import (
	"bytes"
	"context"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/internal/testdb"
	"github.com/pgsaga/pgsaga/internal/testnats"
)

// -payments-service runs the payment step as a service of its own, on a
// database of its own, over the broker: the sagas finish, every invariant
// holds across the two databases, and the report says what crossed the
// broker. Under chaos the broker's redeliveries and relay crashes are
// absorbed too.
func TestPaymentsService(t *testing.T) {
	srv := testnats.Private(t) // the sample's subjects are fixed: a server of the test's own
	for _, c := range []struct {
		name string
		args []string
	}{
		{"calm", []string{"-orders", "30"}},
		{"chaos", []string{"-orders", "40", "-workers", "2", "-duplicate-rate", "0.3", "-crash-rate", "0.2", "-gateway-fault-rate", "0.1", "-seed", "11"}},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Setenv("DATABASE_URL", testdb.Fresh(t).URL)
			t.Setenv(paymentsDatabaseEnv, testdb.Fresh(t).URL)
			var stdout, stderr bytes.Buffer
			args := append([]string{"-json", "-payments-service", srv.URL()}, c.args...)
			code := run(context.Background(), args, &stdout, &stderr)
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
			assert.Contains(t, stderr.String(), "payment service: database from PAYMENTS_DATABASE_URL")
			if c.name == "chaos" {
				require.NotNil(t, s.Chaos)
				require.NotNil(t, s.Chaos.Broker)
				assert.Positive(t, s.Chaos.Broker.Redelivered, "the broker delivered messages twice")
			}
		})
	}
}
