// Package testpg runs pgsaga's own test packages on a PostgreSQL
// (internal/testdb), starting an embedded one when none is configured or
// answers on 127.0.0.1:5432: the first test process of a run starts it
// (port 54330, data in <user cache dir>/pgsaga/test-postgres, from the
// machine's PostgreSQL binaries, else downloaded once), the others share
// it, and it is left running for the next run (a second start would cost
// every run seconds); it stops with `pg_ctl stop -D <that dir>/data`. Like
// the sample's, it is its user's alone: a random superuser password in
// <that dir>/data/pgsaga-superuser-password, asked for by SCRAM (see
// internal/finddb). As root, where PostgreSQL cannot run, the tests fail
// with one sentence saying how to get a server; they never skip.
//
// It is apart from testdb so that the public test kit, which uses testdb,
// pulls no embedded server (nor lib/pq) into its users' builds.
//
//	func TestMain(m *testing.M) { testpg.Main(m) }
package testpg

import (
	"testing"

	"github.com/pgsaga/pgsaga/internal/finddb"
	"github.com/pgsaga/pgsaga/internal/testdb"
)

// Main runs the package's tests (testdb.MainWith) and exits, with the
// embedded server as the last resort.
func Main(m *testing.M, schemas ...testdb.Schema) {
	testdb.MainWith(m, testdb.Setup{Fallback: finddb.TestServer}, schemas...)
}

// MainOwnServer is Main on a server of the package's own where one can be
// started (testdb.Setup.OwnServer).
func MainOwnServer(m *testing.M, schemas ...testdb.Schema) {
	testdb.MainWith(m, testdb.Setup{Fallback: finddb.TestServer, OwnServer: true}, schemas...)
}
