package saga

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"regexp"
	"strings"

	"github.com/jackc/pgerrcode"
	"github.com/jackc/pgx/v5/pgconn"
)

// schemaName is what ClientConfig.Schema takes: a lowercase SQL
// identifier, which a search_path names as it is, without quoting.
var schemaName = regexp.MustCompile(`^[a-z_][a-z0-9_]{0,62}$`)

func validateSchema(schema string) error {
	if !schemaName.MatchString(schema) || strings.HasPrefix(schema, "pg_") {
		return fmt.Errorf("Schema %q must be 1 to 63 characters from [a-z0-9_], not starting with a digit or pg_", schema)
	}
	return nil
}

// checkSchema returns ErrSchemaNotOnPath if the client has a Schema and
// its connections resolve names elsewhere: their current schema is
// another, or (tables) pgsaga_queue resolves to another schema's table,
// which a search path falls through to when the schema has none (a
// schema created but not migrated, beside an installation in public).
func (c *Client) checkSchema(ctx context.Context, tables bool) error {
	if c.cfg.Schema == "" {
		return nil
	}
	var current, queue sql.NullString
	err := c.db.QueryRowContext(ctx, `SELECT current_schema(),
       (SELECT n.nspname FROM pg_class r JOIN pg_namespace n ON n.oid = r.relnamespace
        WHERE r.oid = to_regclass('pgsaga_queue'))`).Scan(&current, &queue)
	if err != nil {
		return fmt.Errorf("saga: reading the connections' current schema: %w", err)
	}
	if current.String != c.cfg.Schema {
		now := "none: no schema of the search_path exists"
		if current.Valid {
			now = fmt.Sprintf("%q", current.String)
		}
		return fmt.Errorf("%w: ClientConfig.Schema is %q, the pool's current schema is %s; set the pool's search_path to it (pgxpool.Config.ConnConfig.RuntimeParams[\"search_path\"] = %q)",
			ErrSchemaNotOnPath, c.cfg.Schema, now, c.cfg.Schema+", public")
	}
	if tables && queue.Valid && queue.String != c.cfg.Schema {
		return fmt.Errorf("%w: schema %q holds no pgsaga tables, and the search_path finds %s.pgsaga_queue instead; run Migrate",
			ErrSchemaNotOnPath, c.cfg.Schema, queue.String)
	}
	return nil
}

// createSchema creates the client's Schema if it is missing. A role that
// may not create schemas can use one an administrator made for it.
func (c *Client) createSchema(ctx context.Context) error {
	if c.cfg.Schema == "" {
		return nil
	}
	var exists bool
	if err := c.db.QueryRowContext(ctx, `SELECT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = $1)`, c.cfg.Schema).Scan(&exists); err != nil {
		return fmt.Errorf("saga: looking for schema %s: %w", c.cfg.Schema, err)
	}
	if exists {
		return nil
	}
	// The name is validated: a lowercase identifier, safe to name as is.
	_, err := c.db.ExecContext(ctx, `CREATE SCHEMA IF NOT EXISTS `+c.cfg.Schema)
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && (pgErr.Code == pgerrcode.UniqueViolation || pgErr.Code == pgerrcode.DuplicateSchema) {
		err = nil // another process created it at the same moment
	}
	if err != nil {
		return fmt.Errorf("saga: creating schema %s: %w", c.cfg.Schema, err)
	}
	return nil
}
