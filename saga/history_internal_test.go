package saga

import (
	"context"
	"testing"

	"github.com/google/uuid"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/internal/dbtx"
	"github.com/pgsaga/pgsaga/internal/testdb"
)

// One statement appends the timelines of several sagas, as a batch writes
// them: each saga's entries are numbered after its last one, in the order
// they were queued, whatever the other sagas' entries between them.
func TestTimelinesOfSeveralSagasInOneStatement(t *testing.T) {
	t.Parallel()
	db := testdb.Shared(t)
	ctx := context.Background()
	a, b := uuid.New(), uuid.New()
	for _, id := range []uuid.UUID{a, b} {
		_, err := db.SQL.Exec(`INSERT INTO saga_instances (id, saga_type, definition_version, status, data, current_step) VALUES ($1, 'history-test', 1, 'running', '{}', 0)`, id)
		require.NoError(t, err)
	}
	require.NoError(t, appendHistory(ctx, db.SQL, a, []historyEntry{{Kind: "a1"}, {Kind: "a2"}}))
	row := func(id uuid.UUID, kind string) []any {
		return []any{id.String(), kind, "", "", int32(0), "", "", ""}
	}
	require.NoError(t, dbtx.WriteBatched(ctx, db.SQL, historyWrite, row(b, "b1"), row(a, "a3"), row(b, "b2"), row(a, "a4"), row(b, "b3")))

	timeline := func(id uuid.UUID) []string {
		rows, err := db.SQL.Query(`SELECT kind FROM saga_history WHERE saga_id = $1 ORDER BY seq`, id)
		require.NoError(t, err)
		defer rows.Close()
		var kinds []string
		for rows.Next() {
			var k string
			require.NoError(t, rows.Scan(&k))
			kinds = append(kinds, k)
		}
		require.NoError(t, rows.Err())
		return kinds
	}
	assert.Equal(t, []string{"a1", "a2", "a3", "a4"}, timeline(a))
	assert.Equal(t, []string{"b1", "b2", "b3"}, timeline(b))
}
