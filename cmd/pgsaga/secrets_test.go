package main

import (
	"testing"

	"github.com/stretchr/testify/assert"

	"github.com/pgsaga/pgsaga/internal/testout"
)

// A DATABASE_URL or --broker URL whose password pgx or net/url cannot
// find ('/' or '#' in a URL's password, PASSWORD= in capitals) is not
// printed, on stdout or stderr, by a listing, the web view or the relay:
// pgsaga says which setting it could not read instead.
func TestUnparseableSettingsArePrintedWithoutTheirSecrets(t *testing.T) {
	t.Parallel()
	const relay = "relay --topic t --broker "
	for _, url := range []string{"postgres://u:s3cr/3t@127.0.0.1:1/db", "host=127.0.0.1 PASSWORD=s3cr3t port=notaport"} {
		for _, args := range []string{"sagas", "ui --addr 127.0.0.1:0", relay + "nats://127.0.0.1:4222"} {
			check(t, "unparseable connection string", args, url)
		}
	}
	for _, broker := range []string{"nats://u:s3cr/3t@127.0.0.1:4222", "nats://u:s3cr#3t@127.0.0.1:4222"} {
		check(t, "unparseable broker URL", relay+broker, "postgres://postgres@127.0.0.1:1/db")
	}
}

func check(t *testing.T, want, args, url string) {
	t.Helper()
	code, out := testout.Program(t, childArgs+"="+args, "DATABASE_URL="+url)
	assert.NotEqual(t, exitOK, code, "%s: %s", args, out)
	assert.Contains(t, out, want, "%s: it says what it could not read", args)
	testout.Hides(t, []string{"s3cr", "3t@", "/3t", "#3t"}, out)
}
