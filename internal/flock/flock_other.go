//go:build !unix

package flock

// Lock locks nothing without flock.
func Lock(string) (func(), error) { return func() {}, nil }

// TryLock always succeeds without flock.
func TryLock(string) (func(), bool) { return func() {}, true }
