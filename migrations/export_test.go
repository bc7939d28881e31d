package migrations

import (
	"context"
	"database/sql"
)

// ApplyTo applies the migrations up to version, for tests of upgrades.
func ApplyTo(ctx context.Context, db *sql.DB, version int64) error {
	return set.ApplyTo(ctx, db, version)
}
