package outcome_test

import (
	"errors"
	"fmt"
	"testing"

	"github.com/stretchr/testify/assert"

	"github.com/pgsaga/pgsaga/idempotency"
	"github.com/pgsaga/pgsaga/internal/outcome"
	"github.com/pgsaga/pgsaga/internal/transport"
	"github.com/pgsaga/pgsaga/steps"
)

// Every package's way of saying how handling ended maps to the one
// vocabulary, wrapped or not.
func TestEveryPackageSpeaksTheSameVocabulary(t *testing.T) {
	plain := errors.New("connection reset")
	for name, c := range map[string]struct {
		err   error
		want  outcome.Kind
		final bool
	}{
		"nil":                           {nil, outcome.Completed, false},
		"any other error":               {plain, outcome.Transient, false},
		"steps.Fail":                    {steps.Fail(nil, "out of stock"), outcome.BusinessFailure, true},
		"idempotency.Reject":            {idempotency.Reject("declined"), outcome.BusinessFailure, true},
		"idempotency.Failure":           {&idempotency.Failure{Reason: "refused"}, outcome.BusinessFailure, true},
		"idempotency.ErrKeyReused":      {fmt.Errorf("claiming: %w", idempotency.ErrKeyReused), outcome.Permanent, true},
		"transport.Permanent":           {transport.Permanent(plain), outcome.Permanent, true},
		"steps.DecodeError":             {&steps.DecodeError{MessageID: "m", Want: "x", Err: plain}, outcome.Permanent, true},
		"wrapped business failure":      {fmt.Errorf("step: %w", steps.Fail(nil, "no")), outcome.BusinessFailure, true},
		"permanent wrapping a business": {transport.Permanent(steps.Fail(nil, "no")), outcome.Permanent, true},
	} {
		assert.Equal(t, c.want, outcome.Of(c.err), name)
		assert.Equal(t, c.final, outcome.Final(c.err), name)
		assert.Equal(t, c.final, c.err != nil && transport.IsPermanent(c.err), name)
	}
	assert.ErrorIs(t, fmt.Errorf("x: %w", idempotency.ErrKeyReused), idempotency.ErrKeyReused, "sentinels still compare")
}
