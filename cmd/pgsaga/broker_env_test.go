package main

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
)

// relay reads its broker from PGSAGA_BROKER_URL when --broker is not
// given (a command line is visible to every user of the machine; the
// environment is not); --broker, given, wins.
func TestRelayBrokerFromTheEnvironment(t *testing.T) {
	t.Setenv("DATABASE_URL", "postgres://postgres@127.0.0.1:1/nowhere?connect_timeout=5")
	t.Setenv(envBrokerURL, "nats://u:s3cr/3t@127.0.0.1:4222")
	code, _, errOut := pgsaga(t, "relay", "--topic", "t")
	assert.Equal(t, exitUsage, code, errOut)
	assert.Contains(t, errOut, "unparseable broker URL", "the environment's URL is read")
	assert.NotContains(t, errOut, "s3cr")

	code, _, errOut = pgsaga(t, "relay", "--topic", "t", "--broker", "nats://127.0.0.1:1")
	assert.Equal(t, exitFailed, code, errOut)
	assert.NotContains(t, errOut, "unparseable broker URL", "--broker wins")

	t.Setenv(envBrokerURL, "")
	code, _, errOut = pgsaga(t, "relay", "--topic", "t")
	assert.Equal(t, exitUsage, code, errOut)
	assert.Contains(t, errOut, envBrokerURL, "it says where a broker URL may come from")

	_, help, _ := pgsaga(t, "relay", "--help")
	assert.Contains(t, help, envBrokerURL)
}

// A URL given as an argument, where none is taken (a forgotten --broker),
// is not echoed by the complaint: it may hold a password. Nor anywhere
// else an argument is quoted.
func TestArgumentsWithSecretsAreNotEchoed(t *testing.T) {
	t.Setenv("DATABASE_URL", "postgres://postgres@127.0.0.1:1/nowhere?connect_timeout=5")
	for _, args := range [][]string{
		{"relay", "--topic", "t", "nats://u:s3cr3t@127.0.0.1:4222"},
		{"relay", "--topic", "t", "kafka://u:s3cr3t@127.0.0.1:9092"},
		{"ui", "nats://u:s3cr3t@127.0.0.1:4222"},
		{"sagas", `nats://u:s3"cr3t@127.0.0.1:4222`},
		{"nats://u:s3cr3t@127.0.0.1:4222"},
		{"relay", "nats://s3cr3t@127.0.0.1:4222", "--topic", "t"},
		{"show", "postgres://u:s3cr3t@h/db"},
		{"dead-letters", "show", "host=h password=s3cr3t"},
	} {
		code, out, errOut := pgsaga(t, args...)
		assert.Equal(t, exitUsage, code, "%v: %s", args, errOut)
		assert.NotContains(t, out+errOut, "s3cr", "%v", args)
		assert.NotContains(t, out+errOut, "cr3t", "%v", args)
		assert.True(t, strings.HasPrefix(errOut, "pgsaga: "), errOut)
	}
}
