package transport

// ClaimsWaitingForRoom counts the consumers of t waiting for room among
// its awaited calls (MaxAwaitedCalls) before they claim.
func ClaimsWaitingForRoom(t *Transport) int {
	t.calls.mu.Lock()
	defer t.calls.mu.Unlock()
	return t.calls.waiting
}

// GoroutineID is the id of the calling goroutine, as runtime.Stack prints it.
var GoroutineID = goroutineID

// Closing reports whether r has begun to close (its gate drains).
func Closing(r *Router) bool { return r.gate.closing() }

// InFlight counts what r's gate has in flight: deliveries, and calls
// their batches hold.
func InFlight(r *Router) int {
	r.gate.mu.Lock()
	defer r.gate.mu.Unlock()
	return r.gate.inFlight
}

// AwaitedCalls counts r's awaited calls under way, a result its batch took
// and is not done with included.
func AwaitedCalls(r *Router) int { return r.gate.calls.running() }
