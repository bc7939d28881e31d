// Package sqlcheck holds what invariant checks in SQL share: a broken
// invariant with its rows, and the query that lists them. The test kit
// (saga/sagatest) and the sample's checks (saga/orderpayment) re-export it.
package sqlcheck

import (
	"context"
	"database/sql"
	"fmt"
	"strings"
)

// Violation is a broken invariant and the rows that break it.
type Violation struct {
	Invariant string
	Rows      []string
}

// String implements fmt.Stringer.
func (v Violation) String() string {
	if len(v.Rows) == 0 {
		return v.Invariant
	}
	return fmt.Sprintf("%s: %s", v.Invariant, strings.Join(v.Rows, "; "))
}

// Querier runs queries: a *sql.DB, *sql.Conn or *sql.Tx.
type Querier interface {
	QueryContext(ctx context.Context, query string, args ...any) (*sql.Rows, error)
}

// Rows runs a query returning one text column and returns its values
// (NULL as "").
func Rows(ctx context.Context, db Querier, query string, args ...any) ([]string, error) {
	rows, err := db.QueryContext(ctx, query, args...)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var out []string
	for rows.Next() {
		var s sql.NullString
		if err := rows.Scan(&s); err != nil {
			return nil, err
		}
		out = append(out, s.String)
	}
	return out, rows.Err()
}
