package outcome_test

import (
	"errors"
	"fmt"

	"github.com/pgsaga/pgsaga/internal/outcome"
	"github.com/pgsaga/pgsaga/internal/transport"
	"github.com/pgsaga/pgsaga/steps"
)

// Whatever package an error comes from, Of says how handling ended, and so
// what happens next: commit, store and answer the refusal, retry, or
// dead-letter at once.
func ExampleOf() {
	for _, err := range []error{
		nil,
		steps.Fail(nil, "insufficient funds"),
		errors.New("connection reset by peer"),
		transport.Permanent(errors.New("not an order")),
	} {
		fmt.Println(outcome.Of(err))
	}
	// Output:
	// completed
	// business_failure
	// transient
	// permanent
}
