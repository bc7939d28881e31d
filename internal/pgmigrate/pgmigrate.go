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
	"time"

	"github.com/pressly/goose/v3"
)

// Set is one owner's migrations.
type Set struct {
	// Files holds the migrations, named NNNNN_what.sql, at its root.
	Files fs.FS
	// Table records the applied versions.
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
// the files hold.
func (s Set) Version(ctx context.Context, db *sql.DB) (current, known int64, err error) {
	p, err := s.provider(db)
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
