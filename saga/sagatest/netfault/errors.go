package netfault

import "errors"

// ErrInvalidFault is returned when a fault cannot be: a negative latency
// or jitter, a bandwidth or partition of zero or less, a toxicity outside
// [0, 1].
var ErrInvalidFault = errors.New("netfault: invalid fault")
