package orderpayment_test

import (
	"context"
	"io/fs"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/internal/testdb"
	"github.com/pgsaga/pgsaga/orders"
	"github.com/pgsaga/pgsaga/payments"
	"github.com/pgsaga/pgsaga/saga/orderpayment"
)

// A database migrated by an earlier release holds the sample's tables,
// created by pgsaga's own versions 3 and 4, with rows: Migrate adopts
// them as they are, rows and all, and runs again with nothing to do.
func TestMigrateAdoptsTheSampleTablesOfAnEarlierRelease(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.Empty(t)
	// The earlier release: pgsaga's migrations, its versions 3 and 4 as
	// they were (the sample's first migrations without IF NOT EXISTS).
	_, err := orderpayment.Migrate(ctx, db.SQL) // brings the library's tables
	require.NoError(t, err)
	_, err = db.SQL.ExecContext(ctx, `DROP TABLE charge_fences, account_postings, accounts, order_views, customers;
		DROP TABLE orders_schema_version, payments_schema_version`)
	require.NoError(t, err)
	for name, files := range map[string]fs.FS{"00001_orders.sql": orders.Migrations(), "00001_payments.sql": payments.Migrations()} {
		b, err := fs.ReadFile(files, name)
		require.NoError(t, err)
		up := strings.SplitN(strings.SplitN(string(b), "-- +goose Down", 2)[0], "-- +goose Up", 2)[1]
		old := strings.NewReplacer(" IF NOT EXISTS", "").Replace(up)
		require.NotContains(t, old, "IF NOT EXISTS")
		_, err = db.SQL.ExecContext(ctx, old)
		require.NoError(t, err)
	}
	_, err = db.SQL.ExecContext(ctx, `INSERT INTO customers (customer_id, name) VALUES ('c-1', 'Ada');
		INSERT INTO accounts (account_id) VALUES ('c-1')`)
	require.NoError(t, err)

	applied, err := orders.Migrate(ctx, db.SQL)
	require.NoError(t, err, "the orders tables are adopted")
	assert.Equal(t, []int64{1}, applied)
	applied, err = payments.Migrate(ctx, db.SQL)
	require.NoError(t, err, "the payments tables are adopted")
	assert.Equal(t, []int64{1}, applied)
	var n int
	require.NoError(t, db.SQL.QueryRowContext(ctx, `SELECT (SELECT count(*) FROM customers) + (SELECT count(*) FROM accounts)`).Scan(&n))
	assert.Equal(t, 2, n, "the rows are kept")

	applied, err = orderpayment.Migrate(ctx, db.SQL)
	require.NoError(t, err)
	assert.Empty(t, applied, "nothing left to apply")
}
