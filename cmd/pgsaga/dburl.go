package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"strings"

	"github.com/pgsaga/pgsaga/internal/finddb"
	"github.com/pgsaga/pgsaga/internal/pgdb"
)

// libpqEnv are the environment variables libpq (and pgx) read for a
// connection.
var libpqEnv = []string{
	"PGHOST", "PGHOSTADDR", "PGPORT", "PGDATABASE", "PGUSER", "PGPASSWORD", "PGPASSFILE",
	"PGSERVICE", "PGSERVICEFILE", "PGSSLMODE", "PGSSLCERT", "PGSSLKEY", "PGSSLROOTCERT",
	"PGSSLPASSWORD", "PGSSLSNI", "PGAPPNAME", "PGCONNECT_TIMEOUT", "PGTARGETSESSIONATTRS", "PGOPTIONS",
}

// libpqTarget are those of libpqEnv that say where to connect: one of them
// set names the database when neither --database-url nor DATABASE_URL
// does. The others (PGSSLMODE, PGAPPNAME, PGPASSWORD, …, often set in a
// profile) only say how, and apply to whatever is named.
var libpqTarget = []string{"PGHOST", "PGHOSTADDR", "PGPORT", "PGDATABASE", "PGUSER", "PGSERVICE"}

// errNoDatabaseConfigured is returned when nothing names the database.
var errNoDatabaseConfigured = errors.New("no database configured: pass --database-url URL, or set DATABASE_URL, " +
	"or the PG* variables as for psql (PGHOST, PGPORT, PGDATABASE, PGUSER or PGSERVICE; a password in PGPASSWORD or ~/.pgpass); " +
	"the sample's embedded server is found while the sample serves (go run ./cmd/orderdemo -orders 0 -serve)")

type databaseURLKey struct{}

// withDatabaseURL carries the --database-url flag's value in ctx.
func withDatabaseURL(ctx context.Context, url string) context.Context {
	return context.WithValue(ctx, databaseURLKey{}, url)
}

// target is the database a command uses.
type target struct {
	url string
	env bool // the PG* variables name it (url is empty)
	// found: the embedded server of a running sample.
	found *finddb.Found
	// where says which database it is and where it came from, for the
	// user; from says only the latter.
	where, from string
}

// resolve finds the database a command uses, in the order libpq's users
// expect, starting nothing and creating nothing: --database-url, then
// DATABASE_URL, then the PG* variables, then the embedded server of a
// sample running on this machine as this user.
func resolve(ctx context.Context) (target, error) {
	if url, _ := ctx.Value(databaseURLKey{}).(string); url != "" {
		return target{url: url, where: pgdb.Describe(url) + " from --database-url", from: "--database-url"}, nil
	}
	if url := os.Getenv(pgdb.EnvURL); url != "" {
		return target{url: url, where: pgdb.Describe(url) + " from DATABASE_URL", from: "DATABASE_URL"}, nil
	}
	for _, v := range libpqTarget {
		if os.Getenv(v) != "" {
			return target{env: true, where: pgdb.Describe("") + " from the PG* variables", from: "the PG* variables"}, nil
		}
	}
	found, err := finddb.Running(ctx, finddb.Config{Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if errors.Is(err, finddb.ErrNoRunningSample) {
		return target{}, fmt.Errorf("%w (%v)", errNoDatabaseConfigured, err)
	}
	if err != nil {
		return target{}, err
	}
	return target{url: found.URL, found: found, where: found.Describe(), from: "a running sample"}, nil
}

// describe names the database for the user, never with its password.
func (t target) describe() string { return strings.TrimSpace(t.where) }
