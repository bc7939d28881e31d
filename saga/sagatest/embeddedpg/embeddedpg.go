// Package embeddedpg is sagatest.Main with an embedded PostgreSQL as the
// last resort, for test suites that must run on a machine with no server:
//
//	func TestMain(m *testing.M) { embeddedpg.Main(m, mySchema) }
//
// It looks for a server as sagatest.Main does (TEST_DATABASE_URL, then
// DATABASE_URL, then 127.0.0.1:5432); when none is configured or answers,
// the first test process of the run starts an embedded PostgreSQL (from
// the machine's PostgreSQL binaries, else downloaded once) on port 54330,
// with its data in <user cache dir>/pgsaga/test-postgres; the run's other
// test processes share it, and it is left running for the next run (stop
// it with `pg_ctl stop -D <that dir>/data`). It is its user's alone: a
// random superuser password in <that dir>/data/pgsaga-superuser-password
// (0600), asked for by SCRAM. PostgreSQL refuses to run as root: as root
// with no server, the tests fail saying so.
//
// It is a package of its own so that sagatest alone pulls no embedded
// server into a test build: importing it adds
// github.com/fergusstrange/embedded-postgres and github.com/lib/pq.
package embeddedpg

import (
	"testing"

	"github.com/pgsaga/pgsaga/internal/finddb"
	"github.com/pgsaga/pgsaga/internal/testdb"
	"github.com/pgsaga/pgsaga/saga/sagatest"
)

// Main runs the package's tests, as sagatest.Main does, and exits; with no
// server configured or answering on 127.0.0.1:5432 it starts the embedded
// one (see the package documentation).
func Main(m *testing.M, schemas ...sagatest.Schema) {
	testdb.MainWith(m, testdb.Setup{Fallback: finddb.TestServer}, testdb.Schemas(schemas)...)
}
