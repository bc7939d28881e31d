// Package pgerr classifies the PostgreSQL errors pgsaga branches on, in one
// place, by their SQLSTATE names (github.com/jackc/pgerrcode), never by
// matching message text.
package pgerr

import (
	"database/sql"
	"database/sql/driver"
	"errors"
	"io"
	"net"

	"github.com/jackc/pgerrcode"
	"github.com/jackc/pgx/v5/pgconn"
)

// Code returns the SQLSTATE of err, or "" when err carries none.
func Code(err error) string {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		return pgErr.Code
	}
	return ""
}

// Is reports whether err carries one of codes.
func Is(err error, codes ...string) bool {
	c := Code(err)
	if c == "" {
		return false
	}
	for _, want := range codes {
		if c == want {
			return true
		}
	}
	return false
}

// Retryable reports whether a new transaction can succeed where err failed
// only because of concurrent work: a serialization failure or a deadlock.
func Retryable(err error) bool {
	return Is(err, pgerrcode.SerializationFailure, pgerrcode.DeadlockDetected)
}

// LockNotAvailable reports whether err is a lock wait that outlasted
// lock_timeout (or a NOWAIT lock that was taken).
func LockNotAvailable(err error) bool { return Is(err, pgerrcode.LockNotAvailable) }

// UndefinedTable reports whether err names a table that does not exist.
func UndefinedTable(err error) bool { return Is(err, pgerrcode.UndefinedTable) }

// Aborted reports whether err says the transaction had already failed.
func Aborted(err error) bool { return Is(err, pgerrcode.InFailedSQLTransaction) }

// BadInput reports whether err is PostgreSQL refusing the bytes it was
// given: a sequence that is not valid in the database encoding (a NUL byte
// in text, non-UTF-8 bytes) or a JSON \u0000 escape it cannot store. The
// same input fails the same way every time, so a message that causes it is
// never worth retrying.
func BadInput(err error) bool {
	return Is(err, pgerrcode.CharacterNotInRepertoire, pgerrcode.UntranslatableCharacter)
}

// ConnectionLost reports whether err means the connection to the server is
// gone: the transaction it ran cannot commit, and the connection must not be
// reused.
func ConnectionLost(err error) bool {
	if err == nil {
		return false
	}
	if errors.Is(err, driver.ErrBadConn) || errors.Is(err, io.EOF) ||
		errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, net.ErrClosed) {
		return true
	}
	var netErr net.Error
	if errors.As(err, &netErr) {
		return true
	}
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		return pgErr.Severity == "FATAL" || pgErr.Severity == "PANIC" ||
			pgerrcode.IsConnectionException(pgErr.Code) || pgErr.Code == pgerrcode.AdminShutdown
	}
	return false
}

// Dooms reports whether a statement that failed with err leaves its
// transaction unable to commit: PostgreSQL aborts a transaction block on any
// error it reports, a lost connection cannot commit, and a finished
// transaction commits nothing more.
func Dooms(err error) bool {
	if err == nil {
		return false
	}
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) || errors.Is(err, sql.ErrTxDone) || ConnectionLost(err)
}
