//go:build unix

package testdb

import (
	"os"
	"syscall"

	"github.com/pgsaga/pgsaga/internal/finddb"
)

// lockFile takes an exclusive lock on path, shared by every process of the
// machine, waiting for it (finddb.LockFile); unlock releases it.
func lockFile(path string) (unlock func(), err error) { return finddb.LockFile(path) }

// tryLockFile takes an exclusive lock on an existing path if no process
// holds one; ok is false if one does, or path cannot be opened.
func tryLockFile(path string) (unlock func(), ok bool) {
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
