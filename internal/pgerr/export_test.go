package pgerr

import "time"

// FastRetries makes RetryLost wait first, at most, between its calls,
// until the test ends (restore).
func FastRetries(first, most time.Duration) (restore func()) {
	old := retryWaits
	retryWaits.first, retryWaits.most = first, most
	return func() { retryWaits = old }
}

// RetryAttempts is how many calls RetryLost makes at most.
const RetryAttempts = retryAttempts
