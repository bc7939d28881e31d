// Command pgsaga is the operator's tool: it lists and inspects sagas, dead
// letters and the schema of the database the workers use, and serves the
// same as web pages. The database is --database-url, else DATABASE_URL,
// else the PG* variables as libpq reads them, else the embedded server of
// a sample running on this machine; pgsaga starts no server and creates no
// database (only migrate creates tables).
//
//	pgsaga [--database-url URL] <command>
//	pgsaga sagas [--status S]... [--saga NAME] [--older-than D] [--limit N] [--json]
//	pgsaga show <saga-id> [--json]
//	pgsaga retry <saga-id> [--no-wait] [--timeout D] [--json]
//	pgsaga retry (--status S... | --saga NAME | --older-than D)... --yes [--no-wait] [--timeout D] [--json]
//	pgsaga cancel <saga-id> [--reason R] [--no-wait] [--timeout D] [--json]
//	pgsaga cancel (--status S... | --saga NAME | --older-than D)... --yes [--reason R] [--no-wait] [--timeout D] [--json]
//	pgsaga dead-letters [--topic T] [--limit N] [--json]
//	pgsaga dead-letters show <id> [--json] [--payload-out FILE|-]
//	pgsaga dead-letters replay <id>...
//	pgsaga dead-letters delete (<id>... | --topic T --older-than D) --yes
//	pgsaga consumers [--stale D] [--json]
//	pgsaga consumers drop <group> [--topic T] [--stale D] [--force] --yes
//	pgsaga relay --broker URL --topic T [--topic T]... [--batch N] [--report-every D] [serving flags]
//	pgsaga ui [--addr 127.0.0.1:8080] [--allow-host NAME]... [serving flags]
//	pgsaga migrate [--dry-run] [--show-sql]
//	pgsaga version [--json]
//
// The serving flags of relay and ui: [-v | --log-level L] [--log-format
// text|json] [--metrics-addr A]; both trace from the standard
// OpenTelemetry environment (OTEL_TRACES_EXPORTER, OTEL_EXPORTER_OTLP_*).
//
// ui serves the operator's web view until SIGINT or SIGTERM: the sagas by
// status, a saga's timeline drawn as a picture with its Retry and Cancel
// buttons, the dead letters with a Replay button each, and the consumer
// groups. Its pages are rendered on the server; it loads nothing from
// elsewhere.
//
// relay relays topics of the workers' database to a message broker (NATS
// JetStream, nats://; Kafka, kafka://) until SIGINT or SIGTERM, as a
// process of its own (workers can run it themselves: saga.ClientConfig.Broker).
//
// migrate --dry-run --show-sql prints the SQL of the pending migrations,
// with the rows that record them, for a team's own migration tool.
//
// Exit status: 0 done, 1 the operation failed (no database, no such saga,
// a request refused or not carried out), 2 usage (a bad flag or argument;
// a destructive command without --yes, after saying what it would do).
//
// Human-readable output escapes what a terminal would act on (see
// internal/termsafe); --json output holds every value as stored.
package main

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"syscall"

	"github.com/spf13/cobra"

	"github.com/pgsaga/pgsaga/cmd/internal/cliargs"
	"github.com/pgsaga/pgsaga/internal/pgdb"
	"github.com/pgsaga/pgsaga/internal/termsafe"
	"github.com/pgsaga/pgsaga/migrations"
	"github.com/pgsaga/pgsaga/saga"
)

// Exit statuses.
const (
	exitOK     = 0
	exitFailed = 1
	exitUsage  = 2
)

func main() { os.Exit(runMain(os.Args[1:])) }

// runMain runs the command line args as the program does: SIGINT and
// SIGTERM end what it is doing (ui shuts down gracefully).
func runMain(args []string) int {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	return run(ctx, args, os.Stdout, os.Stderr)
}

// usageError is a bad flag or argument: exit status 2.
type usageError struct{ err error }

func (e usageError) Error() string { return e.err.Error() }
func (e usageError) Unwrap() error { return e.err }

func usagef(format string, args ...any) error { return usageError{fmt.Errorf(format, args...)} }

// run runs the command line args and returns the exit status.
func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	root := newRoot(stdout, stderr)
	root.SetArgs(args)
	cmd, err := root.ExecuteContextC(ctx)
	if err == nil {
		return exitOK
	}
	fmt.Fprintln(stderr, "pgsaga:", termsafe.Sentence(cliargs.Redact(err.Error(), args)))
	var u usageError
	if errors.As(err, &u) || cmd == nil || isCobraUsage(err) {
		if cmd != nil {
			fmt.Fprintf(stderr, "Run '%s --help' for usage.\n", cmd.CommandPath())
		}
		return exitUsage
	}
	return exitFailed
}

// noArgs is cobra.NoArgs without echoing the arguments (cobra's says
// `unknown command "ARG"`): one may be a URL with a password, given
// without its flag.
func noArgs(cmd *cobra.Command, args []string) error {
	if len(args) == 0 {
		return nil
	}
	return usagef("%s takes no arguments, only flags; got %d (not shown: one may hold a secret; a flag's value goes after the flag, like --broker URL)",
		cmd.CommandPath(), len(args))
}

// isCobraUsage reports whether err is cobra's own complaint about the
// command line (an unknown flag, a missing argument, an unknown command).
func isCobraUsage(err error) bool {
	var failed *cliError
	return !errors.As(err, &failed)
}

// cliError is an operation that failed once the command line was
// understood: exit status 1.
type cliError struct{ err error }

func (e *cliError) Error() string { return e.err.Error() }
func (e *cliError) Unwrap() error { return e.err }

// failed marks err as the operation's failure (exit 1), not a usage error.
func failed(err error) error {
	var u usageError
	if err == nil || errors.As(err, &u) {
		return err
	}
	return &cliError{err}
}

func newRoot(stdout, stderr io.Writer) *cobra.Command {
	root := &cobra.Command{
		Use:   "pgsaga",
		Short: "Operate pgsaga: sagas, dead letters, consumers, schema; a web view of them",
		Long: "pgsaga reads the database the workers use: --database-url, else DATABASE_URL, else the PG* variables as libpq reads them (PGHOST, PGPORT, PGDATABASE, PGUSER, PGPASSWORD, ~/.pgpass, …), " +
			"else the embedded server of a sample running on this machine. It starts no server and creates no database; only migrate creates tables.",
		SilenceUsage:  true,
		SilenceErrors: true,
	}
	var databaseURL string
	root.PersistentFlags().StringVar(&databaseURL, "database-url", "", "the workers' database, as a libpq URL or keyword/value string (default $DATABASE_URL, then the PG* variables); a password is better kept in $PGPASSWORD or ~/.pgpass than on the command line")
	root.PersistentPreRun = func(cmd *cobra.Command, _ []string) {
		cmd.SetContext(withDatabaseURL(cmd.Context(), databaseURL))
	}
	root.SetOut(stdout)
	root.SetErr(stderr)
	root.SetFlagErrorFunc(func(_ *cobra.Command, err error) error { return usageError{err} })
	root.AddCommand(sagasCmd(), showCmd(), retryCmd(), cancelCmd(), deadLettersCmd(), consumersCmd(), relayCmd(), uiCmd(), migrateCmd(), versionCmd())
	return root
}

// open opens the workers' database (see resolve), with a pool of conns.
func open(ctx context.Context, conns int32) (*pgdb.DB, target, error) {
	t, err := resolve(ctx)
	if err != nil {
		return nil, t, failed(err)
	}
	db, err := pgdb.Open(ctx, pgdb.Config{URL: t.url, Environment: t.env, MaxConns: conns, ApplicationName: "pgsaga"})
	if err != nil {
		if t.found != nil {
			_ = t.found.Close()
		}
		return nil, t, failed(fmt.Errorf("%w (the database named by %s)", err, t.from))
	}
	return db, t, nil
}

// withDB runs fn on the workers' database.
func withDB(ctx context.Context, fn func(db *pgdb.DB) error) error {
	return onDB(ctx, false, fn)
}

// withSchema runs fn on the workers' database, once it is known to hold
// pgsaga's tables.
func withSchema(ctx context.Context, fn func(db *pgdb.DB) error) error {
	return onDB(ctx, true, fn)
}

// withClient runs fn with an unstarted saga client on the workers'
// database, once it is known to hold pgsaga's tables: the operator calls
// (saga.Client.Get, List, Ask, …) need no worker of their own.
func withClient(ctx context.Context, fn func(c *saga.Client) error) error {
	return withSchema(ctx, func(db *pgdb.DB) error {
		c, err := operatorClient(db.SQL, nil)
		if err != nil {
			return err
		}
		return fn(c)
	})
}

// operatorClient is a saga client over db that is never started: it runs
// no worker and registers no saga.
func operatorClient(db *sql.DB, log *slog.Logger) (*saga.Client, error) {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return saga.NewClientFromDB(db, saga.ClientConfig{Logger: log})
}

func onDB(ctx context.Context, needSchema bool, fn func(db *pgdb.DB) error) error {
	return onFound(ctx, needSchema, commandConns, func(db *pgdb.DB, _ target) error { return fn(db) })
}

// commandConns is the pool of a command: the operator's commands and the
// web view run a few statements at a time.
const commandConns = 4

// onFound is onDB for a command that also says where the database is, with
// a pool of conns.
func onFound(ctx context.Context, needSchema bool, conns int32, fn func(db *pgdb.DB, found target) error) error {
	db, found, err := open(ctx, conns)
	if err != nil {
		return err
	}
	if found.found != nil {
		defer found.found.Close()
	}
	defer db.Close()
	if needSchema {
		current, _, err := migrations.Version(ctx, db.SQL)
		if err != nil {
			return failed(err)
		}
		if current == 0 {
			return failed(fmt.Errorf("%s holds no pgsaga schema: point --database-url (or DATABASE_URL) at the database your workers use, or run `pgsaga migrate`", found.describe()))
		}
	}
	return failed(fn(db, found))
}
