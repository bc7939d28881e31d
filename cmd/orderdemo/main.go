// Command orderdemo runs the sample order-payment saga end to end: it finds
// or starts a PostgreSQL, applies the migrations, starts a fake payment
// gateway and the workers in this process, seeds customers, places orders
// (some beyond the customer's balance, some cancelled by the customer
// mid-way), shows progress, and ends with a report and the invariants.
//
// Usage:
//
//	go run ./cmd/orderdemo [-orders 50] [-workers 1] [-timeout 2m] [-resume] [-json]
//		[-serve] [-decline-refunds] [-metrics-addr A] [-v | -log-level L] [-log-format text|json]
//
// Exit status 0 only if every saga it waited for is terminal and every
// invariant holds (a saga parked by a declined refund, as -decline-refunds
// asks, breaks none; it is reported as parked). Kill it at any moment (even
// with kill -9) and run it again with -resume to finish the job. With
// -serve it then keeps its workers running, carrying out operators'
// requests (pgsaga retry, pgsaga cancel), until SIGINT or SIGTERM.
package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/pgsaga/pgsaga/cmd/internal/cliargs"
	"github.com/pgsaga/pgsaga/internal/cmdlog"
	"github.com/pgsaga/pgsaga/internal/obs"
)

func main() { os.Exit(runWithSignals(os.Args[1:], os.Stdout, os.Stderr)) }

// runWithSignals runs the command; SIGINT or SIGTERM ends the wait for the
// sagas as -timeout does (the workers stop, the report follows, exit 1).
func runWithSignals(args []string, stdout, stderr io.Writer) int {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	return run(ctx, args, stdout, stderr)
}

// Exit codes.
const (
	exitOK        = 0
	exitFailed    = 1 // sagas left unfinished, or an invariant broken
	exitUsage     = 2
	exitNoService = 3 // no database, gateway or worker could not start, …
)

func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	return runEnv(ctx, os.Getenv, args, stdout, stderr)
}

// runEnv is run with the environment that names the databases
// (DATABASE_URL, PAYMENTS_DATABASE_URL) read through getenv: tests that run
// side by side give each run its own.
func runEnv(ctx context.Context, getenv func(string) string, args []string, stdout, stderr io.Writer) int {
	opts, err := parseFlags(args, stderr)
	if err != nil {
		if errors.Is(err, errHelp) {
			return exitOK
		}
		fmt.Fprintf(stderr, "orderdemo: %s (orderdemo -h lists the flags)\n", cliargs.Redact(err.Error(), args))
		return exitUsage
	}
	opts.getenv = getenv
	stderr = cmdlog.Synced(stderr) // progress, logs and spans share it
	stopTracing, err := obs.Tracing(ctx, "orderdemo", stderr)
	if err != nil {
		fmt.Fprintln(stderr, "orderdemo:", err)
		return exitNoService
	}
	defer func() {
		sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
		defer cancel()
		if err := stopTracing(sctx); err != nil {
			fmt.Fprintln(stderr, "orderdemo: flushing traces:", err)
		}
	}()
	d, err := newDemo(ctx, opts, stdout, stderr)
	if err != nil {
		fmt.Fprintln(stderr, "orderdemo:", err)
		return exitNoService
	}
	defer d.close()
	return d.run(ctx)
}
