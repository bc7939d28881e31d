package transport

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
)

func TestAppendRenumbered(t *testing.T) {
	for _, c := range []struct {
		in     string
		offset int
		want   string
	}{
		{`SELECT $1, $2`, 0, `SELECT $1, $2`},
		{`SELECT $1, $12`, 3, `SELECT $4, $15`},
		{`INSERT INTO "watermill_a$1" VALUES ($1, 'it''s $2', $3)`, 10, `INSERT INTO "watermill_a$1" VALUES ($11, 'it''s $2', $13)`},
		{"SELECT $1 -- not $2\n, $2", 1, "SELECT $2 -- not $2\n, $3"},
		{`SELECT '$1'`, 5, `SELECT '$1'`},
		{`SELECT $a, $`, 5, `SELECT $a, $`},
		{`SELECT 'unterminated $1`, 5, `SELECT 'unterminated $1`},
	} {
		var b strings.Builder
		appendRenumbered(&b, c.in, c.offset)
		assert.Equal(t, c.want, b.String(), c.in)
	}
}

func TestComposeStatements(t *testing.T) {
	q, args := composeStatements([]deferredStmt{
		{query: `INSERT INTO t VALUES ($1, $2)`, args: []any{"a", 1}},
		{query: `SELECT pg_notify($1, $2)`, args: []any{"c", "p"}},
	}, "RELEASE SAVEPOINT x")
	assert.Equal(t, "INSERT INTO t VALUES ($1, $2);\nSELECT pg_notify($3, $4);\nRELEASE SAVEPOINT x", q)
	assert.Len(t, args, 5, "the exec mode, then the arguments in order")
	assert.Equal(t, []any{"a", 1, "c", "p"}, args[1:])
}

func TestIsSavepointCommand(t *testing.T) {
	for q, want := range map[string]bool{
		"SAVEPOINT a":               true,
		"  rollback to savepoint a": true,
		"Release a":                 true,
		"ROLLBACK":                  true,
		"SELECT 1":                  false,
		"INSERT INTO savepoints":    false,
		"":                          false,
	} {
		assert.Equal(t, want, isSavepointCommand(q), q)
	}
}
