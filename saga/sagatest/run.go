package sagatest

import (
	"context"
	"database/sql"
	"io/fs"
	"log/slog"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgsaga/pgsaga/internal/testdb"
	"github.com/pgsaga/pgsaga/saga"
)

// Main runs the tests of a package that uses DB, with a PostgreSQL server,
// and exits: call it from the package's TestMain. The server is
// TEST_DATABASE_URL, else DATABASE_URL, else one answering at
// postgres://postgres@127.0.0.1:5432/postgres; with none, the tests fail
// saying how to get one (embeddedpg.Main starts an embedded server
// instead). Every database DB returns holds pgsaga's tables and those of
// schemas: your application's, from its own migrations.
func Main(m *testing.M, schemas ...Schema) {
	testdb.MainWith(m, testdb.Setup{}, testdb.Schemas(schemas)...)
}

// Schema is an application's tables, migrated into every test database
// besides pgsaga's: its migration files (their content names the template
// database the test databases are copied from, so a changed migration
// builds a new one) and the function that applies them.
type Schema struct {
	// Files are its migrations: the content of every file in it, at any
	// depth, names the template that holds them, so a change to any
	// builds a new one.
	Files fs.FS
	// Migrate applies them to a database.
	Migrate func(context.Context, *sql.DB) ([]int64, error)
}

// Database is a test's database: its name and URL, and a pgx pool with a
// database/sql handle over it (Pool, SQL).
type Database struct {
	// Name of the database.
	Name string
	// URL connects to it; give it to subprocesses.
	URL string
	// Pool and SQL share one pool, as in production.
	Pool *pgxpool.Pool
	SQL  *sql.DB
}

// DB returns a database of the test's own, with pgsaga's migrations and
// the schemas given to Main applied, dropped when the test ends. The package's TestMain must call
// Main.
func DB(t testing.TB) *Database {
	t.Helper()
	return (*Database)(testdb.Fresh(t))
}

// Run is one failure-recovery run in a test: faults injected into a
// client's deliveries, its workers stopped and replaced at random, and, at
// Finish, the sagas waited for and every invariant checked. What goes
// wrong fails the test; the run stops its workers when the test ends.
type Run struct {
	t        testing.TB
	db       *sql.DB
	injector *Injector
	churn    *Churn
	log      *slog.Logger
	finished bool
}

// New starts a run that injects faults into the deliveries of a client on
// db. Build the client with Intercept as its transport's
// (delivery.Config.Intercept), register what it serves, then Start.
func New(t testing.TB, db *sql.DB, faults Faults) *Run {
	t.Helper()
	log := Logger(t)
	inj, err := NewInjector(db, faults, log)
	if err != nil {
		t.Fatalf("sagatest: %v", err)
	}
	r := &Run{t: t, db: db, injector: inj, log: log}
	t.Cleanup(r.stop)
	return r
}

// Intercept injects the run's faults into a handler: the client's
// delivery.Config.Intercept.
func (r *Run) Intercept(handler string, h message.NoPublishHandlerFunc) message.NoPublishHandlerFunc {
	return r.injector.Intercept(handler, h)
}

// Start records what client consumes (Setup) and runs workers of its
// workers (default 2), each stopped after a while and replaced, until
// Finish or the test's end. A run starts once.
func (r *Run) Start(client *saga.Client, workers int) {
	r.t.Helper()
	if r.churn != nil || r.finished {
		r.t.Errorf("sagatest: Run.Start called twice, or after Finish; ignored")
		return
	}
	if err := client.Setup(context.Background()); err != nil {
		r.t.Fatalf("sagatest: setting the client up: %v", err)
	}
	if workers <= 0 {
		workers = 2
	}
	churn, err := StartChurn(ChurnConfig{Workers: workers, Seed: r.injector.cfg.Seed, Logger: r.log,
		New: func() (Worker, error) { return client.NewWorker() }})
	if err != nil {
		r.t.Fatalf("sagatest: %v", err)
	}
	r.churn = churn
}

// Finish waits up to timeout for every saga of ids to end, stops the
// workers and the faults, and checks the generic invariants of defs'
// sagas and the domain's: each broken invariant fails the test, with the
// rows that break it. It returns how many of the sagas ended in each
// status.
func (r *Run) Finish(timeout time.Duration, ids []uuid.UUID, defs []*saga.Definition, domain ...Invariant) map[saga.Status]int {
	r.t.Helper()
	ctx := context.Background()
	counts, err := WaitTerminal(ctx, r.db, ids, timeout)
	if err != nil {
		r.t.Errorf("%v", err)
	}
	r.stop()
	violations, err := Checker{DB: r.db, Definitions: defs, Domain: domain}.Check(ctx)
	if err != nil {
		r.t.Errorf("%v", err)
	}
	for _, v := range violations {
		r.t.Errorf("sagatest: invariant broken: %s", v)
	}
	return counts
}

// Stats is what the run's faults did so far.
func (r *Run) Stats() Stats { return r.injector.Stats() }

// stop stops the workers and the faults, once; the workers' errors fail
// the test.
func (r *Run) stop() {
	if r.finished {
		return
	}
	r.finished = true
	if r.churn != nil {
		if err := r.churn.Stop(); err != nil {
			r.t.Errorf("sagatest: the workers: %v", err)
		}
	}
	if err := r.injector.Close(); err != nil {
		r.t.Errorf("sagatest: the faults: %v", err)
	}
}
