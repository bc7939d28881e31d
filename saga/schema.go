package saga

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"regexp"
	"strings"

	"github.com/jackc/pgerrcode"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/pgsaga/pgsaga/internal/transport"
	"github.com/pgsaga/pgsaga/saga/delivery"
)

// schemaName is what ClientConfig.Schema takes: a lowercase name, which a
// search_path names as it is (CREATE SCHEMA quotes it, so a keyword such
// as order is one too).
var schemaName = regexp.MustCompile(`^[a-z_][a-z0-9_]{0,62}$`)

func validateSchema(schema string) error {
	if !schemaName.MatchString(schema) || strings.HasPrefix(schema, "pg_") || schema == "information_schema" {
		return fmt.Errorf("Schema %q must be 1 to 63 characters from [a-z0-9_], not starting with a digit, and not pg_… or information_schema", schema)
	}
	return nil
}

// schemaSQL reads, for the Schema $1 and the tables $2, the connection's
// current schema, whether $1 exists and the role may use it, and each
// table of $2 that does not resolve into $1 (with the schema it resolves
// into, NULL if none): a search path falls through to the next schema for
// a table the first lacks.
const schemaSQL = `SELECT current_schema(),
    (SELECT has_schema_privilege(oid, 'USAGE') FROM pg_namespace WHERE nspname = $1),
    t.tbl, n.nspname
FROM (SELECT) AS one
LEFT JOIN (unnest($2::text[]) AS t(tbl)
    LEFT JOIN pg_class r ON r.oid = to_regclass(t.tbl)
    LEFT JOIN pg_namespace n ON n.oid = r.relnamespace) ON n.nspname IS DISTINCT FROM $1`

// schemaTables are the tables checkSchema looks for: every table a worker
// uses (those it needs privileges on).
func schemaTables() []string {
	var tables []string
	for _, g := range append(append([]transport.Grant(nil), transport.WorkerGrants...), workerGrants...) {
		tables = append(tables, g.Table)
	}
	return tables
}

// checkSchema returns ErrSchemaNotOnPath if the client has a Schema and
// q's connection resolves names elsewhere: its current schema is another,
// or (tables) a table a worker uses resolves into another schema or none
// (the schema created but not migrated, or migrated by an older version,
// beside an installation in public). q is the client's pool, or a
// caller's transaction.
func (c *Client) checkSchema(ctx context.Context, q delivery.DBTX, tables bool) error {
	schema := c.cfg.Schema
	if schema == "" {
		return nil
	}
	var names []string
	if tables {
		names = schemaTables()
	}
	rows, err := q.QueryContext(ctx, schemaSQL, schema, names)
	if err != nil {
		return fmt.Errorf("saga: reading the connection's current schema: %w", err)
	}
	defer rows.Close()
	var (
		current        sql.NullString
		usable         sql.NullBool
		missing, found []string
	)
	for rows.Next() {
		var tbl, in sql.NullString
		if err := rows.Scan(&current, &usable, &tbl, &in); err != nil {
			return fmt.Errorf("saga: reading the connection's current schema: %w", err)
		}
		switch {
		case !tbl.Valid:
		case in.Valid:
			found = append(found, in.String+"."+tbl.String)
		default:
			missing = append(missing, tbl.String)
		}
	}
	if err := rows.Err(); err != nil {
		return fmt.Errorf("saga: reading the connection's current schema: %w", err)
	}
	if current.String != schema {
		now := "none: no schema of its search_path exists or may be used"
		if current.Valid {
			now = fmt.Sprintf("%q", current.String)
		}
		if usable.Valid && !usable.Bool {
			return fmt.Errorf("%w: the role may not use schema %q (GRANT USAGE ON SCHEMA %s TO …); the connection's current schema is %s",
				ErrSchemaNotOnPath, schema, pgx.Identifier{schema}.Sanitize(), now)
		}
		return fmt.Errorf("%w: ClientConfig.Schema is %q, the connection's current schema is %s; set the search_path of every connection pgsaga uses, the pool's and those of the transactions you give it (pgxpool.Config.ConnConfig.RuntimeParams[\"search_path\"] = %q)",
			ErrSchemaNotOnPath, schema, now, schema+", public")
	}
	if len(found)+len(missing) > 0 {
		return fmt.Errorf("%w: schema %q lacks tables of this version of pgsaga (%s); run Migrate",
			ErrSchemaNotOnPath, schema, strings.Join(append(found, missing...), ", "))
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
	_, err := c.db.ExecContext(ctx, `CREATE SCHEMA IF NOT EXISTS `+pgx.Identifier{c.cfg.Schema}.Sanitize())
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && (pgErr.Code == pgerrcode.UniqueViolation || pgErr.Code == pgerrcode.DuplicateSchema) {
		err = nil // another process created it at the same moment
	}
	if err != nil {
		return fmt.Errorf("saga: creating schema %s: %w", c.cfg.Schema, err)
	}
	return nil
}
