package payments

import (
	"context"
	"database/sql"
	"embed"
	"io/fs"

	"github.com/pgsaga/pgsaga/internal/pgmigrate"
)

//go:embed migrations/*.sql
var migrationFiles embed.FS

// MigrationsTable records the versions of the payments tables applied.
const MigrationsTable = "payments_schema_version"

var migrationSet = pgmigrate.Embedded(migrationFiles, "migrations", MigrationsTable, 0x7067736167610011)

// Migrations returns the domain's migration files: its tables (accounts,
// account_postings, charge_fences), which pgsaga's own migrations do not create.
func Migrations() fs.FS { return migrationSet.Files }

// Migrate creates or updates the domain's tables in db and returns the
// versions it applied. Safe to run from several processes at once, and
// again: what is applied already is skipped. It adopts the tables a
// database migrated by an earlier release of pgsaga holds.
func Migrate(ctx context.Context, db *sql.DB) ([]int64, error) { return migrationSet.Apply(ctx, db) }
