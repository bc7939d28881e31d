package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"time"
)

var errHelp = errors.New("help requested")

// options are the command's flags. Their names are a contract.
type options struct {
	orders  int
	workers int
	timeout time.Duration
	resume  bool
	json    bool
	verbose bool
}

func parseFlags(args []string, stderr io.Writer) (options, error) {
	var o options
	fs := flag.NewFlagSet("orderdemo", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.IntVar(&o.orders, "orders", 50, "orders to place")
	fs.IntVar(&o.workers, "workers", 1, "independent workers (routers and consumer sets) in this process")
	fs.DurationVar(&o.timeout, "timeout", 2*time.Minute, "give up waiting for terminal states after this long")
	fs.BoolVar(&o.resume, "resume", false, "place no new orders: drive every unfinished saga in the database to a terminal state, then exit")
	fs.BoolVar(&o.json, "json", false, "print the final summary as one JSON object on the last line of stdout")
	fs.BoolVar(&o.verbose, "v", false, "log what the workers do (to stderr)")
	fs.Usage = func() {
		fmt.Fprintf(fs.Output(), `Usage: orderdemo [flags]

Runs the sample order-payment saga end to end and reports how every saga
ended. Exit status 0 only if every saga it waited for is terminal and every
invariant holds; 1 otherwise; 2 for bad flags; 3 when it cannot start.

The database is DATABASE_URL, else a PostgreSQL on 127.0.0.1:5432 (database
"pgsaga", created if missing), else an embedded PostgreSQL it starts.

Flags:
`)
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return o, errHelp
		}
		return o, err
	}
	switch {
	case fs.NArg() > 0:
		return o, fmt.Errorf("unexpected arguments %q (flags only; see -h)", fs.Args())
	case o.orders < 0:
		return o, fmt.Errorf("-orders must not be negative, got %d", o.orders)
	case o.orders > 100_000:
		return o, fmt.Errorf("-orders must be at most 100000, got %d", o.orders)
	case o.workers < 1 || o.workers > 16:
		return o, fmt.Errorf("-workers must be between 1 and 16, got %d", o.workers)
	case o.timeout <= 0:
		return o, fmt.Errorf("-timeout must be positive, got %s", o.timeout)
	case o.resume && flagSet(fs, "orders"):
		return o, errors.New("-resume places no orders; drop -orders")
	}
	return o, nil
}

func flagSet(fs *flag.FlagSet, name string) bool {
	set := false
	fs.Visit(func(f *flag.Flag) { set = set || f.Name == name })
	return set
}
