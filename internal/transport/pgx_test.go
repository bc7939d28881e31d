package transport_test

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/internal/testdb"
	"github.com/pgsaga/pgsaga/internal/transport"
)

// otherDriver is a database/sql driver that is not pgx.
type otherDriver struct{}

func (otherDriver) Open(string) (driver.Conn, error) { return nil, errors.New("not a real driver") }

type otherConnector struct{}

func (otherConnector) Connect(context.Context) (driver.Conn, error) {
	return nil, errors.New("not a real driver")
}
func (otherConnector) Driver() driver.Driver { return otherDriver{} }

// The transport works over pgx only (pipelined batches, LISTEN): a
// database/sql handle over another driver is refused by New, with the
// reason, instead of failing at the first delivery.
func TestNewRefusesAHandleThatIsNotPgx(t *testing.T) {
	t.Parallel()
	other := sql.OpenDB(otherConnector{})
	t.Cleanup(func() { _ = other.Close() })
	_, err := transport.New(transport.Config{DB: other})
	require.ErrorIs(t, err, transport.ErrNotPgx)

	// Both ways of opening pgx through database/sql are accepted.
	db := testdb.Shared(t)
	pool, err := pgxpool.New(context.Background(), db.URL)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	fromPool := stdlib.OpenDBFromPool(pool)
	t.Cleanup(func() { _ = fromPool.Close() })
	_, err = transport.New(transport.Config{DB: fromPool})
	require.NoError(t, err)
	_, err = transport.New(transport.Config{DB: db.SQL})
	require.NoError(t, err)
}
