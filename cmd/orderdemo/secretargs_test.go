package main

import (
	"bytes"
	"context"
	"io"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// -payments-service may come from ORDERDEMO_PAYMENTS_SERVICE (a command
// line is visible to every user of the machine); the flag, given, wins.
func TestPaymentsServiceFromTheEnvironment(t *testing.T) {
	t.Setenv("ORDERDEMO_PAYMENTS_SERVICE", "nats://u:s3cr3t@127.0.0.1:4222")
	o, err := parseFlags(nil, io.Discard)
	require.NoError(t, err)
	assert.Equal(t, "nats://u:s3cr3t@127.0.0.1:4222", o.paymentsService)
	o, err = parseFlags([]string{"-payments-service", "nats://127.0.0.1:4222"}, io.Discard)
	require.NoError(t, err)
	assert.Equal(t, "nats://127.0.0.1:4222", o.paymentsService, "the flag wins")
	o, err = parseFlags([]string{"-payments-service="}, io.Discard)
	require.NoError(t, err)
	assert.Empty(t, o.paymentsService, "an empty flag wins too: one database")
	t.Setenv("ORDERDEMO_PAYMENTS_SERVICE", "http://u:s3cr3t@127.0.0.1:1")
	_, err = parseFlags(nil, io.Discard)
	assert.ErrorContains(t, err, "unknown broker URL")
	assert.NotContains(t, err.Error(), "s3cr3t")

	var help bytes.Buffer
	_, _ = parseFlags([]string{"-h"}, &help)
	assert.Contains(t, help.String(), "ORDERDEMO_PAYMENTS_SERVICE")
}

// An argument where none is taken (a URL given without its flag) is not
// echoed: it may hold a password. Nor is a flag's bad value.
func TestArgumentsWithSecretsAreNotEchoed(t *testing.T) {
	t.Setenv("ORDERDEMO_PAYMENTS_SERVICE", "")
	for _, args := range [][]string{
		{"nats://u:s3cr3t@127.0.0.1:4222"},
		{"-orders", "5", "kafka://u:s3cr3t@127.0.0.1:9092?sasl=plain"},
		{"-orders", "nats://u:s3cr3t@127.0.0.1:4222"},
	} {
		var stdout, stderr bytes.Buffer
		code := run(context.Background(), args, &stdout, &stderr)
		assert.Equal(t, exitUsage, code, "%v: %s", args, stderr.String())
		assert.NotContains(t, stdout.String()+stderr.String(), "s3cr3t", "%v", args)
	}
}
