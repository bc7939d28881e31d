// Package pgerr classifies the PostgreSQL errors pgsaga branches on, in one
// place, by their SQLSTATE names (github.com/jackc/pgerrcode), never by
// matching message text.
package pgerr

import (
	"cmp"
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
// gone, or could not be made for a while: the statement's transaction cannot
// commit, the connection must not be reused, and a new one may work. It is
// pgsaga's one test of a lost connection (the transport's, RetryLost's).
//
// It counts what the driver says of the socket (database/sql's
// driver.ErrBadConn; pgx's "conn closed" once it saw its connection die; a
// stream that ended mid-message; a socket that is closed, reset or refused,
// as while a server restarts; a deadline that cut a statement off, as pgx
// closes that connection), and what the server says by SQLSTATE: class 08 (connection
// exception), class 57 (operator intervention: 57P01 admin_shutdown, which
// pg_terminate_backend and a fast shutdown send, 57P02 crash_shutdown,
// 57P03 cannot_connect_now while a server starts or stops, 57P05
// idle_session_timeout), and any other FATAL or PANIC that ends an
// established session (25P03 idle_in_transaction_session_timeout, say).
//
// It does not count:
//   - 57014 query_canceled: statement_timeout or pg_cancel_backend cancelled
//     the statement and the session is up; the same statement would time
//     out again, and a cancel is someone's decision to stop it;
//   - 57P04 database_dropped: no new connection can succeed;
//   - a refusal to connect that waiting does not cure: a FATAL of another
//     class while connecting (a database that does not exist, a wrong
//     password, a role over its connection limit);
//   - the rest of what pgconn.SafeToRetry accepts, which says that a request
//     was not sent, not that the connection is gone: a context already done,
//     a connection busy with another statement;
//   - a cancelled context: the caller stopped.
func ConnectionLost(err error) bool {
	if err == nil {
		return false
	}
	var netErr net.Error
	if errors.Is(err, driver.ErrBadConn) || errors.Is(err, pgconn.ErrConnClosed) ||
		errors.Is(err, io.ErrUnexpectedEOF) || errors.As(err, &netErr) {
		return true
	}
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) {
		return false
	}
	switch c := pgErr.Code; {
	case c == pgerrcode.QueryCanceled || c == pgerrcode.DatabaseDropped:
		return false
	case pgerrcode.IsConnectionException(c) || pgerrcode.IsOperatorIntervention(c):
		return true
	}
	var connecting *pgconn.ConnectError
	severity := cmp.Or(pgErr.SeverityUnlocalized, pgErr.Severity)
	return (severity == "FATAL" || severity == "PANIC") && !errors.As(err, &connecting)
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
