// Command sagabench measures the order-payment saga on a fresh database and
// prints the figures as one JSON object on the last line of stdout.
//
// It runs, in order:
//
//   - a baseline: PostgreSQL's own single-insert commit rate at 16
//     connections on the same database (commit_tps), so the saga figures
//     read as a fraction of what the machine can commit;
//   - the throughput phase: a closed loop of -sagas sagas, at most
//     -inflight in flight at once (sagas_per_s, steps_per_s);
//   - the latency phase: an open loop offering -rate sagas a second for
//     -duration, each timed from its scheduled placement to the moment its
//     saga's end is visible (p50_ms, p95_ms, p99_ms);
//   - an idle phase: CPU used while nothing happens, for -idle;
//
// and then checks the same invariants as cmd/orderdemo over every saga. A
// run that breaks them reports failure (exit status 1), whatever its speed.
//
// Usage:
//
//	go run ./cmd/sagabench [-sagas 20000] [-rate 100] [-duration 30s] [-consumers 2] [-workers 1] [-batch 50]
//		[-metrics-addr A]
//
// Its database is dropped whatever ends the run; when the server cannot be
// reached to drop it, the run prints the command that does (-drop NAME).
//
// With -metrics-addr it serves Prometheus metrics during the run; the
// standard OpenTelemetry variables (OTEL_TRACES_EXPORTER,
// OTEL_EXPORTER_OTLP_ENDPOINT, ...) turn tracing on.
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

func main() {
	if spec, ok := os.LookupEnv(workerEnv); ok {
		os.Exit(runWorkerProcess(spec, os.Stdout, os.Stderr))
	}
	os.Exit(runWithSignals(os.Args[1:], os.Stdout, os.Stderr))
}

// runWithSignals runs the command; SIGINT or SIGTERM ends the phase under
// way as -timeout does (the workers stop, the figures follow, exit 1).
func runWithSignals(args []string, stdout, stderr io.Writer) int {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	return run(ctx, args, stdout, stderr)
}

// Exit codes.
const (
	exitOK        = 0
	exitFailed    = 1 // an invariant broken, or sagas left unfinished
	exitUsage     = 2
	exitNoService = 3 // no database, gateway or worker could not start, …
)

func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	opts, err := parseFlags(args, stderr)
	if err != nil {
		if errors.Is(err, errHelp) {
			return exitOK
		}
		fmt.Fprintf(stderr, "sagabench: %s (sagabench -h lists the flags)\n", cliargs.Redact(err.Error(), args))
		return exitUsage
	}
	stderr = cmdlog.Synced(stderr) // progress, logs and spans share it
	if len(opts.drop) > 0 {
		return dropNamed(ctx, opts, stdout, stderr)
	}
	stopTracing, err := obs.Tracing(ctx, "sagabench", stderr)
	if err != nil {
		fmt.Fprintln(stderr, "sagabench:", err)
		return exitNoService
	}
	defer flushTraces(ctx, stopTracing, stderr)
	b, err := newBench(ctx, opts, stdout, stderr)
	if err != nil {
		fmt.Fprintln(stderr, "sagabench:", err)
		return exitNoService
	}
	defer b.close()
	return b.run(ctx)
}

// flushTraces stops the tracer provider, exporting what it holds (at most
// five seconds).
func flushTraces(ctx context.Context, stop func(context.Context) error, stderr io.Writer) {
	sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer cancel()
	if err := stop(sctx); err != nil {
		fmt.Fprintln(stderr, "sagabench: flushing traces:", err)
	}
}
