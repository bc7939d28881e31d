package idempotency

// SetAfterFailureRollback makes f run between the rollback of a request
// Do found failed and the storing of its failure, until the test ends
// (restore).
func SetAfterFailureRollback(f func(Request)) (restore func()) {
	afterFailureRollback = f
	return func() { afterFailureRollback = nil }
}
