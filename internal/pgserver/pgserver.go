// Package pgserver checks that a PostgreSQL database can hold what pgsaga
// stores, before anything is stored.
package pgserver

import (
	"context"
	"database/sql"
	"fmt"

	"github.com/pgsaga/pgsaga/saga/delivery"
)

// ErrNotUTF8 is returned for a database whose encoding is not UTF8 (the
// one of package delivery, where users match it).
var ErrNotUTF8 = delivery.ErrNotUTF8

// Querier is the part of *sql.DB, *sql.Conn and *sql.Tx the check needs.
type Querier interface {
	QueryRowContext(ctx context.Context, query string, args ...any) *sql.Row
}

const encodingSQL = `SELECT current_database(), pg_encoding_to_char(encoding) FROM pg_database WHERE datname = current_database()`

// RequireUTF8 returns an error wrapping ErrNotUTF8, in one sentence that
// says how to fix it, unless the database's encoding is UTF8. Messages carry
// text from anywhere; in another encoding PostgreSQL rejects or mangles it,
// and a message that cannot be stored or read fails every time.
func RequireUTF8(ctx context.Context, q Querier) error {
	var name, encoding string
	if err := q.QueryRowContext(ctx, encodingSQL).Scan(&name, &encoding); err != nil {
		return fmt.Errorf("reading the database encoding: %w", err)
	}
	if encoding == "UTF8" {
		return nil
	}
	return fmt.Errorf("%w, but database %q uses %s: create it with CREATE DATABASE %q ENCODING 'UTF8' TEMPLATE template0 (or initialise the server with initdb -E UTF8) and point DATABASE_URL at it",
		ErrNotUTF8, name, encoding, name)
}
