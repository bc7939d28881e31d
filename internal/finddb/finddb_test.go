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
	"github.com/pgsaga/pgsaga/internal/testpg"
)

func TestMain(m *testing.M) {
	if os.Getenv("PGSAGA_EMBEDDED_CHILD") != "" {
		os.Exit(embeddedChild())
	}
	testpg.Main(m)
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
// binaries and checks, in one child process (PostgreSQL refuses root, so
// as root the test re-runs itself as the user "nobody"):
//   - the server is its user's alone: a random superuser password in a
//     0600 file of the 0700 data directory, never logged, asked for by
//     SCRAM; the well-known password, and none, are refused;
//   - a second program using the server keeps it running when the first
//     closes, and the last to close stops it;
//   - a write survives a stop and a start on the same data, which keeps
//     its password;
//   - a killed run's server is found running and used, the dead run not
//     counted as a user: the next run's Close stops it;
//   - data of an earlier release (password "postgres", cleartext password
//     authentication) gets a random password and SCRAM when started.
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
	t.Cleanup(func() { // a failed check may leave the server running
		pgctl := filepath.Join(pgbin.Find(), "pg_ctl")
		stop := exec.Command(pgctl, "stop", "-m", "immediate", "-D", filepath.Join(dir, "pg", "data"))
		stop.SysProcAttr = cmd.SysProcAttr
		_ = stop.Run()
	})
	out, err := cmd.CombinedOutput()
	require.NoError(t, err, "embedded server check failed:\n%s", out)
	assert.Contains(t, string(out), "embedded ok")
}

// passwordFile is where the embedded server keeps its password.
const passwordFile = "pgsaga-superuser-password"

// embeddedChild is the body of TestEmbeddedServer, run as a non-root user.
// It goes on after a failed check where it can, printing each, so that
// one run shows every failure.
func embeddedChild() int {
	ctx := context.Background()
	port, _ := strconv.Atoi(os.Getenv("PGSAGA_EMBEDDED_PORT"))
	dir := os.Getenv("PGSAGA_EMBEDDED_DIR")
	data := filepath.Join(dir, "data")
	var logs strings.Builder
	cfg := finddb.Config{
		Getenv:       noEnv,
		ProbeURL:     "postgres://postgres@127.0.0.1:1/postgres",
		EmbeddedDir:  dir,
		EmbeddedPort: uint32(port),
		Logger:       slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelDebug})),
	}
	if os.Getenv("PGSAGA_EMBEDDED_CHILD") == "killed" {
		// A run killed while it uses the server: it never closes.
		f, err := finddb.Find(ctx, cfg)
		if err != nil {
			fmt.Printf("killed run: %v\n", err)
			os.Exit(1)
		}
		fmt.Println("killed run connected:", read(ctx, f.URL) == nil)
		os.Exit(0)
	}
	failed := false
	check := func(ok bool, format string, args ...any) bool {
		if !ok {
			failed = true
			fmt.Printf("FAIL: "+format+"\n", args...)
		}
		return ok
	}
	find := func(what string) *finddb.Found {
		f, err := finddb.Find(ctx, cfg)
		if !check(err == nil, "%s: %v", what, err) {
			return nil
		}
		check(f.Source == finddb.FromEmbedded, "%s: source %s, want embedded", what, f.Source)
		return f
	}
	answers := func(f *finddb.Found) bool { return finddb.Probe(ctx, f.URL, time.Second) == nil }
	url := func(userinfo string) string {
		return fmt.Sprintf("postgres://%s@127.0.0.1:%d/postgres?sslmode=disable", userinfo, port)
	}
	// secured checks the server is its user's alone, and returns its password.
	secured := func(what string, f *finddb.Found) string {
		pwBytes, err := os.ReadFile(filepath.Join(data, passwordFile))
		pw := strings.TrimSpace(string(pwBytes))
		check(err == nil && regexp.MustCompile(`^[0-9a-f]{32}$`).MatchString(pw), "%s: no password of 32 hex digits in %s (%v)", what, passwordFile, err)
		if st, err := os.Stat(filepath.Join(data, passwordFile)); err == nil {
			check(st.Mode().Perm() == 0o600, "%s: password file mode %v, want 0600", what, st.Mode().Perm())
		}
		if st, err := os.Stat(data); check(err == nil, "%s: %v", what, err) {
			check(st.Mode().Perm() == 0o700, "%s: data directory mode %v, want 0700", what, st.Mode().Perm())
		}
		check(pingURL(url("postgres:postgres")) != nil, "%s: the well-known password postgres/postgres is accepted", what)
		check(pingURL(url("postgres")) != nil, "%s: a connection without a password is accepted", what)
		check(pingURL(f.URL+"&require_auth=scram-sha-256") == nil, "%s: the server does not ask for a SCRAM password: %v", what, pingURL(f.URL+"&require_auth=scram-sha-256"))
		if pw != "" {
			check(!strings.Contains(logs.String(), pw), "%s: the password is logged:\n%s", what, logs.String())
		}
		check(strings.Contains(logs.String(), filepath.Join(data, passwordFile)), "%s: the logs do not say where the password is:\n%s", what, logs.String())
		return pw
	}

	// Two programs on one server: the first starts it, the second uses it.
	first := find("first program")
	if first == nil {
		return 1
	}
	pw := secured("first start", first)
	conn, err := pgx.Connect(ctx, first.URL)
	if check(err == nil, "connecting: %v", err) {
		var encoding string
		err := conn.QueryRow(ctx, "SELECT pg_encoding_to_char(encoding) FROM pg_database WHERE datname = current_database()").Scan(&encoding)
		check(err == nil && encoding == "UTF8", "encoding %q, want UTF8 (%v)", encoding, err)
		_, err = conn.Exec(ctx, "CREATE TABLE kept (v int); INSERT INTO kept VALUES (42)")
		check(err == nil, "writing: %v", err)
		_ = conn.Close(ctx)
	}
	second := find("second program")
	if second != nil {
		check(first.Close() == nil, "closing the first program")
		check(answers(second), "the first program to close stopped the server the second uses")
		check(second.Close() == nil, "closing the second program")
		check(!answers(second), "the server still answers after its last program closed")
	}

	// Started again on the same data: the write and the password are kept.
	again := find("start on the same data")
	if again == nil {
		return 1
	}
	check(read(ctx, again.URL) == nil, "reading after a restart: %v", read(ctx, again.URL))
	check(secured("start on the same data", again) == pw, "a second start made a new password")

	// A run killed while it uses the server: the next run uses that
	// server, does not count the dead run, and stops the server.
	check(again.Close() == nil, "closing")
	self, _ := os.Executable()
	killed := exec.Command(self, "-test.run=^$")
	killed.Env = append(os.Environ(), "PGSAGA_EMBEDDED_CHILD=killed")
	out, err := killed.CombinedOutput()
	check(err == nil && strings.Contains(string(out), "connected: true"), "the killed run: %v\n%s", err, out)
	next := find("the run after a killed one")
	if next == nil {
		return 1
	}
	check(read(ctx, next.URL) == nil, "reading the killed run's server: %v", read(ctx, next.URL))
	check(next.Close() == nil, "closing")
	check(!answers(next), "the server still answers after its last live program closed")

	// Data of an earlier release: password postgres, cleartext password
	// authentication, no password file.
	old := find("start to make earlier data")
	if old == nil {
		return 1
	}
	if c, err := pgx.Connect(ctx, old.URL); check(err == nil, "connecting: %v", err) {
		_, err = c.Exec(ctx, "ALTER ROLE postgres PASSWORD 'postgres'")
		check(err == nil, "making earlier data: %v", err)
		_ = c.Close(ctx)
	}
	check(old.Close() == nil, "closing")
	hba := "local all all password\nhost all all 127.0.0.1/32 password\nhost all all ::1/128 password\n"
	check(os.WriteFile(filepath.Join(data, "pg_hba.conf"), []byte(hba), 0o600) == nil, "writing an earlier pg_hba.conf")
	_ = os.Remove(filepath.Join(data, passwordFile))
	logs.Reset()
	upgraded := find("start on earlier data")
	if upgraded == nil {
		return 1
	}
	check(read(ctx, upgraded.URL) == nil, "reading earlier data: %v", read(ctx, upgraded.URL))
	check(secured("start on earlier data", upgraded) != pw, "earlier data kept a known password")
	check(upgraded.Close() == nil, "closing")
	check(!answers(upgraded), "the server still answers after Close")
	if failed {
		fmt.Println("logs:\n" + logs.String())
		return 1
	}
	fmt.Println("embedded ok")
	return 0
}

// read reads the row the embedded test wrote.
func read(ctx context.Context, url string) error {
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		return err
	}
	defer conn.Close(ctx)
	var v int
	if err := conn.QueryRow(ctx, "SELECT v FROM kept").Scan(&v); err != nil {
		return err
	}
	if v != 42 {
		return fmt.Errorf("read %d, want 42", v)
	}
	return nil
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

// Running never starts a server: with nothing running it says so, even
// as a user who could start an embedded one, and sets nothing up; with the
// embedded server of a running sample it uses that.
func TestRunningNeverStartsAServer(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	_, err := finddb.Running(context.Background(), finddb.Config{
		EmbeddedPort: freePort(t),
		EmbeddedDir:  dir,
		IsRoot:       func() bool { return false },
		Logger:       quiet,
		Timeout:      time.Second,
	})
	require.ErrorIs(t, err, finddb.ErrNoRunningSample)
	entries, _ := os.ReadDir(dir)
	assert.Empty(t, entries, "nothing was set up for an embedded server")
}

// With a sample's embedded server running (here: a server on 127.0.0.1 that
// takes the embedded server's credentials, posing as one), an operator's
// tool uses it and will not stop it.
func TestRunningUsesARunningEmbeddedServer(t *testing.T) {
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
	found, err := finddb.Running(context.Background(), finddb.Config{
		EmbeddedPort: uint32(port),
		EmbeddedDir:  dir,
		Database:     "postgres",
		IsRoot:       func() bool { return false },
		Logger:       quiet,
		Timeout:      5 * time.Second,
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
func TestRunningSaysHowToStartAStoppedSampleServer(t *testing.T) {
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
		_, err := finddb.Running(context.Background(), finddb.Config{
			EmbeddedPort: port,
			EmbeddedDir:  dir,
			BinDirs:      []string{bin},
			IsRoot:       func() bool { return false },
			Logger:       quiet,
			Timeout:      time.Second,
		})
		require.ErrorIs(t, err, finddb.ErrNoRunningSample)
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

// An operator's tool that cannot read the embedded server's password file
// (another user's server, or a damaged file) says so and what to do,
// instead of trying a password it does not have.
func TestRunningWithAnUnreadablePasswordFile(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	data := filepath.Join(dir, "data")
	require.NoError(t, os.MkdirAll(data, 0o700))
	require.NoError(t, os.WriteFile(filepath.Join(data, passwordFile), []byte("not a password\n"), 0o600))
	_, err := finddb.Running(context.Background(), finddb.Config{
		EmbeddedPort: freePort(t),
		EmbeddedDir:  dir,
		Logger:       quiet,
		Timeout:      time.Second,
	})
	require.ErrorIs(t, err, finddb.ErrNoRunningSample)
	require.ErrorIs(t, err, finddb.ErrPasswordUnreadable)
	assert.Contains(t, err.Error(), "name the workers' database")
	assert.NotContains(t, err.Error(), "not a password")
}
