package main

import (
	"testing"

	"github.com/stretchr/testify/assert"

	"github.com/pgsaga/pgsaga/internal/testdb"
	"github.com/pgsaga/pgsaga/internal/testout"
)

// Connection strings and broker URLs whose password pgx or net/url cannot
// find: a '/' or '#' in a URL's password, a PASSWORD= in capitals (pgx's
// keywords are lower case).
var (
	badDatabaseURLs = []string{"postgres://u:s3cr/3t@127.0.0.1:1/db", "host=127.0.0.1 PASSWORD=s3cr3t port=notaport"}
	badBrokerURLs   = []string{"nats://u:s3cr/3t@127.0.0.1:4222", "nats://u:s3cr#3t@127.0.0.1:4222"}
	secretParts     = []string{"s3cr", "3t@", "/3t", "#3t"}
)

// None of such a secret is printed, on stdout or stderr: the program says
// which setting it could not read instead.
func TestUnparseableSettingsArePrintedWithoutTheirSecrets(t *testing.T) {
	t.Parallel()
	check := func(want string, env ...string) {
		t.Helper()
		code, out := testout.Program(t, env...)
		assert.NotEqual(t, exitOK, code, out)
		assert.Contains(t, out, want, "it says what it could not read")
		testout.Hides(t, secretParts, out)
	}
	orders := testdb.Fresh(t).URL // migrated before the payment service's database is opened
	for _, bad := range badDatabaseURLs {
		check("unparseable connection string", "ORDERDEMO_ARGS=-orders 1", "DATABASE_URL="+bad)
		check("unparseable connection string", "ORDERDEMO_ARGS=-orders 1 -payments-service nats://127.0.0.1:4222",
			"DATABASE_URL="+orders, paymentsDatabaseEnv+"="+bad)
	}
	for _, bad := range badBrokerURLs {
		check("unparseable broker URL", "ORDERDEMO_ARGS=-orders 1 -payments-service "+bad, "DATABASE_URL="+orders)
	}
}
