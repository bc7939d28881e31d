package kafka

// Marshaler is the wire format, for tests.
var Marshaler = marshaler
