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
