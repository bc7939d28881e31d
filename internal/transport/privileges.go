package transport

import (
	"context"
	"fmt"

	pub "github.com/pgsaga/pgsaga/saga/delivery"
)

// Grant is what a role needs on one table: privileges as
// has_table_privilege takes them ("SELECT, INSERT, UPDATE, DELETE").
type Grant struct {
	Table      string
	Privileges string
}

// WorkerGrants are what a worker needs on the transport's tables. A
// worker also needs TEMPORARY on the database (the commit guard of every
// delivery connection is a temporary table).
var WorkerGrants = []Grant{
	{"pgsaga_queue", "SELECT, INSERT, UPDATE, DELETE"},
	{"pgsaga_dead_letters", "SELECT, INSERT, UPDATE, DELETE"},
	{"pgsaga_subscriptions", "SELECT, INSERT, UPDATE, DELETE"},
	{"pgsaga_settings", "SELECT, INSERT"}, // every start records the shared settings if missing (agreeSQL)
}

// PrivilegeError says which privileges a role lacks (package delivery).
type PrivilegeError = pub.PrivilegeError

// checkPrivilegesSQL lists, in one statement, what the role lacks among
// TEMPORARY on the database and the privileges ($1 tables, $2 privilege
// lists, one privilege at a time). A table that does not exist is
// skipped: the schema check says so.
const checkPrivilegesSQL = `SELECT current_user::text, missing FROM (
    SELECT 'TEMPORARY on database ' || current_database() AS missing, 0 AS ord
    WHERE NOT has_database_privilege(current_database(), 'TEMPORARY')
    UNION ALL
    SELECT p.priv || ' on ' || g.tbl, g.ord
    FROM unnest($1::text[], $2::text[]) WITH ORDINALITY AS g(tbl, privs, ord),
        LATERAL unnest(string_to_array(g.privs, ',')) AS p0(raw),
        LATERAL (SELECT btrim(p0.raw) AS priv) AS p
    WHERE to_regclass(g.tbl) IS NOT NULL AND NOT has_table_privilege(g.tbl, p.priv)
) AS m
RIGHT JOIN (SELECT) AS one ON true
ORDER BY ord`

// CheckPrivileges returns a *PrivilegeError if the transport's role lacks
// TEMPORARY on the database or any of grants (WorkerGrants and the
// caller's own), nil if it has them all.
func (t *Transport) CheckPrivileges(ctx context.Context, grants ...Grant) error {
	tables, privs := make([]string, len(grants)), make([]string, len(grants))
	for i, g := range grants {
		tables[i], privs[i] = g.Table, g.Privileges
	}
	rows, err := t.cfg.DB.QueryContext(ctx, checkPrivilegesSQL, tables, privs)
	if err != nil {
		return fmt.Errorf("transport: checking the role's privileges: %w", err)
	}
	defer rows.Close()
	pe := &PrivilegeError{}
	for rows.Next() {
		var missing *string
		if err := rows.Scan(&pe.Role, &missing); err != nil {
			return fmt.Errorf("transport: checking the role's privileges: %w", err)
		}
		if missing != nil {
			pe.Missing = append(pe.Missing, *missing)
		}
	}
	if err := rows.Err(); err != nil {
		return fmt.Errorf("transport: checking the role's privileges: %w", err)
	}
	if len(pe.Missing) > 0 {
		return pe
	}
	return nil
}
