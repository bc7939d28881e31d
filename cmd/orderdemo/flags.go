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

	duplicateRate    float64
	crashRate        float64
	gatewayFaultRate float64
	seed             uint64
	seedSet          bool
}

// chaos reports whether any fault is injected.
func (o options) chaos() bool {
	return o.duplicateRate > 0 || o.crashRate > 0 || o.gatewayFaultRate > 0
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
	fs.Float64Var(&o.duplicateRate, "duplicate-rate", 0, "chaos: share of messages delivered again (copies arrive late and out of order)")
	fs.Float64Var(&o.crashRate, "crash-rate", 0, "chaos: share of handler attempts crashed at a commit boundary (45% of them before commit, 45% after commit before the ack, 10% by killing the database connection)")
	fs.Float64Var(&o.gatewayFaultRate, "gateway-fault-rate", 0, "chaos: share of payment gateway calls that are slow, fail with 503, lose their answer after acting, or decline a charge")
	fs.Uint64Var(&o.seed, "seed", 0, "seed of the order plan and the chaos (default: random, printed)")
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
	for name, r := range map[string]float64{"-duplicate-rate": o.duplicateRate, "-crash-rate": o.crashRate, "-gateway-fault-rate": o.gatewayFaultRate} {
		if r < 0 || r > 1 || r != r {
			return o, fmt.Errorf("%s must be between 0 and 1, got %v", name, r)
		}
	}
	o.seedSet = flagSet(fs, "seed")
	return o, nil
}

func flagSet(fs *flag.FlagSet, name string) bool {
	set := false
	fs.Visit(func(f *flag.Flag) { set = set || f.Name == name })
	return set
}
