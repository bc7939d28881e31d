package delivery

// Outcome is how handling a message or a request ended, in pgsaga's one
// vocabulary, shared by the idempotency store, the steps, the delivery
// and the saga engine:
//
//   - Completed: done; its effects commit with it.
//   - BusinessFailure: understood and refused for good (insufficient
//     funds, an order already cancelled): the refusal is stored and
//     answered, the handler's writes are rolled back, and it is never
//     retried.
//   - Transient: it may succeed later (a lock timeout, a lost
//     connection, a version conflict): everything is rolled back and it is
//     retried with backoff, then dead-lettered.
//   - Permanent: no retry can fix it (a message that cannot be decoded, a
//     key reused for another request): dead-lettered at once.
type Outcome string

// Outcomes.
const (
	Completed       Outcome = "completed"
	BusinessFailure Outcome = "business_failure"
	Transient       Outcome = "transient"
	Permanent       Outcome = "permanent"
)
