// Package pgmigrate applies a set of numbered SQL migrations with goose, as
// pgsaga's schema and the sample's are applied: each set records its
// versions in a table of its own, and concurrent appliers of a set queue
// on a blocking advisory lock of its own, so that each applies only what
// is still pending.
package pgmigrate

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"io/fs"
	"path"
	"strings"
	"time"

	"github.com/pressly/goose/v3"
	"github.com/pressly/goose/v3/database"
)

// Set is one owner's migrations.
type Set struct {
	// Files holds the migrations, named NNNNN_what.sql, at its root.
	Files fs.FS
	// Table records the applied versions: a plain lowercase identifier.
	Table string
	// Lock is the advisory lock key the set's appliers queue on.
	Lock int64
}

// Embedded is the Set of the migrations in directory dir of fsys (a
// package's embedded files).
func Embedded(fsys fs.FS, dir, table string, lock int64) Set {
	sub, err := fs.Sub(fsys, dir)
	if err != nil {
		panic(fmt.Sprintf("pgmigrate: %s: %v", dir, err)) // the directory is embedded
	}
	return Set{Files: sub, Table: table, Lock: lock}
}

// Apply applies what is pending of s and returns the versions it applied
// (none when db was up to date).
func (s Set) Apply(ctx context.Context, db *sql.DB) ([]int64, error) {
	p, err := s.provider(db)
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

// ApplyTo applies s up to version (tests of upgrades).
func (s Set) ApplyTo(ctx context.Context, db *sql.DB, version int64) error {
	p, err := s.provider(db)
	if err != nil {
		return err
	}
	_, err = p.UpTo(ctx, version)
	return err
}

// Version reports the newest version of s applied to db and the newest
// the files hold. It only reads db: a database without the version table
// is at version 0.
func (s Set) Version(ctx context.Context, db *sql.DB) (current, known int64, err error) {
	p, err := s.provider(db)
	if err != nil {
		return 0, 0, err
	}
	applied, err := s.applied(ctx, db)
	if err != nil {
		return 0, 0, err
	}
	for v := range applied {
		current = max(current, v)
	}
	sources := p.ListSources()
	if len(sources) > 0 {
		known = sources[len(sources)-1].Version
	}
	return current, known, nil
}

// applied reads the versions of s applied to db, without creating the
// version table (goose's Provider creates it on every read).
func (s Set) applied(ctx context.Context, db *sql.DB) (map[int64]bool, error) {
	store, err := database.NewStore(database.DialectPostgres, s.Table)
	if err != nil {
		return nil, err
	}
	exists, err := store.(database.StoreExtender).TableExists(ctx, db)
	if err != nil {
		return nil, fmt.Errorf("reading schema version: %w", err)
	}
	applied := map[int64]bool{}
	if !exists {
		return applied, nil
	}
	rows, err := store.ListMigrations(ctx, db)
	if err != nil {
		return nil, fmt.Errorf("reading schema version: %w", err)
	}
	seen := map[int64]bool{}
	for _, r := range rows { // newest first: a version's latest row says
		if !seen[r.Version] {
			seen[r.Version] = true
			if r.IsApplied && r.Version > 0 {
				applied[r.Version] = true
			}
		}
	}
	return applied, nil
}

// ErrMissingVersion is returned by Pending when a version is missing below
// the newest one applied, which Apply refuses.
var ErrMissingVersion = errors.New("a migration is missing below the newest applied")

// Migration is one migration of a set.
type Migration struct {
	Version int64
	// File is its file's name (00001_idempotency_keys.sql).
	File string
	// SQL is its Up section, without goose's annotations.
	SQL string
	// NoTransaction: it must run outside a transaction (it builds an
	// index CONCURRENTLY, say).
	NoTransaction bool
}

// Pending lists the migrations of s that db has yet to apply, in order.
// It only reads db.
func (s Set) Pending(ctx context.Context, db *sql.DB) ([]Migration, error) {
	p, err := s.provider(db)
	if err != nil {
		return nil, err
	}
	applied, err := s.applied(ctx, db)
	if err != nil {
		return nil, err
	}
	newest := int64(0)
	for v := range applied {
		newest = max(newest, v)
	}
	var pending []Migration
	for _, src := range p.ListSources() {
		if applied[src.Version] {
			continue
		}
		if src.Version < newest {
			// Apply (goose) refuses a version missing below the newest
			// applied: so does its dry run.
			return nil, fmt.Errorf("%w: version %d is not recorded in %s though %d is; applying would refuse it",
				ErrMissingVersion, src.Version, s.Table, newest)
		}
		name := path.Base(src.Path)
		text, err := fs.ReadFile(s.Files, name)
		if err != nil {
			return nil, fmt.Errorf("reading migration %s: %w", name, err)
		}
		m := Migration{Version: src.Version, File: name}
		m.SQL, m.NoTransaction = upSection(string(text))
		pending = append(pending, m)
	}
	return pending, nil
}

// upSection is the Up section of a goose SQL file, without goose's
// annotations, and whether the file runs outside a transaction.
func upSection(text string) (up string, noTx bool) {
	var b strings.Builder
	in := false
	for line := range strings.Lines(text) {
		switch annotation := strings.TrimSpace(line); {
		case annotation == "-- +goose NO TRANSACTION":
			noTx = true
		case annotation == "-- +goose Up":
			in = true
		case annotation == "-- +goose Down":
			in = false
		case strings.HasPrefix(annotation, "-- +goose "):
		case in:
			b.WriteString(line)
		}
	}
	return strings.TrimSpace(b.String()), noTx
}

// Script is SQL that applies pending (see Pending) as Apply would, for a
// tool other than goose (psql, a team's migration runner): the version
// table if it is missing, then each migration, in a transaction of its
// own unless it runs outside one, with the row that records it.
func (s Set) Script(pending []Migration) string {
	var b strings.Builder
	if len(pending) == 0 {
		return ""
	}
	table := s.Table // a plain identifier (see Set)
	fmt.Fprintf(&b, "-- Run it so that it stops at the first error (psql -v ON_ERROR_STOP=1):\n"+
		"-- a migration that failed must not be followed by the next.\n"+
		"-- the table the applied versions are recorded in (goose's)\n"+
		"CREATE TABLE IF NOT EXISTS %s (\n"+
		"\tid integer PRIMARY KEY GENERATED BY DEFAULT AS IDENTITY,\n"+
		"\tversion_id bigint NOT NULL,\n"+
		"\tis_applied boolean NOT NULL,\n"+
		"\ttstamp timestamp NOT NULL DEFAULT now()\n"+
		");\n"+
		"INSERT INTO %s (version_id, is_applied) SELECT 0, true WHERE NOT EXISTS (SELECT FROM %s);\n", table, table, table)
	for _, m := range pending {
		fmt.Fprintf(&b, "\n-- %s", m.File)
		if m.NoTransaction {
			b.WriteString(" (outside a transaction)\n")
		} else {
			b.WriteString("\nBEGIN;\n")
		}
		b.WriteString(m.SQL)
		fmt.Fprintf(&b, "\nINSERT INTO %s (version_id, is_applied) VALUES (%d, true);\n", table, m.Version)
		if !m.NoTransaction {
			b.WriteString("COMMIT;\n")
		}
	}
	return b.String()
}

func (s Set) provider(db *sql.DB) (*goose.Provider, error) {
	p, err := goose.NewProvider(goose.DialectPostgres, db, s.Files,
		goose.WithTableName(s.Table),
		goose.WithSessionLocker(advisoryLocker{id: s.Lock}),
		goose.WithDisableGlobalRegistry(true),
	)
	if err != nil {
		return nil, fmt.Errorf("loading migrations: %w", err)
	}
	return p, nil
}

// advisoryLocker makes concurrent appliers wait their turn on an advisory
// lock, trying it every lockPoll. Not a blocking pg_advisory_lock: a
// waiter's statement would hold a snapshot for as long as it waits, and a
// migration that builds an index CONCURRENTLY waits for every snapshot
// older than its own, so the holder and the waiter would wait for each
// other. (goose's own Postgres locker polls every few seconds.)
type advisoryLocker struct{ id int64 }

// lockPoll is how often a waiting applier tries the migration lock.
const lockPoll = 50 * time.Millisecond

func (l advisoryLocker) SessionLock(ctx context.Context, conn *sql.Conn) error {
	for {
		var got bool
		if err := conn.QueryRowContext(ctx, "SELECT pg_try_advisory_lock($1)", l.id).Scan(&got); err != nil {
			return fmt.Errorf("waiting for the migration lock: %w", err)
		}
		if got {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("waiting for the migration lock: %w", context.Cause(ctx))
		case <-time.After(lockPoll):
		}
	}
}

func (l advisoryLocker) SessionUnlock(ctx context.Context, conn *sql.Conn) error {
	var released bool
	if err := conn.QueryRowContext(ctx, "SELECT pg_advisory_unlock($1)", l.id).Scan(&released); err != nil {
		return fmt.Errorf("releasing the migration lock: %w", err)
	}
	if !released {
		return errors.New("releasing the migration lock: it was not held by this session")
	}
	return nil
}
