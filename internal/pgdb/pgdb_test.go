package pgdb_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/internal/pgdb"
	"github.com/pgsaga/pgsaga/internal/testdb"
)

func TestMain(m *testing.M) { testdb.Main(m) }

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
