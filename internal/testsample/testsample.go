// Package testsample holds the sample's tables for the test databases of
// the packages that test it: testpg.Main(m, testsample.Schemas()...).
package testsample

import (
	"github.com/pgsaga/pgsaga/internal/testdb"
	"github.com/pgsaga/pgsaga/orders"
	"github.com/pgsaga/pgsaga/payments"
)

// Schemas are the sample domains' tables.
func Schemas() []testdb.Schema {
	return []testdb.Schema{
		{Files: orders.Migrations(), Migrate: orders.Migrate},
		{Files: payments.Migrations(), Migrate: payments.Migrate},
	}
}
