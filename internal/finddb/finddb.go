// Package finddb finds a PostgreSQL for pgsaga's binaries, so that they run
// on a newcomer's machine with no configuration:
//
//  1. DATABASE_URL, if set, used as is;
//  2. else a server on 127.0.0.1:5432 that answers (user postgres), on which
//     the database "pgsaga" is created if missing;
//  3. else an embedded PostgreSQL (github.com/fergusstrange/embedded-postgres)
//     started from the machine's own PostgreSQL binaries when there are any
//     (pg_config --bindir, /usr/lib/postgresql/*/bin), otherwise from its
//     normal download, with its data kept in the user's cache directory so a
//     later run (say, -resume) finds the same data, and stopped on Close by
//     the last program using it. It is its user's alone: its superuser's
//     password is random, kept in a file only that user can read, and
//     asked for, by SCRAM, of every connection (see secure.go).
//
// PostgreSQL refuses to run as root, so as root with nothing else available
// Find fails with ErrNoDatabase, whose message names the two ways out.
package finddb

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"runtime"
	"strings"
	"time"

	embeddedpostgres "github.com/fergusstrange/embedded-postgres"
	"github.com/jackc/pgerrcode"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/pgsaga/pgsaga/internal/flock"
	"github.com/pgsaga/pgsaga/internal/pgbin"
	"github.com/pgsaga/pgsaga/internal/pgdb"
	"github.com/pgsaga/pgsaga/internal/pgserver"
)

// Source says where the database came from.
type Source string

// Sources of a database.
const (
	FromEnv       Source = "DATABASE_URL"
	FromLocalhost Source = "localhost"
	FromEmbedded  Source = "embedded"
)

// ErrNoDatabase is returned when no database can be found or started.
var ErrNoDatabase = errors.New("no PostgreSQL available")

// Config configures Find. Zero values take the documented defaults.
type Config struct {
	// Getenv reads the environment. Default: os.Getenv.
	Getenv func(string) string
	// ProbeURL is the local server tried when DATABASE_URL is unset.
	// Default: postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable.
	ProbeURL string
	// Database is the database used on a probed or embedded server; it is
	// created if missing. Default: "pgsaga".
	Database string
	// EmbeddedDir holds the embedded server's data, runtime files and log.
	// Default: <user cache dir>/pgsaga/embedded-postgres.
	EmbeddedDir string
	// EmbeddedPort is the embedded server's port. Default: 54329.
	EmbeddedPort uint32
	// BinDirs are searched for a local PostgreSQL (each holding pg_ctl) before
	// the embedded server downloads one. Default: pg_config --bindir, then
	// /usr/lib/postgresql/*/bin, newest first.
	BinDirs []string
	// Logger reports what was found. Default: slog.Default().
	Logger *slog.Logger
	// Timeout bounds probing a server. Default: 3s.
	Timeout time.Duration
	// IsRoot reports whether the process runs as root. Default: euid 0.
	IsRoot func() bool

	skipped string // why a local server that answered was not used
}

func (c *Config) setDefaults() {
	if c.Getenv == nil {
		c.Getenv = os.Getenv
	}
	if c.ProbeURL == "" {
		c.ProbeURL = "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable"
	}
	if c.Database == "" {
		c.Database = "pgsaga"
	}
	if c.EmbeddedDir == "" {
		dir, err := os.UserCacheDir()
		if err != nil {
			dir = os.TempDir()
		}
		c.EmbeddedDir = filepath.Join(dir, "pgsaga", "embedded-postgres")
	}
	if c.EmbeddedPort == 0 {
		c.EmbeddedPort = 54329
	}
	if c.BinDirs == nil {
		c.BinDirs = pgbin.Candidates()
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	if c.Timeout == 0 {
		c.Timeout = 3 * time.Second
	}
	if c.IsRoot == nil {
		c.IsRoot = func() bool { return os.Geteuid() == 0 }
	}
}

// Found is a database ready to use.
type Found struct {
	// URL connects to it.
	URL string
	// Source says where it came from.
	Source Source
	// Detail says more, for the user: the database as pgdb.Describe
	// describes it, or the embedded server's data directory.
	Detail string

	// Of an embedded server this handle uses and may stop:
	dir     string       // its EmbeddedDir
	release func()       // ends this handle's use of it (see users.go)
	halt    func() error // stops it
	logger  *slog.Logger
}

// Close ends the use of the embedded server, if Find started it or found
// it running: the last program to use it stops it; while another (a
// serving sample, say) uses it, it is left running for that one.
func (f *Found) Close() error {
	if f.release == nil {
		return nil
	}
	unlock, err := flock.Lock(filepath.Join(f.dir, serverLock))
	if err != nil {
		return err
	}
	defer unlock()
	return f.closeLocked()
}

// closeLocked is Close with the server lock held.
func (f *Found) closeLocked() error {
	if f.release == nil {
		return nil
	}
	f.release()
	f.release = nil
	others, err := otherUsers(f.dir)
	if err != nil {
		return err
	}
	if others > 0 {
		f.logger.Info("leaving the embedded PostgreSQL running for the other programs using it", "programs", others, "data", f.Detail)
		return nil
	}
	return f.halt()
}

// Find returns a database following the order in the package documentation.
func Find(ctx context.Context, cfg Config) (*Found, error) {
	cfg.setDefaults()
	if url := cfg.Getenv(pgdb.EnvURL); url != "" {
		return &Found{URL: url, Source: FromEnv, Detail: pgdb.Describe(url)}, nil
	}
	probeErr := probe(ctx, cfg.ProbeURL, cfg.Timeout)
	if probeErr == nil {
		url, err := ensureDatabase(ctx, cfg.ProbeURL, cfg.Database, cfg.Timeout)
		if err != nil {
			return nil, err
		}
		return &Found{URL: url, Source: FromLocalhost, Detail: pgdb.Describe(url)}, nil
	}
	var pgErr *pgconn.PgError
	if errors.As(probeErr, &pgErr) {
		// A server answered and refused (no such role, a password it
		// wants): the user may have meant to use it, so say why not.
		cfg.skipped = fmt.Sprintf("the local PostgreSQL answered but refused %s (%s); set DATABASE_URL to use it",
			pgdb.Describe(cfg.ProbeURL), oneLine(pgErr))
		cfg.Logger.Warn("not using the local PostgreSQL: " + cfg.skipped)
	} else {
		cfg.Logger.Debug("no local PostgreSQL answered", "err", probeErr)
	}
	return startEmbedded(ctx, cfg)
}

// oneLine is err's message on one line.
func oneLine(err error) string { return strings.Join(strings.Fields(err.Error()), " ") }

// ErrNoRunningSample is returned by Running when no embedded server of a
// running sample answers.
var ErrNoRunningSample = errors.New("no embedded PostgreSQL of a running sample answered")

// Running returns the embedded server of a sample running on this machine
// as this user, if one answers (cfg's EmbeddedDir, EmbeddedPort and
// Database say where): it reads nothing from the environment, probes no
// other server, starts nothing and creates no database, and Close leaves
// the server running (an operator's tool reads the workers' database, and
// a fresh one would be empty). Otherwise its error wraps
// ErrNoRunningSample, and says how to start the sample's server again when
// its data is there.
func Running(ctx context.Context, cfg Config) (*Found, error) {
	cfg.setDefaults()
	dataDir := filepath.Join(cfg.EmbeddedDir, "data")
	// The data directory's password, else one a run has yet to move
	// there, else an earlier release's.
	var candidates []string
	for _, path := range []string{filepath.Join(dataDir, passwordFile), filepath.Join(cfg.EmbeddedDir, pendingPasswordFile)} {
		pw, ok, err := readPassword(path)
		if err != nil {
			return nil, fmt.Errorf("%w: %w; the embedded PostgreSQL is its user's alone: run this as that user, or name the workers' database", ErrNoRunningSample, err)
		}
		if ok {
			candidates = append(candidates, pw)
		}
	}
	candidates = append(candidates, legacyPassword)
	for _, pw := range candidates {
		url := embeddedURL(pw, cfg.EmbeddedPort, cfg.Database)
		if probe(ctx, url, cfg.Timeout) == nil {
			return &Found{URL: url, Source: FromEmbedded, Detail: dataDir}, nil
		}
	}
	if version, err := os.ReadFile(filepath.Join(dataDir, "PG_VERSION")); err == nil {
		// A sample ran on its embedded server and has exited, stopping it:
		// its data is there. An operator's tool starts nothing; it says how.
		return nil, fmt.Errorf("%w: %s", ErrNoRunningSample, restartHint(cfg, dataDir, strings.TrimSpace(string(version))))
	}
	return nil, fmt.Errorf("%w on port %d", ErrNoRunningSample, cfg.EmbeddedPort)
}

func startEmbedded(ctx context.Context, cfg Config) (*Found, error) {
	dataDir := filepath.Join(cfg.EmbeddedDir, "data")
	if cfg.IsRoot() {
		// Root starts nothing; a server of its own already running (its
		// password file is there) it uses, and never stops.
		if pw, ok, err := readPassword(filepath.Join(dataDir, passwordFile)); err == nil && ok {
			url := embeddedURL(pw, cfg.EmbeddedPort, cfg.Database)
			if probe(ctx, url, cfg.Timeout) == nil {
				return &Found{URL: url, Source: FromEmbedded, Detail: dataDir}, nil
			}
		}
		local := "nothing answered for " + pgdb.Describe(cfg.ProbeURL)
		if cfg.skipped != "" {
			local = cfg.skipped
		}
		return nil, fmt.Errorf("%w: %s, and an embedded PostgreSQL cannot run as root; "+
			"either set DATABASE_URL to a server you can use (for example one started with `docker compose up -d`), "+
			"or run this program as a non-root user so it can start an embedded PostgreSQL", ErrNoDatabase, local)
	}
	if err := os.MkdirAll(cfg.EmbeddedDir, 0o700); err != nil {
		return nil, fmt.Errorf("%w: creating %s: %w", ErrNoDatabase, cfg.EmbeddedDir, err)
	}
	// Starting, or finding running, and counting users happen under one
	// lock with stopping (see users.go).
	unlock, err := flock.Lock(filepath.Join(cfg.EmbeddedDir, serverLock))
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrNoDatabase, err)
	}
	defer unlock()
	release, err := register(cfg.EmbeddedDir)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrNoDatabase, err)
	}
	found, err := startOrReuse(ctx, cfg, dataDir)
	if err != nil {
		release()
		return nil, err
	}
	found.release, found.dir, found.logger = release, cfg.EmbeddedDir, cfg.Logger
	if err := embeddedUTF8(ctx, found, dataDir, cfg.Timeout); err != nil {
		return nil, err
	}
	return found, nil
}

// startOrReuse starts the embedded server, or finds it running, and makes
// it its user's alone (see secure.go); the caller holds the server lock.
func startOrReuse(ctx context.Context, cfg Config, dataDir string) (*Found, error) {
	pw, settled, fresh, err := embeddedPassword(cfg.EmbeddedDir)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrNoDatabase, err)
	}
	pwPath := filepath.Join(dataDir, passwordFile)
	// The superuser's password now: pw, or, on data whose password has yet
	// to settle, an earlier release's.
	candidates := []string{pw}
	if !settled {
		candidates = append(candidates, legacyPassword)
	}
	settle := func(current string) error {
		if err := secure(ctx, cfg.EmbeddedPort, current, pw, dataDir, 30*time.Second); err != nil {
			return fmt.Errorf("%w: %w", ErrNoDatabase, err)
		}
		if !settled {
			if err := settlePassword(cfg.EmbeddedDir); err != nil {
				return fmt.Errorf("%w: %w", ErrNoDatabase, err)
			}
		}
		return nil
	}
	url := embeddedURL(pw, cfg.EmbeddedPort, cfg.Database)

	// A server another program uses now, or an earlier run left running
	// when it was killed.
	for _, current := range candidates {
		if probe(ctx, embeddedURL(current, cfg.EmbeddedPort, cfg.Database), cfg.Timeout) != nil {
			continue
		}
		cfg.Logger.Info("using the embedded PostgreSQL already running", "data", dataDir, "password_file", pwPath)
		if err := settle(current); err != nil {
			return nil, err
		}
		bin := cfg.binDir()
		if bin == "" {
			bin = filepath.Join(cfg.EmbeddedDir, "runtime", "bin") // the downloaded binaries
		}
		return &Found{URL: url, Source: FromEmbedded, Detail: dataDir, halt: func() error {
			return exec.Command(filepath.Join(bin, "pg_ctl"), "stop", "-w", "-D", dataDir).Run()
		}}, nil
	}

	socketDir := filepath.Join(cfg.EmbeddedDir, "run")
	if err := os.MkdirAll(socketDir, 0o700); err != nil {
		return nil, fmt.Errorf("%w: creating %s: %w", ErrNoDatabase, socketDir, err)
	}
	logPath := filepath.Join(cfg.EmbeddedDir, "postgres.log")
	logFile, err := os.OpenFile(logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return nil, fmt.Errorf("%w: opening %s: %w", ErrNoDatabase, logPath, err)
	}

	pgcfg := embeddedpostgres.DefaultConfig().
		Port(cfg.EmbeddedPort).
		Database(cfg.Database).
		DataPath(dataDir).
		RuntimePath(filepath.Join(cfg.EmbeddedDir, "runtime")).
		CachePath(filepath.Join(cfg.EmbeddedDir, "cache")).
		// Debian's server binary puts its socket in /var/run/postgresql by
		// default, which an ordinary user cannot write.
		StartParameters(map[string]string{"unix_socket_directories": socketDir}).
		StartTimeout(60 * time.Second).
		// pgsaga needs UTF8; without these initdb takes the environment's
		// locale, which is often POSIX, and so SQL_ASCII.
		Encoding("UTF8").
		Locale(utf8Locale()).
		Logger(logFile)
	detail := dataDir
	version := embeddedpostgres.V17
	if bin := cfg.binDir(); bin != "" {
		if version, err = serverVersion(bin); err != nil {
			_ = logFile.Close()
			return nil, fmt.Errorf("%w: %w", ErrNoDatabase, err)
		}
		pgcfg = pgcfg.BinariesPath(filepath.Dir(bin))
		detail += " (binaries " + bin + ")"
	} else {
		detail += " (downloaded binaries)"
	}
	pgcfg = pgcfg.Version(version)
	// The embedded server sets up afresh a data directory of another
	// version than its binaries', deleting what it held: refuse instead.
	held, err := os.ReadFile(filepath.Join(dataDir, "PG_VERSION"))
	if err == nil {
		if major := strings.TrimSpace(string(held)); !strings.HasPrefix(string(version), major+".") {
			_ = logFile.Close()
			return nil, fmt.Errorf("%w: the embedded PostgreSQL's data in %s is PostgreSQL %s's, and the binaries here are PostgreSQL %s's, "+
				"which would set it up afresh and lose it; install PostgreSQL %s's binaries, or move that directory away to start afresh, "+
				"or set DATABASE_URL", ErrNoDatabase, dataDir, major, strings.SplitN(string(version), ".", 2)[0], major)
		}
	}
	// The password the server starts with (initdb sets it on new data):
	// new data takes pw; data of an earlier release, its password; data
	// whose pending password a run may not have set, either.
	switch {
	case err != nil:
		candidates = []string{pw}
	case settled:
		// Its password is stored as SCRAM already: pg_hba.conf can ask for
		// SCRAM from the start.
		if _, err := writeHBA(dataDir); err != nil {
			_ = logFile.Close()
			return nil, fmt.Errorf("%w: %w", ErrNoDatabase, err)
		}
	case fresh:
		candidates = []string{legacyPassword}
	}
	cfg.Logger.Info("starting an embedded PostgreSQL", "data", dataDir, "port", cfg.EmbeddedPort, "log", logPath, "password_file", pwPath)
	var pg *embeddedpostgres.EmbeddedPostgres
	var current string
	for i, c := range candidates {
		attempt := pgcfg.Password(c)
		if i < len(candidates)-1 {
			// pg_ctl has waited for the server: a right password is
			// taken at once, a wrong one never.
			attempt = attempt.StartTimeout(10 * time.Second)
		}
		pg = embeddedpostgres.NewDatabase(attempt)
		if err = pg.Start(); err == nil {
			current = c
			break
		}
	}
	if err != nil {
		_ = logFile.Close()
		return nil, fmt.Errorf("%w: starting embedded PostgreSQL (log %s): %w", ErrNoDatabase, logPath, err)
	}
	halt := func() error {
		defer logFile.Close()
		return pg.Stop()
	}
	if err := settle(current); err != nil {
		_ = halt()
		return nil, err
	}
	return &Found{URL: url, Source: FromEmbedded, Detail: detail, halt: halt}, nil
}

// embeddedUTF8 stops an embedded server whose data is not UTF8 (initialised
// by an earlier release) and says how to start afresh; the caller holds
// the server lock.
func embeddedUTF8(ctx context.Context, found *Found, dataDir string, timeout time.Duration) error {
	if err := requireUTF8(ctx, found.URL, timeout); err != nil {
		_ = found.closeLocked()
		return fmt.Errorf("%w: the embedded PostgreSQL's data in %s was initialised without UTF8 (%w); remove that directory and run again to initialise a UTF8 one",
			ErrNoDatabase, dataDir, err)
	}
	return nil
}

// utf8Locale is a UTF-8 locale initdb accepts on this system.
func utf8Locale() string {
	switch runtime.GOOS {
	case "linux":
		return "C.UTF-8"
	case "darwin", "freebsd":
		return "en_US.UTF-8"
	}
	return "C" // any encoding goes with it
}

// requireUTF8 checks the database at url (see pgserver.RequireUTF8).
func requireUTF8(ctx context.Context, url string, timeout time.Duration) error {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	db, err := pgdb.Open(ctx, pgdb.Config{URL: url, MaxConns: 2, ApplicationName: "pgsaga-finddb"})
	if err != nil {
		return err
	}
	defer db.Close()
	return pgserver.RequireUTF8(ctx, db.SQL)
}

// binDir returns the first configured directory holding the server binaries.
func (c Config) binDir() string { return pgbin.First(c.BinDirs) }

var versionPattern = regexp.MustCompile(`\(PostgreSQL\) (\d+)`)

// serverVersion maps the local server's major version to the embedded
// library's version constant, which it checks against the data directory.
func serverVersion(bin string) (embeddedpostgres.PostgresVersion, error) {
	out, err := exec.Command(filepath.Join(bin, "postgres"), "--version").Output()
	if err != nil {
		return "", fmt.Errorf("running %s --version: %w", filepath.Join(bin, "postgres"), err)
	}
	m := versionPattern.FindSubmatch(out)
	if m == nil {
		return "", fmt.Errorf("unrecognised PostgreSQL version %q", strings.TrimSpace(string(out)))
	}
	for _, v := range []embeddedpostgres.PostgresVersion{
		embeddedpostgres.V18, embeddedpostgres.V17, embeddedpostgres.V16, embeddedpostgres.V15,
		embeddedpostgres.V14, embeddedpostgres.V13, embeddedpostgres.V12,
	} {
		if strings.HasPrefix(string(v), string(m[1])+".") {
			return v, nil
		}
	}
	return "", fmt.Errorf("PostgreSQL %s at %s is not supported by the embedded server (12 to 18 are)", m[1], bin)
}

func probe(ctx context.Context, url string, timeout time.Duration) error {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	conn, err := pgdb.Connect(ctx, url)
	if err != nil {
		return err
	}
	return conn.Close(ctx)
}

// ensureDatabase creates database name on the server at adminURL unless it
// exists, and returns a URL for it.
func ensureDatabase(ctx context.Context, adminURL, name string, timeout time.Duration) (string, error) {
	cctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	conn, err := pgdb.Connect(cctx, adminURL)
	if err != nil {
		return "", err
	}
	defer conn.Close(context.WithoutCancel(ctx))
	var exists bool
	if err := conn.QueryRow(ctx, "SELECT EXISTS (SELECT FROM pg_database WHERE datname = $1)", name).Scan(&exists); err != nil {
		return "", fmt.Errorf("looking for database %s: %w", name, err)
	}
	if !exists {
		_, err := conn.Exec(ctx, "CREATE DATABASE "+pgx.Identifier{name}.Sanitize())
		var pgErr *pgconn.PgError
		if err != nil && !(errors.As(err, &pgErr) && pgErr.Code == pgerrcode.DuplicateDatabase) { // created meanwhile
			return "", fmt.Errorf("creating database %s next to %s: %w", name, pgdb.Describe(adminURL), err)
		}
	}
	return pgdb.WithDatabase(adminURL, name)
}

// Describe is a one-line account of where the database is, for the user.
func (f *Found) Describe() string {
	switch f.Source {
	case FromEnv:
		return f.Detail + " from DATABASE_URL"
	case FromLocalhost:
		return f.Detail
	default:
		return "embedded PostgreSQL, data in " + f.Detail
	}
}

var _ io.Closer = (*Found)(nil)

// Sibling returns a URL for the database named after the found one with
// suffix ("pgsaga" and "payments": "pgsaga_payments"), on the same server
// with the same credentials, creating it if it does not exist: a second
// service's database next to the first.
func (f *Found) Sibling(ctx context.Context, suffix string) (string, error) {
	cfg, err := pgdb.ParseConfig(f.URL)
	if err != nil {
		return "", err
	}
	name := cfg.ConnConfig.Database + "_" + suffix
	if len(name) > 63 {
		return "", fmt.Errorf("the database name %q is longer than PostgreSQL's 63 bytes", name)
	}
	url, err := ensureDatabase(ctx, f.URL, name, 30*time.Second)
	if err != nil {
		return "", fmt.Errorf("%w (the role needs CREATEDB, or create the database %s yourself)", err, name)
	}
	return url, nil
}

// restartHint says how to start again the embedded server whose data,
// of PostgreSQL major version major, is in dataDir: with binaries of that
// version (the machine's, or those the sample downloaded), never others
// (they cannot read the data, and the sample would initialise it afresh).
func restartHint(cfg Config, dataDir, major string) string {
	var bins []string // the machine's, then the downloaded ones
	local := cfg.binDir()
	if local != "" {
		bins = append(bins, local)
	}
	bins = append(bins, filepath.Join(cfg.EmbeddedDir, "runtime", "bin"))
	var found string
	for _, bin := range bins {
		if v, err := serverVersion(bin); err == nil && strings.SplitN(string(v), ".", 2)[0] == major {
			found = bin
			break
		}
	}
	what := fmt.Sprintf("the sample's embedded PostgreSQL %s keeps its data in %s but is not running", major, dataDir)
	if found == "" {
		return what + fmt.Sprintf("; no PostgreSQL %s binaries here can start it (set DATABASE_URL to the database your workers use)", major)
	}
	pgctl := fmt.Sprintf("%s start -w -D %s -l %s -o '-p %d -c unix_socket_directories=%s'",
		shellQuote(filepath.Join(found, "pg_ctl")), shellQuote(dataDir), shellQuote(filepath.Join(cfg.EmbeddedDir, "postgres.log")),
		cfg.EmbeddedPort, filepath.Join(cfg.EmbeddedDir, "run"))
	// The sample starts its server with the machine's binaries if it has
	// any, else with those it downloads (embeddedpostgres.V17).
	if sampleUses := local != "" && found == local || local == "" && major == "17"; sampleUses {
		return what + fmt.Sprintf(": start it with `go run ./cmd/orderdemo -orders 0 -serve` (it serves until Ctrl-C) or `%s`, then run this again", pgctl)
	}
	return what + fmt.Sprintf(": start it with `%s`, then run this again (not with the sample: its PostgreSQL is another version, and would set the data up afresh)", pgctl)
}

// shellQuote quotes s for a POSIX shell.
func shellQuote(s string) string { return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'" }
