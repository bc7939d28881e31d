package migrations

import "github.com/pgsaga/pgsaga/internal/pgmigrate"

// ErrMissingVersion is returned by Pending when db lacks a version below
// the newest it applied (its row deleted, or a migration added out of
// order): Apply refuses such a database.
var ErrMissingVersion = pgmigrate.ErrMissingVersion
