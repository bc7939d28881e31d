package pgdb_test

import (
	"context"
	"testing"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/internal/pgdb"
	"github.com/pgsaga/pgsaga/internal/testdb"
	"github.com/pgsaga/pgsaga/internal/testpg"
)

func TestMain(m *testing.M) { testpg.Main(m) }

func TestOpenSharesOnePool(t *testing.T) {
	t.Parallel()
	db := testdb.Shared(t)
	h, err := pgdb.Open(context.Background(), pgdb.Config{URL: db.URL, MaxConns: 3})
	require.NoError(t, err)
	defer h.Close()

	// Connections held through database/sql come out of the pgx pool.
	conns := make([]interface{ Close() error }, 0, 3)
	for range 3 {
		c, err := h.SQL.Conn(context.Background())
		require.NoError(t, err)
		conns = append(conns, c)
	}
	assert.EqualValues(t, 3, h.Pool.Stat().AcquiredConns(), "database/sql draws from the same pool")
	for _, c := range conns {
		require.NoError(t, c.Close())
	}

	var name string
	require.NoError(t, h.SQL.QueryRow("SELECT current_setting('application_name')").Scan(&name))
	assert.Equal(t, "pgsaga", name)
}

func TestOpenErrors(t *testing.T) {
	t.Setenv(pgdb.EnvURL, "")
	_, err := pgdb.Open(context.Background(), pgdb.Config{URL: "", MaxConns: 4})
	require.ErrorIs(t, err, pgdb.ErrNoURL)
	_, err = pgdb.Open(context.Background(), pgdb.Config{URL: "postgres://x:secret@127.0.0.1:1/db", MaxConns: 4})
	require.Error(t, err)
	assert.NotContains(t, err.Error(), "secret")
	assert.Contains(t, err.Error(), "connecting to database db as x on 127.0.0.1:1")
	_, err = pgdb.Connect(context.Background(), "postgres://x:secret@127.0.0.1:1/db")
	require.Error(t, err)
	assert.NotContains(t, err.Error(), "secret")
	assert.Contains(t, err.Error(), "connecting to database db as x on 127.0.0.1:1")
	_, err = pgdb.Connect(context.Background(), "postgres://x:sec/ret@127.0.0.1:1/db")
	require.ErrorIs(t, err, pgdb.ErrUnparseable)
	assert.NotContains(t, err.Error(), "sec")
	_, err = pgdb.Open(context.Background(), pgdb.Config{URL: "postgres://h/db", MaxConns: 1})
	require.ErrorContains(t, err, "MaxConns")
}

// A google/uuid value is encoded as the 16 bytes it is. Without the pool's
// encode plan, pgx takes it as a driver.Valuer: its text, an encode error
// for the binary format, a scan of the text and a second encode, for every
// uuid argument of every statement. (Not parallel: AllocsPerRun counts
// the process's allocations.)
func TestOpenEncodesUUIDsDirectly(t *testing.T) {
	db := testdb.Shared(t)
	h, err := pgdb.Open(context.Background(), pgdb.Config{URL: db.URL, MaxConns: 2})
	require.NoError(t, err)
	defer h.Close()
	c, err := h.Pool.Acquire(context.Background())
	require.NoError(t, err)
	defer c.Release()
	m := c.Conn().TypeMap()
	id := uuid.New()
	buf := make([]byte, 0, 64)
	got, err := m.Encode(pgtype.UUIDOID, pgtype.BinaryFormatCode, id, buf)
	require.NoError(t, err)
	assert.Equal(t, id[:], got)
	allocs := testing.AllocsPerRun(50, func() {
		_, _ = m.Encode(pgtype.UUIDOID, pgtype.BinaryFormatCode, id, buf)
	})
	assert.LessOrEqual(t, allocs, 2.0, "allocations to encode a uuid.UUID argument (20 through driver.Valuer)")

	var back uuid.UUID
	require.NoError(t, h.SQL.QueryRow(`SELECT $1::uuid`, id).Scan(&back), "database/sql still scans uuid.UUID")
	assert.Equal(t, id, back)
}
