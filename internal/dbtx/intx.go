package dbtx

import (
	"context"
	"database/sql"
	"fmt"

	"github.com/jackc/pgx/v5/stdlib"
)

// InTx runs fn in a READ COMMITTED transaction of db and commits it if
// fn returns nil; an error of fn, or of a write it queued, rolls it back
// and is returned. Its own errors (beginning, committing) start with pkg,
// the caller's package name. On a pgx pool (pgx's database/sql driver) the
// transaction is a Pipe: BEGIN goes with fn's first statement, and what
// fn queues (Queue) with its next statement or the commit.
func InTx(ctx context.Context, db *sql.DB, pkg string, fn func(tx DBTX) error) error {
	piped, err := WithPipe(ctx, db, pkg, func(p *Pipe) error {
		if err := fn(p); err != nil {
			return err
		}
		if err := p.Commit(ctx); err != nil {
			return fmt.Errorf("%s: %w", pkg, err) // it says what failed: the commit, or a write sent with it
		}
		return nil
	})
	if piped {
		return err
	}
	tx, err := db.BeginTx(ctx, &sql.TxOptions{Isolation: sql.LevelReadCommitted})
	if err != nil {
		return fmt.Errorf("%s: beginning a transaction: %w", pkg, err)
	}
	defer tx.Rollback() //nolint:errcheck // no-op after Commit
	if err := fn(tx); err != nil {
		return err
	}
	if err := tx.Commit(); err != nil {
		return fmt.Errorf("%s: committing: %w", pkg, err)
	}
	return nil
}

// WithPipe runs fn on a Pipe of one of db's connections, if db is a pgx
// pool (piped; else it does nothing), and rolls back what fn leaves
// open before the connection goes back to the pool. Its own errors start
// with pkg.
func WithPipe(ctx context.Context, db *sql.DB, pkg string, fn func(p *Pipe) error) (piped bool, err error) {
	if _, ok := db.Driver().(*stdlib.Driver); !ok {
		return false, nil
	}
	sc, err := db.Conn(ctx)
	if err != nil {
		return true, fmt.Errorf("%s: beginning a transaction: %w", pkg, err)
	}
	defer sc.Close() //nolint:errcheck // returns it to the pool
	return true, sc.Raw(func(dc any) error {
		pc, ok := dc.(*stdlib.Conn)
		if !ok {
			return fmt.Errorf("%s: a connection of pgx's database/sql driver is a %T", pkg, dc)
		}
		p := BeginPipe(pc.Conn())
		defer p.Rollback(ctx) //nolint:errcheck // no-op after Commit
		return fn(p)
	})
}
