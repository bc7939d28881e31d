package cliargs_test

import (
	"fmt"
	"testing"

	"github.com/stretchr/testify/assert"

	"github.com/pgsaga/pgsaga/cmd/internal/cliargs"
)

func TestRedact(t *testing.T) {
	t.Parallel()
	args := []string{"relay", "nats://u:s3cr3t@h:4222", `kafka://u:s3"cr3t@h:9092`, "host=h password=s3cr3t", "--topic", "t"}
	msg := fmt.Sprintf("unknown command %q; bad %q; %s; topic %q", args[1], args[2], args[3], args[5])
	got := cliargs.Redact(msg, args)
	assert.NotContains(t, got, "s3")
	assert.NotContains(t, got, "cr3t")
	assert.Contains(t, got, "<argument 2, not shown: it may hold a secret>")
	assert.Contains(t, got, "<argument 3, not shown")
	assert.Contains(t, got, "<argument 4, not shown")
	assert.Contains(t, got, `topic "t"`, "other arguments are shown")
	assert.NotContains(t, cliargs.Unexpected(args).Error(), "s3cr3t")
	assert.Contains(t, cliargs.Unexpected(args).Error(), "unexpected arguments (6")
}
