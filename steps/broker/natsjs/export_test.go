package natsjs

// Codec is the wire format, for tests.
type Codec = codec
