package finddb_test

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/url"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/internal/finddb"
	"github.com/pgsaga/pgsaga/internal/pgbin"
	"github.com/pgsaga/pgsaga/internal/pgdb"
	"github.com/pgsaga/pgsaga/internal/pgserver"
	"github.com/pgsaga/pgsaga/internal/testdb"
)

func TestMain(m *testing.M) {
	if os.Getenv("PGSAGA_EMBEDDED_CHILD") != "" {
		os.Exit(embeddedChild())
	}
	testdb.Main(m)
}

var quiet = slog.New(slog.NewTextHandler(io.Discard, nil))

func noEnv(string) string { return "" }

func TestDatabaseURLWins(t *testing.T) {
	t.Parallel()
	f, err := finddb.Find(context.Background(), finddb.Config{
		Getenv:   func(k string) string { return map[string]string{"DATABASE_URL": "postgres://u:secret@db:5432/app"}[k] },
		ProbeURL: "postgres://postgres@127.0.0.1:1/postgres",
		Logger:   quiet,
	})
	require.NoError(t, err)
	assert.Equal(t, finddb.FromEnv, f.Source)
	assert.Equal(t, "postgres://u:secret@db:5432/app", f.URL)
	assert.NotContains(t, f.Describe(), "secret", "the password is not shown")
	require.NoError(t, f.Close())
}

// A DATABASE_URL that does not parse is described as such, and neither
// the description nor Sibling's error shows any of it.
func TestUnparseableDatabaseURLIsNotShown(t *testing.T) {
	t.Parallel()
	for _, url := range []string{"postgres://u:s3cr/3t@db:5432/app", "host=db PASSWORD=s3cr3t port=notaport"} {
		f, err := finddb.Find(context.Background(), finddb.Config{
			Getenv: func(k string) string { return map[string]string{"DATABASE_URL": url}[k] },
			Logger: quiet,
		})
		require.NoError(t, err)
		assert.Equal(t, fmt.Sprintf("an unparseable connection string (%d bytes) from DATABASE_URL", len(url)), f.Describe())
		_, err = f.Sibling(context.Background(), "payments")
		require.ErrorIs(t, err, pgdb.ErrUnparseable)
		assert.NotContains(t, err.Error(), "s3cr")
	}
}

func TestLocalServerGetsItsDatabase(t *testing.T) {
	t.Parallel()
	name := fmt.Sprintf("pgsaga_finddb_%d", time.Now().UnixNano())
	t.Cleanup(func() { dropDatabase(t, name) })
	for range 2 { // the second time the database exists already
		f, err := finddb.Find(context.Background(), finddb.Config{Getenv: noEnv, ProbeURL: testdb.ServerURL(), Database: name, Logger: quiet})
		require.NoError(t, err)
		assert.Equal(t, finddb.FromLocalhost, f.Source)
		conn, err := pgx.Connect(context.Background(), f.URL)
		require.NoError(t, err)
		var db string
		require.NoError(t, conn.QueryRow(context.Background(), "SELECT current_database()").Scan(&db))
		assert.Equal(t, name, db)
		require.NoError(t, conn.Close(context.Background()))
		require.NoError(t, f.Close())
	}
}

// A second service's database is created next to the found one, once.
func TestSibling(t *testing.T) {
	t.Parallel()
	name := fmt.Sprintf("pgsaga_finddb_%d", time.Now().UnixNano())
	t.Cleanup(func() { dropDatabase(t, name); dropDatabase(t, name+"_payments") })
	f, err := finddb.Find(context.Background(), finddb.Config{Getenv: noEnv, ProbeURL: testdb.ServerURL(), Database: name, Logger: quiet})
	require.NoError(t, err)
	defer f.Close()
	for range 2 { // the second time the database exists already
		url, err := f.Sibling(context.Background(), "payments")
		require.NoError(t, err)
		conn, err := pgx.Connect(context.Background(), url)
		require.NoError(t, err)
		var db string
		require.NoError(t, conn.QueryRow(context.Background(), "SELECT current_database()").Scan(&db))
		assert.Equal(t, name+"_payments", db)
		require.NoError(t, conn.Close(context.Background()))
	}
}

func TestRootWithNothingAvailableExplainsTheWayOut(t *testing.T) {
	t.Parallel()
	_, err := finddb.Find(context.Background(), finddb.Config{
		Getenv:       noEnv,
		ProbeURL:     "postgres://postgres@127.0.0.1:1/postgres",
		EmbeddedPort: freePort(t),
		EmbeddedDir:  t.TempDir(),
		IsRoot:       func() bool { return true },
		Logger:       quiet,
		Timeout:      time.Second,
	})
	require.ErrorIs(t, err, finddb.ErrNoDatabase)
	assert.Contains(t, err.Error(), "DATABASE_URL")
	assert.Contains(t, err.Error(), "docker compose up -d")
	assert.Contains(t, err.Error(), "non-root user")
}

// A server on the probed address that answers but refuses (here: no such
// role) is not used silently: the reason is logged, and, where nothing else
// can run, given in the error.
func TestRefusingLocalServerIsExplained(t *testing.T) {
	t.Parallel()
	var logs strings.Builder
	u, err := url.Parse(testdb.ServerURL())
	require.NoError(t, err)
	if pw, ok := u.User.Password(); ok {
		u.User = url.UserPassword("pgsaga_no_such_role", pw)
	} else {
		u.User = url.User("pgsaga_no_such_role")
	}
	_, err = finddb.Find(context.Background(), finddb.Config{
		Getenv:       noEnv,
		ProbeURL:     u.String(),
		EmbeddedPort: freePort(t),
		EmbeddedDir:  t.TempDir(),
		IsRoot:       func() bool { return true },
		Logger:       slog.New(slog.NewTextHandler(&logs, nil)),
		Timeout:      5 * time.Second,
	})
	require.ErrorIs(t, err, finddb.ErrNoDatabase)
	assert.Contains(t, err.Error(), "answered but refused")
	assert.Contains(t, err.Error(), "pgsaga_no_such_role", "the server's reason is given")
	assert.Contains(t, logs.String(), "not using the local PostgreSQL")
}

// TestEmbeddedServer starts an embedded PostgreSQL from the machine's own
// binaries, writes to it, stops it, starts it again on the same data and
// reads the write back, then finds the server a killed run left behind. PostgreSQL refuses root, so as root the test re-runs
// itself as the user "nobody".
func TestEmbeddedServer(t *testing.T) {
	if pgbin.Find() == "" && os.Getenv("PGSAGA_TEST_EMBEDDED_DOWNLOAD") == "" {
		t.Skip("no local PostgreSQL binaries; set PGSAGA_TEST_EMBEDDED_DOWNLOAD=1 to test the download path")
	}
	dir, err := os.MkdirTemp("", "pgsaga-embedded-")
	require.NoError(t, err)
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	require.NoError(t, os.Chmod(dir, 0o755))

	cmd := exec.Command(os.Args[0], "-test.run=^$")
	if os.Geteuid() == 0 {
		nobody, err := user.Lookup("nobody")
		require.NoError(t, err, "running as root needs the user nobody to test the embedded server")
		uid, _ := strconv.Atoi(nobody.Uid)
		gid, _ := strconv.Atoi(nobody.Gid)
		// The test binary lives in a directory only root can enter.
		bin := filepath.Join(dir, "finddb.test")
		copyFile(t, os.Args[0], bin)
		require.NoError(t, os.Chown(dir, uid, gid))
		cmd = exec.Command(bin, "-test.run=^$")
		cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid)}}
	}
	cmd.Env = append(os.Environ(),
		"PGSAGA_EMBEDDED_CHILD=1",
		"PGSAGA_EMBEDDED_DIR="+filepath.Join(dir, "pg"),
		"PGSAGA_EMBEDDED_PORT="+strconv.Itoa(int(freePort(t))),
		"HOME="+dir,
	)
	out, err := cmd.CombinedOutput()
	require.NoError(t, err, "embedded server check failed:\n%s", out)
	assert.Contains(t, string(out), "embedded ok")
}

// embeddedChild is the body of TestEmbeddedServer, run as a non-root user.
func embeddedChild() int {
	ctx := context.Background()
	port, _ := strconv.Atoi(os.Getenv("PGSAGA_EMBEDDED_PORT"))
	cfg := finddb.Config{
		Getenv:       noEnv,
		ProbeURL:     "postgres://postgres@127.0.0.1:1/postgres",
		EmbeddedDir:  os.Getenv("PGSAGA_EMBEDDED_DIR"),
		EmbeddedPort: uint32(port),
		Logger:       quiet,
	}
	fail := func(format string, args ...any) int {
		fmt.Printf(format+"\n", args...)
		return 1
	}
	// Round 0 writes and stops; round 1 reads and is "killed" (never stops
	// its server); round 2 must reuse that server, read, and stop it.
	for round := range 3 {
		f, err := finddb.Find(ctx, cfg)
		if err != nil {
			return fail("round %d: %v", round, err)
		}
		if f.Source != finddb.FromEmbedded {
			return fail("round %d: source %s, want embedded", round, f.Source)
		}
		conn, err := pgx.Connect(ctx, f.URL)
		if err != nil {
			return fail("round %d: connecting: %v", round, err)
		}
		var encoding string
		if err := conn.QueryRow(ctx, "SELECT pg_encoding_to_char(encoding) FROM pg_database WHERE datname = current_database()").Scan(&encoding); err != nil || encoding != "UTF8" {
			return fail("round %d: encoding %q, want UTF8 (%v)", round, encoding, err)
		}
		if round == 0 {
			_, err = conn.Exec(ctx, "CREATE TABLE kept (v int); INSERT INTO kept VALUES (42)")
		} else {
			var v int
			if err = conn.QueryRow(ctx, "SELECT v FROM kept").Scan(&v); err == nil && v != 42 {
				err = fmt.Errorf("read %d, want 42", v)
			}
		}
		_ = conn.Close(ctx)
		if err != nil {
			return fail("round %d: %v", round, err)
		}
		if round == 1 {
			continue
		}
		if err := f.Close(); err != nil {
			return fail("round %d: stopping: %v", round, err)
		}
		if finddb.Probe(ctx, f.URL, time.Second) == nil {
			return fail("round %d: the server still answers after Close", round)
		}
	}
	fmt.Println("embedded ok")
	return 0
}

// Data an embedded server was once initialised with in another encoding is
// refused, naming the fix.
func TestEmbeddedDataWithoutUTF8IsRefused(t *testing.T) {
	t.Parallel()
	db := testdb.Custom(t, "TEMPLATE template0 ENCODING 'SQL_ASCII' LC_COLLATE 'C' LC_CTYPE 'C'")
	err := finddb.RequireUTF8(context.Background(), db.URL, 5*time.Second)
	require.ErrorIs(t, err, pgserver.ErrNotUTF8)
	require.NoError(t, finddb.RequireUTF8(context.Background(), testdb.Shared(t).URL, 5*time.Second))
}

func freePort(t *testing.T) uint32 {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer l.Close()
	return uint32(l.Addr().(*net.TCPAddr).Port)
}

func copyFile(t *testing.T, from, to string) {
	t.Helper()
	b, err := os.ReadFile(from)
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(to, b, 0o755))
}

func dropDatabase(t *testing.T, name string) {
	conn, err := pgx.Connect(context.Background(), testdb.ServerURL())
	if err != nil {
		t.Errorf("dropping %s: %v", name, err)
		return
	}
	defer conn.Close(context.Background())
	if _, err := conn.Exec(context.Background(), "DROP DATABASE IF EXISTS "+pgx.Identifier{name}.Sanitize()+" WITH (FORCE)"); err != nil {
		t.Errorf("dropping %s: %v", name, err)
	}
}

// An operator's tool (Existing) never starts a server: with nothing
// running it says so and how to point it at the workers' database, even
// as a user who could start an embedded one; with the embedded server of a
// running sample it uses that.
func TestExistingNeverStartsAServer(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	_, err := finddb.Find(context.Background(), finddb.Config{
		Getenv:       noEnv,
		ProbeURL:     "postgres://postgres@127.0.0.1:1/postgres",
		EmbeddedPort: freePort(t),
		EmbeddedDir:  dir,
		IsRoot:       func() bool { return false },
		Logger:       quiet,
		Timeout:      time.Second,
		Existing:     true,
	})
	require.ErrorIs(t, err, finddb.ErrNoDatabase)
	assert.Contains(t, err.Error(), "set DATABASE_URL to the database your workers use")
	entries, _ := os.ReadDir(dir)
	assert.Empty(t, entries, "nothing was set up for an embedded server")
}

// With a sample's embedded server running (here: a server on 127.0.0.1 that
// takes the embedded server's credentials, posing as one), an operator's
// tool uses it and will not stop it.
func TestExistingUsesARunningEmbeddedServer(t *testing.T) {
	t.Parallel()
	u, err := url.Parse(testdb.ServerURL())
	require.NoError(t, err)
	port, err := strconv.ParseUint(u.Port(), 10, 32)
	require.NoError(t, err)
	posing := fmt.Sprintf("postgres://postgres:postgres@127.0.0.1:%d/postgres?sslmode=disable", port)
	if conn, err := pgx.Connect(context.Background(), posing); err != nil {
		t.Skipf("the test server cannot pose as an embedded one (it must take postgres:postgres on 127.0.0.1): %v", err)
	} else {
		_ = conn.Close(context.Background())
	}
	dir := t.TempDir()
	found, err := finddb.Find(context.Background(), finddb.Config{
		Getenv:       noEnv,
		ProbeURL:     "postgres://postgres@127.0.0.1:1/postgres",
		EmbeddedPort: uint32(port),
		EmbeddedDir:  dir,
		Database:     "postgres",
		IsRoot:       func() bool { return false },
		Logger:       quiet,
		Timeout:      5 * time.Second,
		Existing:     true,
	})
	require.NoError(t, err)
	assert.Equal(t, finddb.FromEmbedded, found.Source)
	assert.Equal(t, posing, found.URL)
	require.NoError(t, found.Close(), "closing does not stop a server it did not start")
	require.NoError(t, pingURL(posing), "the server still runs")
	entries, _ := os.ReadDir(dir)
	assert.Empty(t, entries, "nothing was set up for a server of its own")
}

func pingURL(u string) error {
	conn, err := pgx.Connect(context.Background(), u)
	if err != nil {
		return err
	}
	return conn.Close(context.Background())
}

// A sample that used an embedded server and has exited leaves its data
// behind, its server stopped: an operator's tool still starts nothing, and
// says exactly how to bring that server back, with binaries of the data's
// version only.
func TestExistingSaysHowToStartAStoppedSampleServer(t *testing.T) {
	t.Parallel()
	bin := pgbin.Find()
	if bin == "" {
		t.Skip("no local PostgreSQL binaries")
	}
	out, err := exec.Command(filepath.Join(bin, "postgres"), "--version").Output()
	require.NoError(t, err)
	major := regexp.MustCompile(`\(PostgreSQL\) (\d+)`).FindStringSubmatch(string(out))[1]
	find := func(version string) (string, string, uint32) {
		dir := t.TempDir()
		data := filepath.Join(dir, "data")
		require.NoError(t, os.MkdirAll(data, 0o700))
		require.NoError(t, os.WriteFile(filepath.Join(data, "PG_VERSION"), []byte(version+"\n"), 0o600))
		port := freePort(t)
		_, err := finddb.Find(context.Background(), finddb.Config{
			Getenv:       noEnv,
			ProbeURL:     "postgres://postgres@127.0.0.1:1/postgres",
			EmbeddedPort: port,
			EmbeddedDir:  dir,
			BinDirs:      []string{bin},
			IsRoot:       func() bool { return false },
			Logger:       quiet,
			Timeout:      time.Second,
			Existing:     true,
		})
		require.ErrorIs(t, err, finddb.ErrNoDatabase)
		entries, _ := os.ReadDir(dir)
		assert.Len(t, entries, 1, "nothing started or set up")
		return err.Error(), dir, port
	}

	msg, dir, port := find(major)
	assert.Contains(t, msg, "go run ./cmd/orderdemo -orders 0 -serve")
	assert.Contains(t, msg, fmt.Sprintf("'%s' start -w -D '%s' -l '%s' -o '-p %d -c unix_socket_directories=%s'",
		filepath.Join(bin, "pg_ctl"), filepath.Join(dir, "data"), filepath.Join(dir, "postgres.log"), port, filepath.Join(dir, "run")))

	msg, _, _ = find("9")
	assert.Contains(t, msg, "no PostgreSQL 9 binaries here can start it")
	assert.NotContains(t, msg, "orderdemo", "the sample would set data of another version up afresh")
}

// An embedded server's data of another PostgreSQL version than the
// binaries here is refused and kept: the embedded server would delete it
// to set a new one up.
func TestEmbeddedDataOfAnotherVersionIsKept(t *testing.T) {
	t.Parallel()
	bin := pgbin.Find()
	if bin == "" {
		t.Skip("no local PostgreSQL binaries")
	}
	dir := t.TempDir()
	data := filepath.Join(dir, "data")
	require.NoError(t, os.MkdirAll(data, 0o700))
	require.NoError(t, os.WriteFile(filepath.Join(data, "PG_VERSION"), []byte("9\n"), 0o600))
	kept := filepath.Join(data, "base-of-earlier-runs")
	require.NoError(t, os.WriteFile(kept, []byte("rows"), 0o600))
	_, err := finddb.Find(context.Background(), finddb.Config{
		Getenv:       noEnv,
		ProbeURL:     "postgres://postgres@127.0.0.1:1/postgres",
		EmbeddedPort: freePort(t),
		EmbeddedDir:  dir,
		BinDirs:      []string{bin},
		IsRoot:       func() bool { return false },
		Logger:       quiet,
		Timeout:      time.Second,
	})
	require.ErrorIs(t, err, finddb.ErrNoDatabase)
	assert.Contains(t, err.Error(), "is PostgreSQL 9's")
	assert.FileExists(t, kept, "the data is kept")
}

// A DATABASE_URL that names its database in a query parameter gets its
// sibling next to that database, and the sibling's URL connects to the
// sibling, not to the database the parameter named.
func TestSiblingOfADatabaseNamedInAParameter(t *testing.T) {
	t.Parallel()
	name := fmt.Sprintf("pgsaga_finddb_%d", time.Now().UnixNano())
	t.Cleanup(func() { dropDatabase(t, name); dropDatabase(t, name+"_payments") })
	f, err := finddb.Find(context.Background(), finddb.Config{Getenv: noEnv, ProbeURL: testdb.ServerURL(), Database: name, Logger: quiet})
	require.NoError(t, err)
	defer f.Close()
	u, err := url.Parse(testdb.ServerURL())
	require.NoError(t, err)
	u.Path = "/"
	q := u.Query()
	q.Set("dbname", name)
	u.RawQuery = q.Encode()
	env, err := finddb.Find(context.Background(), finddb.Config{
		Getenv: func(k string) string { return map[string]string{"DATABASE_URL": u.String()}[k] },
		Logger: quiet,
	})
	require.NoError(t, err)
	sibling, err := env.Sibling(context.Background(), "payments")
	require.NoError(t, err)
	conn, err := pgx.Connect(context.Background(), sibling)
	require.NoError(t, err)
	defer conn.Close(context.Background())
	var db string
	require.NoError(t, conn.QueryRow(context.Background(), "SELECT current_database()").Scan(&db))
	assert.Equal(t, name+"_payments", db)
}
