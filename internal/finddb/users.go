package finddb

import (
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"os"
	"path/filepath"
	"strings"
)

// The programs that use one embedded server are counted, so that only the
// last to close stops it: `orderdemo` run while `orderdemo -orders 0 -serve`
// serves must not stop the server under it. Each user holds a lock on a
// file of its own in <EmbeddedDir>/users for as long as it uses the server;
// the kernel drops the lock of a process that dies, so a crashed program
// is not counted. Registering, counting and stopping happen under
// <EmbeddedDir>/server.lock, so no program starts to use the server between
// another's count and its stop.

const (
	serverLock = "server.lock"
	usersDir   = "users"
)

// register makes this handle a user of the embedded server in dir; the
// caller holds the server lock.
func register(dir string) (release func(), err error) {
	users := filepath.Join(dir, usersDir)
	if err := os.MkdirAll(users, 0o700); err != nil {
		return nil, fmt.Errorf("finddb: creating %s: %w", users, err)
	}
	suffix := make([]byte, 4)
	_, _ = rand.Read(suffix)
	return heldFile(filepath.Join(users, fmt.Sprintf("%d-%s.lock", os.Getpid(), hex.EncodeToString(suffix))))
}

// otherUsers counts the live users of the embedded server in dir, removing
// the files of those that died; the caller holds the server lock.
func otherUsers(dir string) (int, error) {
	users := filepath.Join(dir, usersDir)
	entries, err := os.ReadDir(users)
	if err != nil {
		if os.IsNotExist(err) {
			return 0, nil
		}
		return 0, fmt.Errorf("finddb: reading %s: %w", users, err)
	}
	n := 0
	for _, e := range entries {
		if !strings.HasSuffix(e.Name(), ".lock") {
			continue
		}
		path := filepath.Join(users, e.Name())
		held, err := isHeld(path)
		switch {
		case err != nil && os.IsNotExist(err):
		case err != nil:
			// One we cannot judge counts: better a server left running
			// than one stopped under its user.
			n++
		case held:
			n++
		default:
			_ = os.Remove(path)
		}
	}
	return n, nil
}
