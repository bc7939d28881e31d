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
	"errors"
	"fmt"
	"io/fs"

	"github.com/pressly/goose/v3"

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

// Apply brings the schema of db up to date and returns the versions it
// applied (none when the schema was already current). A database whose
// encoding is not UTF8 is refused, before anything is applied, with an
// error wrapping pgserver.ErrNotUTF8 that says how to fix it.
func Apply(ctx context.Context, db *sql.DB) ([]int64, error) {
	if err := pgserver.RequireUTF8(ctx, db); err != nil {
		return nil, fmt.Errorf("applying migrations: %w", err)
	}
	p, err := provider(db)
	if err != nil {
		return nil, err
	}
	results, err := p.Up(ctx)
	if err != nil {
		return nil, fmt.Errorf("applying migrations: %w", err)
	}
	applied := make([]int64, 0, len(results))
	for _, r := range results {
		applied = append(applied, r.Source.Version)
	}
	return applied, nil
}

// Version reports the newest applied migration version of db and the newest
// version this binary knows. A database ahead of the binary was migrated by a
// newer release.
func Version(ctx context.Context, db *sql.DB) (current, known int64, err error) {
	p, err := provider(db)
	if err != nil {
		return 0, 0, err
	}
	current, err = p.GetDBVersion(ctx)
	if err != nil {
		return 0, 0, fmt.Errorf("reading schema version: %w", err)
	}
	sources := p.ListSources()
	if len(sources) > 0 {
		known = sources[len(sources)-1].Version
	}
	return current, known, nil
}

func provider(db *sql.DB) (*goose.Provider, error) {
	p, err := goose.NewProvider(goose.DialectPostgres, db, files,
		goose.WithTableName(VersionTable),
		goose.WithSessionLocker(advisoryLocker{}),
		goose.WithDisableGlobalRegistry(true),
	)
	if err != nil {
		return nil, fmt.Errorf("loading migrations: %w", err)
	}
	return p, nil
}

// advisoryLocker makes concurrent appliers wait their turn on a blocking
// advisory lock. goose's own Postgres locker polls pg_try_advisory_lock every
// few seconds; a blocking lock hands over the moment the holder finishes and
// still honours ctx.
type advisoryLocker struct{}

func (advisoryLocker) SessionLock(ctx context.Context, conn *sql.Conn) error {
	if _, err := conn.ExecContext(ctx, "SELECT pg_advisory_lock($1)", lockID); err != nil {
		return fmt.Errorf("waiting for the migration lock: %w", err)
	}
	return nil
}

func (advisoryLocker) SessionUnlock(ctx context.Context, conn *sql.Conn) error {
	var released bool
	if err := conn.QueryRowContext(ctx, "SELECT pg_advisory_unlock($1)", lockID).Scan(&released); err != nil {
		return fmt.Errorf("releasing the migration lock: %w", err)
	}
	if !released {
		return errors.New("releasing the migration lock: it was not held by this session")
	}
	return nil
}
