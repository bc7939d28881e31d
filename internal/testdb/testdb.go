// Package testdb gives each test package an isolated, migrated PostgreSQL
// database, fast.
//
// The first test process to need it builds a template database with every
// migration applied (named after a hash of the migration files, so a schema
// change builds a new one); each package then gets CREATE DATABASE … TEMPLATE
// of it, which takes tens of milliseconds. Databases it creates are dropped
// when the package's tests end.
//
// The server is TEST_DATABASE_URL, then DATABASE_URL, then one answering
// at postgres://postgres@127.0.0.1:5432/postgres, then what the Setup's
// Fallback gives: pgsaga's own tests start an embedded server
// (internal/testpg); the public kit (saga/sagatest) has none, so that its
// import pulls no embedded server into a user's test build, and fails
// saying how to get a server (saga/sagatest/embeddedpg adds the embedded
// one for those who want it).
//
// Use it from TestMain:
//
//	func TestMain(m *testing.M) { testpg.Main(m) }
//
//	func TestSomething(t *testing.T) {
//		db := testdb.Shared(t) // the package's database
//		...
//	}
package testdb

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"database/sql"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"net/url"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgerrcode"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgsaga/pgsaga/internal/pgbin"
	"github.com/pgsaga/pgsaga/internal/pgdb"
	"github.com/pgsaga/pgsaga/internal/pgerr"
	"github.com/pgsaga/pgsaga/migrations"
)

// DefaultURL is the server tried when neither TEST_DATABASE_URL nor
// DATABASE_URL is set; it matches docker-compose.yml.
const DefaultURL = "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable"

// NoSafetyPoll is the transport.Config.IdlePollInterval of tests: so long
// that a lost wake-up fails the test at its wait deadline instead of being
// hidden by the safety poll (10 s by default).
const NoSafetyPoll = time.Hour

const (
	templatePrefix = "pgsaga_tpl_"
	testPrefix     = "pgsaga_test_"
	// A test database older than this is left over from a killed run.
	staleAfter = 2 * time.Hour
	// Advisory lock that serialises template builds across test processes.
	templateLockID int64 = 0x7067736167610003
)

// DB is one test database.
type DB struct {
	// Name of the database.
	Name string
	// URL connects to it; give it to subprocesses.
	URL string
	// Pool and SQL share one pool, as in production.
	Pool *pgxpool.Pool
	SQL  *sql.DB
}

var (
	mu      sync.Mutex
	server  string // admin URL of the server
	shared  *DB
	mainRan bool

	tplMu    sync.Mutex
	template string // name of the migrated template, once known

	schemas []Schema // the applications' tables, set by Main
)

// Schema is an application's tables (the sample's, a user's), migrated
// into every test database besides pgsaga's own.
type Schema struct {
	// Files are its migrations: the content of every file in it, at any
	// depth, names the template that holds them, so a change to any
	// builds a new one.
	Files fs.FS
	// Migrate applies them to a database.
	Migrate func(context.Context, *sql.DB) ([]int64, error)
}

// Schemas converts the kit's schemas (sagatest.Schema, a struct of the
// same fields) to Schema.
func Schemas[S ~struct {
	Files   fs.FS
	Migrate func(context.Context, *sql.DB) ([]int64, error)
}](s []S) []Schema {
	out := make([]Schema, len(s))
	for i, sc := range s {
		out[i] = Schema(sc)
	}
	return out
}

// Setup is how MainWith finds and uses a server.
type Setup struct {
	// Fallback returns the admin URL of a server to test on when neither
	// TEST_DATABASE_URL, DATABASE_URL nor 127.0.0.1:5432 gives one (an
	// embedded server: see internal/testpg). Nil: the tests fail, saying
	// how to get a server.
	Fallback func(ctx context.Context) (adminURL string, err error)
	// OwnServer tests on a server of the package's own where the
	// machine's PostgreSQL server binaries are installed, for packages
	// whose tests load a server as much as its other users will let them
	// (benchmark runs that take most of its connections and hold
	// server-wide turns): see StartPrivate (max_connections 200); it is
	// removed when the tests end. The package's turns then stop no other
	// package's tests: with every package on one server, sagabench's turns
	// and the sample's tests took turns, and the two packages together
	// outlasted go test's ten minutes at -count=3. Where no server can be
	// started it says why, in one line, and uses the run's server.
	OwnServer bool
}

// MainWith runs the package's tests with a database server and exits.
// Call it from TestMain (pgsaga's own packages call testpg.Main, the kit's
// users sagatest.Main). Every migrated database (Shared, Fresh,
// ForExample) holds pgsaga's tables and those of schemas.
func MainWith(m *testing.M, setup Setup, schemas ...Schema) {
	setSchemas(schemas)
	os.Exit(run(m, setup))
}

func setSchemas(s []Schema) {
	for _, sc := range s {
		if sc.Files == nil || sc.Migrate == nil {
			fmt.Fprintln(os.Stderr, "testdb: a Schema needs Files and Migrate")
			os.Exit(2)
		}
	}
	tplMu.Lock()
	schemas = s
	tplMu.Unlock()
}

func run(m *testing.M, setup Setup) int {
	ctx := context.Background()
	srv, err := findServer(ctx, setup.Fallback)
	if err != nil {
		sayOnce(err)
		return 1
	}
	if setup.OwnServer {
		if bin := pgbin.Find(); bin == "" {
			fmt.Fprintln(os.Stderr, "testdb: no PostgreSQL server binaries to start a server of the package's own (pg_config --bindir, /usr/lib/postgresql/*/bin); testing on the run's server, taking turns")
		} else if own, err := startPrivate(bin, nil); err != nil {
			fmt.Fprintf(os.Stderr, "testdb: could not start a server of the package's own (%s); testing on the run's server, taking turns\n", oneLine(err))
		} else {
			defer own.remove()
			srv = own.URL
		}
	}
	mu.Lock()
	server, mainRan = srv, true
	mu.Unlock()
	dropStale(ctx, srv)

	code := m.Run()
	closeShare()

	mu.Lock()
	db := shared
	shared = nil
	mu.Unlock()
	if db != nil {
		db.close()
		if err := dropDatabase(ctx, srv, db.Name); err != nil {
			fmt.Fprintf(os.Stderr, "testdb: dropping %s: %v\n", db.Name, err)
		}
	}
	return code
}

// ServerURL is the admin URL of the server the tests use (see the package
// documentation), once Main has found it.
func ServerURL() string {
	mu.Lock()
	defer mu.Unlock()
	if server != "" {
		return server
	}
	if v := envURL(); v != "" {
		return v
	}
	return DefaultURL
}

func envURL() string {
	for _, env := range []string{"TEST_DATABASE_URL", pgdb.EnvURL} {
		if v := os.Getenv(env); v != "" {
			return v
		}
	}
	return ""
}

// findServer returns the admin URL of the server to test on.
func findServer(ctx context.Context, fallback func(context.Context) (string, error)) (string, error) {
	if v := envURL(); v != "" {
		if err := ping(ctx, v); err != nil {
			return "", fmt.Errorf("no PostgreSQL answered for %s (%s), the server TEST_DATABASE_URL or DATABASE_URL names; start it or unset the variable", pgdb.Describe(v), oneLine(err))
		}
		return v, nil
	}
	if err := ping(ctx, DefaultURL); err == nil {
		return DefaultURL, nil
	} else if fallback == nil {
		return "", fmt.Errorf("no PostgreSQL to test on: TEST_DATABASE_URL and DATABASE_URL are unset and none answered at %s (%s); start one or set TEST_DATABASE_URL (saga/sagatest/embeddedpg.Main starts an embedded one instead)", pgdb.Describe(DefaultURL), oneLine(err))
	}
	return fallback(ctx)
}

// underGoCommand reports whether this test binary is a child of the go
// command (go test), where one run shares a parent; where that cannot be
// told, it is not.
func underGoCommand() bool {
	comm, err := os.ReadFile(fmt.Sprintf("/proc/%d/comm", os.Getppid()))
	return err == nil && strings.TrimSpace(string(comm)) == "go"
}

// runID names this `go test` run: the go command's process id and, where
// /proc tells it, its start time, so that a later run given the same id by
// the system is told apart.
func runID() string {
	ppid := os.Getppid()
	id := strconv.Itoa(ppid)
	if stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", ppid)); err == nil {
		// Fields after the command name, which is in parentheses and may
		// hold spaces; the start time is field 22 of the line.
		if i := strings.LastIndexByte(string(stat), ')'); i >= 0 {
			if f := strings.Fields(string(stat)[i+1:]); len(f) > 19 {
				id += "-" + f[19]
			}
		}
	}
	return id
}

// sayOnce prints why the tests have no server, once for the whole `go test`
// run, in which every package fails: each package's test process is a child
// of the go command, so the first to say it leaves a mark under the go
// command's process id, and the others print a line pointing to it.
func sayOnce(err error) {
	if !underGoCommand() {
		fmt.Fprintf(os.Stderr, "\ntestdb: %v\n\n", err) // run directly: nobody said it before
		return
	}
	mark := filepath.Join(os.TempDir(), "pgsaga-testdb-"+runID())
	f, ferr := os.OpenFile(mark, os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o600)
	if ferr != nil {
		fmt.Fprintln(os.Stderr, "testdb: no PostgreSQL to test on (why: see the first failing package)")
		return
	}
	_ = f.Close()
	fmt.Fprintf(os.Stderr, "\ntestdb: %v\n\n", err)
}

// Shared returns the package's migrated database, creating it on first use.
// Tests that share it must keep their rows apart (unique keys, topics, ids).
func Shared(t testing.TB) *DB {
	t.Helper()
	shareServer(t)
	db, err := sharedDB()
	if err != nil {
		t.Fatalf("testdb: %v", err)
	}
	return db
}

// ForExample returns the package's database for runnable examples, which
// have no testing.T; it panics if there is none.
func ForExample() *DB {
	db, err := sharedDB()
	if err != nil {
		panic("testdb: " + err.Error())
	}
	return db
}

func sharedDB() (*DB, error) {
	mu.Lock()
	defer mu.Unlock()
	if !mainRan {
		return nil, errors.New("call testpg.Main(m) (or sagatest.Main) from the package's TestMain")
	}
	if shared == nil {
		db, err := create(context.Background(), true)
		if err != nil {
			return nil, err
		}
		shared = db
	}
	return shared, nil
}

// Fresh returns a migrated database of the test's own, dropped when the test ends.
func Fresh(t testing.TB) *DB {
	t.Helper()
	return own(t, true)
}

// Empty returns an unmigrated database of the test's own, dropped when the test ends.
func Empty(t testing.TB) *DB {
	t.Helper()
	return own(t, false, "")
}

// Custom returns an unmigrated database of the test's own created with the
// given options of CREATE DATABASE (an encoding, say), dropped when the test
// ends.
func Custom(t testing.TB, options string) *DB {
	t.Helper()
	return own(t, false, options)
}

func own(t testing.TB, migrated bool, options ...string) *DB {
	mu.Lock()
	requireMain(t)
	mu.Unlock()
	shareServer(t)
	db, err := create(context.Background(), migrated, options...)
	if err != nil {
		t.Fatalf("testdb: %v", err)
	}
	t.Cleanup(func() {
		db.close()
		if err := dropDatabase(context.Background(), server, db.Name); err != nil {
			t.Errorf("testdb: dropping %s: %v", db.Name, err)
		}
	})
	return db
}

func requireMain(t testing.TB) {
	if !mainRan {
		t.Fatalf("testdb: call testpg.Main(m) (or sagatest.Main) from the package's TestMain")
	}
}

// serverWideLockID is the advisory lock tests that act on the whole server
// take turns on.
const serverWideLockID int64 = 0x7067736167610004

// ServerWide makes the test wait its turn among tests, in every package of
// the run, that do something the whole server feels (hold a long
// transaction, restart a server, saturate it), and holds the turn until the
// test ends. The turn begins once the other packages' tests under way have
// ended, and none of theirs starts until it ends (see share.go); the
// package's own tests go on beside it.
func ServerWide(t testing.TB) {
	t.Helper()
	holdTurn(t, serverConn(t))
}

// serverConn is a connection of its own to the run's server; the caller
// closes it.
func serverConn(t testing.TB) *pgx.Conn {
	t.Helper()
	mu.Lock()
	requireMain(t)
	srv := server
	mu.Unlock()
	conn, err := connect(context.Background(), srv)
	if err != nil {
		t.Fatalf("testdb: connecting to %s: %v", pgdb.Describe(srv), err)
	}
	return conn
}

// FreeConnections waits, up to three minutes, until the server has n
// connections free (max_connections less those open and three spare, as
// sagabench counts before a run), for a test that runs a program that
// checks so. Take the server-wide turn first: the tests that take turns
// then hold none, and the other tests of the run come and go.
func FreeConnections(t testing.TB, n int) {
	t.Helper()
	ctx := context.Background()
	conn := serverConn(t)
	defer conn.Close(ctx)
	deadline := time.Now().Add(3 * time.Minute)
	for {
		var free int
		if err := conn.QueryRow(ctx, `SELECT current_setting('max_connections')::int - (SELECT count(*) FROM pg_stat_activity) - 3`).Scan(&free); err != nil {
			t.Fatalf("testdb: counting free connections: %v", err)
		}
		if free >= n {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("testdb: waited 3 minutes for %d free connections; %d are", n, free)
		}
		time.Sleep(100 * time.Millisecond) // other tests' connections, not this test's work
	}
}

// LongWriteElsewhere takes the server-wide turn, then opens a write
// transaction in a new empty database of the same server and keeps it open
// until the test ends. It returns a function that reports whether that
// transaction is still open, for tests to prove it was open throughout.
func LongWriteElsewhere(t testing.TB) (stillOpen func() bool) {
	t.Helper()
	ServerWide(t)
	other := Empty(t)
	long, err := other.SQL.Begin()
	if err != nil {
		t.Fatalf("testdb: beginning the long transaction: %v", err)
	}
	t.Cleanup(func() { _ = long.Rollback() })
	var xid string
	if _, err := long.Exec(`CREATE TABLE nightly_report (x int); INSERT INTO nightly_report VALUES (1)`); err != nil {
		t.Fatalf("testdb: writing in the long transaction: %v", err)
	}
	if err := long.QueryRow(`SELECT pg_current_xact_id()::text`).Scan(&xid); err != nil {
		t.Fatalf("testdb: reading the long transaction's id: %v", err)
	}
	return func() bool {
		var open bool
		if err := other.SQL.QueryRow(`SELECT EXISTS (SELECT FROM pg_stat_activity WHERE backend_xid::text = $1)`, xid).Scan(&open); err != nil {
			t.Fatalf("testdb: looking for the long transaction: %v", err)
		}
		return open
	}
}

// LimitedRole creates a role that may hold at most limit connections at
// once (see Role) and returns a URL for its database.
func LimitedRole(t testing.TB, limit int) string {
	t.Helper()
	return Role(t, limit, randomHex(12))
}

// Role creates a role with password (any text that does not look like a
// stored hash: md5… or SCRAM-SHA-256$…) that may create databases
// and hold at most limit connections at once (-1: no limit), owning a
// fresh empty database, and returns a URL for that database as that role.
// The password makes it work on servers that trust local connections and
// on those that ask (the embedded one). The role and every database it
// owns go when the test ends.
func Role(t testing.TB, limit int, password string) string {
	t.Helper()
	ctx := context.Background()
	srv := ServerURL()
	admin, err := connect(ctx, srv)
	if err != nil {
		t.Fatalf("testdb: connecting to %s: %v", pgdb.Describe(srv), err)
	}
	t.Cleanup(func() { _ = admin.Close(context.Background()) })
	role := "pgsaga_test_role_" + randomHex(4)
	// The server quotes the password (format's %L), whatever its settings.
	var create string
	if err := admin.QueryRow(ctx, `SELECT format('CREATE ROLE %I LOGIN CREATEDB CONNECTION LIMIT %s PASSWORD %L', $1::text, $2::int, $3::text)`,
		role, limit, password).Scan(&create); err != nil {
		t.Fatalf("testdb: quoting role %s: %v", role, err)
	}
	if _, err := admin.Exec(ctx, create); err != nil {
		t.Fatalf("testdb: creating role %s: %v", role, err)
	}
	t.Cleanup(func() {
		ctx := context.Background()
		rows, _ := admin.Query(ctx, `SELECT datname FROM pg_database WHERE datdba = (SELECT oid FROM pg_roles WHERE rolname = $1)`, role)
		owned, _ := pgx.CollectRows(rows, pgx.RowTo[string])
		for _, db := range owned {
			_, _ = admin.Exec(ctx, "DROP DATABASE IF EXISTS "+pgx.Identifier{db}.Sanitize()+" WITH (FORCE)")
		}
		if _, err := admin.Exec(ctx, "DROP ROLE "+pgx.Identifier{role}.Sanitize()); err != nil {
			t.Errorf("testdb: dropping role %s: %v", role, err)
		}
	})
	db := Empty(t) // dropped before the role: cleanups run last first
	if _, err := admin.Exec(ctx, "ALTER DATABASE "+pgx.Identifier{db.Name}.Sanitize()+" OWNER TO "+pgx.Identifier{role}.Sanitize()); err != nil {
		t.Fatalf("testdb: giving %s to %s: %v", db.Name, role, err)
	}
	cfg, err := pgx.ParseConfig(srv)
	if err != nil {
		t.Fatalf("testdb: %v", err)
	}
	u := url.URL{Scheme: "postgres", User: url.UserPassword(role, password), Host: fmt.Sprintf("%s:%d", cfg.Host, cfg.Port),
		Path: "/" + db.Name, RawQuery: "sslmode=disable"}
	return u.String()
}

// Keywords is the keyword/value form of connURL without its password
// ("host=… port=… user=… dbname=… sslmode=disable"), for tests of how a
// program handles that form; append a password as the test needs.
func Keywords(t testing.TB, connURL string) string {
	t.Helper()
	cfg, err := pgx.ParseConfig(connURL)
	if err != nil {
		t.Fatalf("testdb: %v", err)
	}
	return fmt.Sprintf("host=%s port=%d user=%s dbname=%s sslmode=disable", cfg.Host, cfg.Port, cfg.User, cfg.Database)
}

// WithoutPassword is connURL with no password in its user info.
func WithoutPassword(t testing.TB, connURL string) string {
	t.Helper()
	u, err := url.Parse(connURL)
	if err != nil {
		t.Fatalf("testdb: %v", err)
	}
	u.User = url.User(u.User.Username())
	return u.String()
}

// Open connects to the database at url with a pool of at most maxConns.
// Tests use it to simulate a second process.
func Open(t testing.TB, url string, maxConns int32) *pgdb.DB {
	t.Helper()
	shareServer(t)
	db, err := open(context.Background(), pgdb.Config{URL: url, MaxConns: maxConns, ApplicationName: "pgsaga-test"})
	if err != nil {
		t.Fatalf("testdb: %v", err)
	}
	t.Cleanup(db.Close)
	return db
}

func create(ctx context.Context, migrated bool, options ...string) (*DB, error) {
	name := testPrefix + strconv.FormatInt(time.Now().Unix(), 10) + "_" + randomHex(4)
	admin, err := connect(ctx, server)
	if err != nil {
		return nil, fmt.Errorf("connecting to %s: %w", pgdb.Describe(server), err)
	}
	defer admin.Close(ctx)

	// A template being copied by another process at the same instant can make
	// CREATE DATABASE fail with "source database is being accessed"; retry.
	// One dropped meanwhile (a checkout that thought it stale) is found or
	// built again.
	for attempt := 0; ; attempt++ {
		stmt := "CREATE DATABASE " + pgx.Identifier{name}.Sanitize()
		for _, o := range options {
			stmt += " " + o
		}
		if migrated {
			tpl, err := templateName(ctx, admin)
			if err != nil {
				return nil, err
			}
			stmt += " TEMPLATE " + pgx.Identifier{tpl}.Sanitize()
		}
		_, err = admin.Exec(ctx, stmt)
		if err == nil {
			break
		}
		var pgErr *pgconn.PgError
		switch {
		case attempt < 50 && errors.As(err, &pgErr) && pgErr.Code == pgerrcode.ObjectInUse:
			time.Sleep(100 * time.Millisecond)
			continue
		case attempt < 3 && migrated && errors.As(err, &pgErr) && pgErr.Code == pgerrcode.InvalidCatalogName:
			forgetTemplate()
			continue
		}
		return nil, fmt.Errorf("creating database %s: %w", name, err)
	}
	url, err := pgdb.WithDatabase(server, name)
	if err != nil {
		return nil, err
	}
	db, err := open(ctx, pgdb.Config{URL: url, MaxConns: 20, ApplicationName: "pgsaga-test"})
	if err != nil {
		return nil, err
	}
	return &DB{Name: name, URL: url, Pool: db.Pool, SQL: db.SQL}, nil
}

func (db *DB) close() {
	_ = db.SQL.Close()
	db.Pool.Close()
}

// forgetTemplate makes the next templateName look the template up again.
func forgetTemplate() {
	tplMu.Lock()
	defer tplMu.Unlock()
	template = ""
}

func templateName(ctx context.Context, admin *pgx.Conn) (string, error) {
	tplMu.Lock()
	defer tplMu.Unlock()
	if template == "" {
		tpl, err := ensureTemplate(ctx, admin)
		if err != nil {
			return "", err
		}
		template = tpl
	}
	return template, nil
}

// ensureTemplate returns the name of a template database holding the current
// migrations, building it if no process has yet. The build happens under a
// temporary name and is renamed into place, so a crashed build never leaves a
// half-migrated template behind. Templates are named after the migrations
// and the time they were built: another checkout with other migrations may
// be testing on the same server right now, so another's template is dropped
// only once it is older than staleAfter.
func ensureTemplate(ctx context.Context, admin *pgx.Conn) (string, error) {
	hash, err := migrationsHash(schemas)
	if err != nil {
		return "", err
	}
	if _, err := admin.Exec(ctx, "SELECT pg_advisory_lock($1)", templateLockID); err != nil {
		return "", fmt.Errorf("locking template build: %w", err)
	}
	defer admin.Exec(context.WithoutCancel(ctx), "SELECT pg_advisory_unlock($1)", templateLockID) //nolint:errcheck

	rows, err := admin.Query(ctx, "SELECT datname FROM pg_database WHERE datname LIKE $1", templatePrefix+"%")
	if err != nil {
		return "", fmt.Errorf("looking for templates: %w", err)
	}
	templates, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return "", fmt.Errorf("looking for templates: %w", err)
	}
	name := ""
	for _, t := range templates {
		if h, _, ok := parseTemplateName(t); ok && h == hash {
			name = t
		}
	}
	if name == "" {
		name, err = buildTemplate(ctx, admin, hash)
		if err != nil {
			return "", err
		}
	}
	for _, t := range templates {
		if h, built, ok := parseTemplateName(t); t != name && (!ok || h != hash && time.Since(built) > staleAfter) {
			_ = dropDatabase(ctx, server, t)
		}
	}
	return name, nil
}

// parseTemplateName splits pgsaga_tpl_<hash>_<unix seconds>.
func parseTemplateName(name string) (hash string, built time.Time, ok bool) {
	rest, found := strings.CutPrefix(name, templatePrefix)
	if !found {
		return "", time.Time{}, false
	}
	hash, secs, found := strings.Cut(rest, "_")
	if !found {
		return "", time.Time{}, false
	}
	unix, err := strconv.ParseInt(secs, 10, 64)
	if err != nil {
		return "", time.Time{}, false // a build in progress, or a name of an older release
	}
	return hash, time.Unix(unix, 0), true
}

// buildTemplate migrates a new template for hash and returns its name.
func buildTemplate(ctx context.Context, admin *pgx.Conn, hash string) (string, error) {
	name := fmt.Sprintf("%s%s_%d", templatePrefix, hash, time.Now().Unix())
	building := templatePrefix + hash + "_build"
	if err := dropDatabase(ctx, server, building); err != nil {
		return "", err
	}
	if _, err := admin.Exec(ctx, "CREATE DATABASE "+pgx.Identifier{building}.Sanitize()); err != nil {
		return "", fmt.Errorf("creating template %s: %w", building, err)
	}
	url, err := pgdb.WithDatabase(server, building)
	if err != nil {
		return "", err
	}
	db, err := open(ctx, pgdb.Config{URL: url, MaxConns: 2, ApplicationName: "pgsaga-test-template"})
	if err != nil {
		return "", err
	}
	_, err = migrations.Apply(ctx, db.SQL)
	for _, sc := range schemas {
		if err == nil {
			_, err = sc.Migrate(ctx, db.SQL)
		}
	}
	db.Close()
	if err != nil {
		return "", fmt.Errorf("migrating template %s: %w", building, err)
	}
	if _, err := admin.Exec(ctx, "ALTER DATABASE "+pgx.Identifier{building}.Sanitize()+" RENAME TO "+pgx.Identifier{name}.Sanitize()); err != nil {
		return "", fmt.Errorf("renaming template %s: %w", building, err)
	}
	return name, nil
}

// migrationsHash names the template after the content of every migration
// file, pgsaga's and the schemas'.
func migrationsHash(schemas []Schema) (string, error) {
	h := sha256.New()
	sets := []fs.FS{migrations.FS()}
	for _, sc := range schemas {
		sets = append(sets, sc.Files)
	}
	for i, fsys := range sets {
		// Every file, wherever it is: a schema's files need not be SQL at
		// the root (Go migrations, a subdirectory), and any change to them
		// must build a new template.
		var names []string
		err := fs.WalkDir(fsys, ".", func(p string, d fs.DirEntry, err error) error {
			if err == nil && !d.IsDir() {
				names = append(names, p)
			}
			return err
		})
		if err != nil {
			return "", err
		}
		sort.Strings(names)
		fmt.Fprintf(h, "set %d\x00", i)
		for _, n := range names {
			b, err := fs.ReadFile(fsys, n)
			if err != nil {
				return "", err
			}
			fmt.Fprintf(h, "%s\x00%d\x00", n, len(b))
			h.Write(b)
		}
	}
	return hex.EncodeToString(h.Sum(nil))[:16], nil
}

func dropDatabase(ctx context.Context, srv, name string) error {
	admin, err := connect(ctx, srv)
	if err != nil {
		return err
	}
	defer admin.Close(ctx)
	_, err = admin.Exec(ctx, "DROP DATABASE IF EXISTS "+pgx.Identifier{name}.Sanitize()+" WITH (FORCE)")
	return err
}

// dropStale drops test databases left behind by killed test runs.
func dropStale(ctx context.Context, srv string) {
	admin, err := pgx.Connect(ctx, srv)
	if err != nil {
		return
	}
	defer admin.Close(ctx)
	rows, err := admin.Query(ctx, "SELECT datname FROM pg_database WHERE datname LIKE $1", testPrefix+"%")
	if err != nil {
		return
	}
	names, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return
	}
	for _, n := range names {
		parts := strings.Split(strings.TrimPrefix(n, testPrefix), "_")
		created, err := strconv.ParseInt(parts[0], 10, 64)
		if err != nil || time.Since(time.Unix(created, 0)) < staleAfter {
			continue
		}
		// Without FORCE: a database someone is still connected to stays.
		_, _ = admin.Exec(ctx, "DROP DATABASE IF EXISTS "+pgx.Identifier{n}.Sanitize())
	}
}

// fullServerWait is how long the tests' own connections wait for a free
// slot on a full server: the server is shared with the other packages'
// tests (and other checkouts' runs), some of which take most of its
// connections for a while (sagabench's runs).
const fullServerWait = 3 * time.Minute

// connect connects to url, waiting while the server is full.
func connect(ctx context.Context, url string) (*pgx.Conn, error) {
	return whenFree(func() (*pgx.Conn, error) { return pgx.Connect(ctx, url) })
}

// open opens a pool as pgdb.Open does, waiting while the server is full.
func open(ctx context.Context, cfg pgdb.Config) (*pgdb.DB, error) {
	return whenFree(func() (*pgdb.DB, error) { return pgdb.Open(ctx, cfg) })
}

// whenFree runs connect until it does not fail for want of a connection
// slot (too_many_connections), or until fullServerWait has passed.
func whenFree[T any](connect func() (T, error)) (T, error) {
	deadline := time.Now().Add(fullServerWait)
	for {
		c, err := connect()
		if !pgerr.Is(err, pgerrcode.TooManyConnections) || time.Now().After(deadline) {
			return c, err
		}
		time.Sleep(100 * time.Millisecond) // other tests' connections, not this test's work
	}
}

func ping(ctx context.Context, url string) error {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	conn, err := pgdb.Connect(ctx, url)
	if err != nil {
		return err
	}
	return conn.Close(ctx)
}

func randomHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

func oneLine(err error) string {
	return strings.Join(strings.Fields(err.Error()), " ")
}

// WaitForLockWait waits until a session of db waits for a lock, and fails
// t if none does within 30 seconds: a test's barrier for "the other
// transaction is blocked on mine".
func (db *DB) WaitForLockWait(t testing.TB) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		var n int
		if err := db.SQL.QueryRow(`SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'`).Scan(&n); err != nil {
			t.Fatalf("reading lock waits: %v", err)
		}
		if n > 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatal("no session waits for a lock")
		}
		time.Sleep(5 * time.Millisecond)
	}
}
