package finddb

// Internals the external tests use.
var (
	Probe       = probe
	RequireUTF8 = requireUTF8
)
