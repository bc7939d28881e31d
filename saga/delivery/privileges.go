package delivery

import (
	"fmt"
	"strings"
)

// PrivilegeError says which privileges Role lacks. It matches
// ErrMissingPrivileges.
type PrivilegeError struct {
	Role    string
	Missing []string // "TEMPORARY on database x", "DELETE on pgsaga_queue"
}

// Error implements error.
func (e *PrivilegeError) Error() string {
	return fmt.Sprintf("transport: database role %q lacks privileges a worker needs: %s (docs/operating.md, \"Database roles\", lists the grants)",
		e.Role, strings.Join(e.Missing, "; "))
}

// Unwrap makes the error match ErrMissingPrivileges.
func (e *PrivilegeError) Unwrap() error { return ErrMissingPrivileges }
