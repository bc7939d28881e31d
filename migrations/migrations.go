// Package migrations holds pgsaga's schema as numbered SQL files and applies
// them with goose.
//
// The files are embedded in the binary. Apply is idempotent and safe to run
// from several processes at once: the appliers queue on a PostgreSQL
// session-level advisory lock, and each one that gets the lock applies only
// what is still pending.
package migrations

import (
	"context"
	"database/sql"
	"embed"
	"fmt"
	"io/fs"

	"github.com/pgsaga/pgsaga/internal/pgmigrate"
	"github.com/pgsaga/pgsaga/internal/pgserver"
)

//go:embed *.sql
var files embed.FS

// VersionTable is the table goose records applied versions in.
const VersionTable = "pgsaga_schema_version"

// lockID is the advisory lock key appliers queue on ("pgsaga-migrations").
const lockID int64 = 0x7067736167610001

// FS returns the embedded migration files.
func FS() fs.FS { return files }

// set is pgsaga's migrations.
var set = pgmigrate.Set{Files: files, Table: VersionTable, Lock: lockID}

// Apply brings the schema of db up to date and returns the versions it
// applied (none when the schema was already current). A database whose
// encoding is not UTF8 is refused, before anything is applied, with an
// error wrapping pgserver.ErrNotUTF8 that says how to fix it. It creates
// pgsaga's tables only: an application's own (the sample's among them)
// come from its own migrations.
func Apply(ctx context.Context, db *sql.DB) ([]int64, error) {
	if err := pgserver.RequireUTF8(ctx, db); err != nil {
		return nil, fmt.Errorf("applying migrations: %w", err)
	}
	return set.Apply(ctx, db)
}

// Version reports the newest applied migration version of db and the newest
// version this binary knows. A database ahead of the binary was migrated by a
// newer release. It only reads db.
func Version(ctx context.Context, db *sql.DB) (current, known int64, err error) {
	return set.Version(ctx, db)
}

// Migration is one of pgsaga's migrations.
type Migration struct {
	Version int64
	// File is its file's name (00001_idempotency_keys.sql).
	File string
	// SQL is what it runs (its file's Up section).
	SQL string
	// NoTransaction: it runs outside a transaction (it builds indexes
	// CONCURRENTLY).
	NoTransaction bool
}

// Pending lists the migrations db has yet to apply, in order, as Apply
// would apply them. It only reads db. A version missing below the newest
// applied, which Apply refuses, is an error matching ErrMissingVersion.
func Pending(ctx context.Context, db *sql.DB) ([]Migration, error) {
	ms, err := set.Pending(ctx, db)
	pending := make([]Migration, len(ms))
	for i, m := range ms {
		pending[i] = Migration(m)
	}
	return pending, err
}

// Script is SQL that applies pending (see Pending) as Apply would, for
// teams that apply migrations with their own tool: the version table
// (VersionTable) if it is missing, then each migration in a transaction of
// its own (but the one that builds indexes concurrently, which cannot run
// in one), with the row that records it, so that Apply and the workers
// then find nothing to do. Run it so that it stops at its first error
// (psql -v ON_ERROR_STOP=1). It is empty when nothing is pending.
func Script(pending []Migration) string {
	ms := make([]pgmigrate.Migration, len(pending))
	for i, m := range pending {
		ms[i] = pgmigrate.Migration(m)
	}
	return set.Script(ms)
}
