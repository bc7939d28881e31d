package transport

import (
	"database/sql"
	"strings"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
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
		{`SELECT $1 /* it's $2 /* nested $3 */ still $4 */, $5`, 1, `SELECT $2 /* it's $2 /* nested $3 */ still $4 */, $6`},
		{`SELECT E'\'$1', $2, e'a\\', $3`, 1, `SELECT E'\'$1', $3, e'a\\', $4`},
		{`SELECT $$ $1 $$, $tag$ '$2 $tag$, $_x1$ $1 $_x1$, $3`, 2, `SELECT $$ $1 $$, $tag$ '$2 $tag$, $_x1$ $1 $_x1$, $5`},
		{`SELECT $a b, $1`, 1, `SELECT $a b, $2`},
		{`SELECT $$ unterminated $1`, 1, `SELECT $$ unterminated $1`},
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

func TestClassify(t *testing.T) {
	for q, want := range map[string]savepointCommand{
		"SAVEPOINT a":                          flushBefore,
		"  rollback to savepoint a":            discardAfter,
		"Release a":                            flushBefore,
		"ROLLBACK":                             discardAfter,
		"-- undo\nROLLBACK TO a":               discardAfter,
		"/* a /* nested */ one */ SAVEPOINT b": flushBefore,
		"\t\n/**/release savepoint c":          flushBefore,
		"SELECT 1":                             notSavepointCommand,
		"INSERT INTO savepoints":               notSavepointCommand,
		"savepoints_table":                     notSavepointCommand,
		"rollbacks":                            notSavepointCommand,
		"-- SAVEPOINT a":                       notSavepointCommand,
		"/* unterminated SAVEPOINT":            notSavepointCommand,
		"":                                     notSavepointCommand,
	} {
		assert.Equal(t, want, classify(q), q)
	}
}

// An attempt opens a savepoint only when none is open in its batch, and a
// handler still running in a batch that has been replaced (it outlived the
// ack deadline) can neither change the new batch's state nor make its old
// batch current again.
func TestSavepointStateFollowsTheCurrentBatch(t *testing.T) {
	s := &savepointState{}
	a, b := new(sql.Tx), new(sql.Tx)
	const begin = "BEGIN BATCH"

	q, err := s.begin(a, begin)
	require.NoError(t, err)
	assert.Equal(t, begin, q, "a new batch is bounded and opens the first savepoint")
	s.set(a, true)
	q, err = s.begin(a, begin)
	require.NoError(t, err)
	assert.Empty(t, q, "the savepoint the last attempt left open")
	s.set(a, false)
	q, _ = s.begin(a, begin)
	assert.Equal(t, openAttemptSQL, q, "after an abandoned attempt: a savepoint, no new bounds")

	q, _ = s.begin(b, begin)
	assert.Equal(t, begin, q)
	s.set(b, true)
	s.set(a, false) // the old batch's handler abandons late
	q, _ = s.begin(b, begin)
	assert.Empty(t, q, "no second savepoint in the new batch")
	_, err = s.begin(a, begin)
	assert.ErrorIs(t, err, errBatchReplaced)
	q, _ = s.begin(b, begin)
	assert.Empty(t, q, "the old batch did not become current again")

	// Under -race: the late handler and the new batch's attempts at once.
	var wg sync.WaitGroup
	for i := range 8 {
		wg.Go(func() {
			for range 200 {
				if i%2 == 0 {
					s.set(a, false)
					_, _ = s.begin(a, begin)
				} else {
					_, _ = s.begin(b, begin)
					s.set(b, true)
				}
			}
		})
	}
	wg.Wait()
	q, _ = s.begin(b, begin)
	assert.Empty(t, q)
}
