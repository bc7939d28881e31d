package main

import (
	"testing"

	"github.com/stretchr/testify/assert"

	"github.com/pgsaga/pgsaga/internal/testout"
)

// A DATABASE_URL or -payments-service URL whose password pgx or net/url
// cannot find ('/' or '#' in a URL's password, PASSWORD= in capitals) is
// not printed, on stdout or stderr: sagabench says which setting it could
// not read instead.
func TestUnparseableSettingsArePrintedWithoutTheirSecrets(t *testing.T) {
	t.Parallel()
	for _, c := range []struct{ want, args, url string }{
		{"unparseable connection string", "-sagas 1", "postgres://u:s3cr/3t@127.0.0.1:1/db"},
		{"unparseable connection string", "-sagas 1", "host=127.0.0.1 PASSWORD=s3cr3t port=notaport"},
		{"unparseable broker URL", "-sagas 1 -payments-service nats://u:s3cr#3t@127.0.0.1:4222", "postgres://postgres@127.0.0.1:1/db"},
		{"unparseable broker URL", "-sagas 1 -payments-service nats://u:s3cr/3t@127.0.0.1:4222", "postgres://postgres@127.0.0.1:1/db"},
	} {
		code, out := testout.Program(t, "SAGABENCH_ARGS="+c.args, "DATABASE_URL="+c.url)
		assert.NotEqual(t, exitOK, code, out)
		assert.Contains(t, out, c.want, "it says what it could not read")
		testout.Hides(t, []string{"s3cr", "3t@", "/3t", "#3t"}, out)
	}
}
