package saga

import (
	"context"
	"testing"

	"github.com/google/uuid"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/internal/testdb"
)

// A batch preloads its instances up to a bound on their data (as stored),
// the first whatever its size: five instances of several MB each are not
// all held in memory at once (a batch used to load up to 50 whatever
// their size); the ones left out are read one by one.
func TestABatchPreloadsInstancesUpToAByteBound(t *testing.T) {
	t.Parallel()
	db := testdb.Fresh(t)
	var ids, commands []string
	for range 5 {
		id, command := uuid.New(), uuid.NewString()
		_, err := db.SQL.Exec(`INSERT INTO saga_instances (id, saga_type, definition_version, status, data, current_step, command_id)
			VALUES ($1, 'big', 1, 'running', jsonb_build_object('blob', (SELECT string_agg(md5(random()::text), '') FROM generate_series(1, 200000))), 0, $2)`,
			id, command)
		require.NoError(t, err)
		ids, commands = append(ids, id.String()), append(commands, command)
	}
	var loaded int
	require.NoError(t, db.SQL.QueryRowContext(context.Background(), `SELECT count(*) FROM (`+loadInstancesForCommandsSQL+`) AS l`, ids, commands).Scan(&loaded))
	assert.GreaterOrEqual(t, loaded, 1, "the first, whatever its size")
	assert.Less(t, loaded, 5, "not every instance of several MB")

	small := uuid.New()
	_, err := db.SQL.Exec(`INSERT INTO saga_instances (id, saga_type, definition_version, status, data, current_step, command_id)
		VALUES ($1, 'small', 1, 'running', '{}', 0, 'c')`, small)
	require.NoError(t, err)
	require.NoError(t, db.SQL.QueryRow(`SELECT count(*) FROM (`+loadInstancesForCommandsSQL+`) AS l`, []string{small.String()}, []string{"c"}).Scan(&loaded))
	assert.Equal(t, 1, loaded)
}
