//go:build unix

// Package flock locks files across the processes of a machine (flock(2)):
// the embedded servers' start and user counts, the private servers'
// owners. The kernel releases a lock when its process exits, however it
// exits.
package flock

import (
	"fmt"
	"os"
	"syscall"
)

// Lock takes an exclusive lock on path, creating it if missing, waiting
// for another process's lock to end; unlock releases it.
func Lock(path string) (unlock func(), err error) {
	f, err := os.OpenFile(path, os.O_CREATE|os.O_RDWR, 0o600)
	if err != nil {
		return nil, fmt.Errorf("flock: opening %s: %w", path, err)
	}
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX); err != nil {
		_ = f.Close()
		return nil, fmt.Errorf("flock: locking %s: %w", path, err)
	}
	return func() { _ = f.Close() }, nil // closing releases the lock
}

// TryLock takes an exclusive lock on an existing path if no process holds
// one; ok is false if one does, or path cannot be opened.
func TryLock(path string) (unlock func(), ok bool) {
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		return nil, false
	}
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		_ = f.Close()
		return nil, false
	}
	return func() { _ = f.Close() }, true
}
