//go:build unix

package finddb

import (
	"errors"
	"fmt"
	"os"
	"syscall"
)

// heldFile creates path and holds an exclusive lock on it until release.
func heldFile(path string) (release func(), err error) {
	f, err := os.OpenFile(path, os.O_CREATE|os.O_EXCL|os.O_RDWR, 0o600)
	if err != nil {
		return nil, fmt.Errorf("finddb: creating %s: %w", path, err)
	}
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		_ = f.Close()
		_ = os.Remove(path)
		return nil, fmt.Errorf("finddb: locking %s: %w", path, err)
	}
	return func() {
		_ = os.Remove(path)
		_ = f.Close()
	}, nil
}

// isHeld reports whether a live process holds the lock on path; a file no
// process holds is left by one that exited without releasing it.
func isHeld(path string) (bool, error) {
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		return false, err
	}
	defer f.Close()
	err = syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB)
	if errors.Is(err, syscall.EWOULDBLOCK) {
		return true, nil
	}
	return false, err
}
