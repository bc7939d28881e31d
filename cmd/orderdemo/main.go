// Command orderdemo runs the sample order-payment saga end to end: it finds
// or starts a PostgreSQL, applies the migrations, starts a fake payment
// gateway and the workers in this process, seeds customers, places orders
// (some beyond the customer's balance, some cancelled by the customer
// mid-way), shows progress, and ends with a report and the invariants.
//
// Usage:
//
//	go run ./cmd/orderdemo [-orders 50] [-workers 1] [-timeout 2m] [-resume] [-json]
//
// Exit status 0 only if every saga it waited for is terminal and every
// invariant holds. Kill it at any moment (even with kill -9) and run it again
// with -resume to finish the job.
package main

import (
	"context"
	"fmt"
	"io"
	"os"
	"os/signal"
	"syscall"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}

// Exit codes.
const (
	exitOK        = 0
	exitFailed    = 1 // sagas left unfinished, or an invariant broken
	exitUsage     = 2
	exitNoService = 3 // no database, gateway could not start, …
)

func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	opts, err := parseFlags(args, stderr)
	if err != nil {
		if err == errHelp {
			return exitOK
		}
		fmt.Fprintln(stderr, "orderdemo:", err)
		return exitUsage
	}
	d, err := newDemo(ctx, opts, stdout, stderr)
	if err != nil {
		fmt.Fprintln(stderr, "orderdemo:", err)
		return exitNoService
	}
	defer d.close()
	return d.run(ctx)
}
