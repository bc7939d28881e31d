package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"time"

	"github.com/pgsaga/pgsaga/cmd/internal/brokers"
	"github.com/pgsaga/pgsaga/cmd/internal/cliargs"
	"github.com/pgsaga/pgsaga/internal/cmdlog"
	"github.com/pgsaga/pgsaga/internal/obs"
)

var errHelp = errors.New("help requested")

// options are the command's flags. Their names are a contract.
type options struct {
	// getenv reads DATABASE_URL and PAYMENTS_DATABASE_URL (os.Getenv).
	getenv func(string) string

	orders  int
	workers int
	timeout time.Duration
	resume  bool
	json    bool
	// serve keeps the workers running after the report, until SIGINT or
	// SIGTERM, to carry out operators' requests (pgsaga retry, cancel).
	serve bool
	// log: -v, -log-level, -log-format.
	log cmdlog.Flags

	// declineRefunds makes the fake gateway decline every refund: a saga
	// whose compensation needs one parks for an operator.
	declineRefunds bool
	// metricsAddr serves Prometheus metrics at http://metricsAddr/metrics
	// while it runs ("": off).
	metricsAddr string
	// paymentsService is a broker URL: the payment service runs on a
	// database of its own, reached through that broker ("": one
	// database, as one service).
	paymentsService string

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

// envPaymentsService gives -payments-service when the flag is not given:
// a broker URL may hold a password, and every user of the machine can
// read a command line.
const envPaymentsService = "ORDERDEMO_PAYMENTS_SERVICE"

func parseFlags(args []string, stderr io.Writer) (options, error) {
	var o options
	fs := flag.NewFlagSet("orderdemo", flag.ContinueOnError)
	// The flag package prints its error and the whole usage on a bad flag;
	// run prints one line instead, and the usage goes out on -h only.
	fs.SetOutput(io.Discard)
	fs.IntVar(&o.orders, "orders", 50, "orders to place")
	fs.IntVar(&o.workers, "workers", 1, "independent workers (routers and consumer sets) in this process")
	fs.DurationVar(&o.timeout, "timeout", 2*time.Minute, "give up waiting for terminal states after this long")
	fs.BoolVar(&o.resume, "resume", false, "place no new orders: drive every unfinished saga in the database to a terminal state, then exit")
	fs.BoolVar(&o.json, "json", false, "print the final summary as one JSON object on the last line of stdout")
	fs.BoolVar(&o.serve, "serve", false, "after the report, keep the workers running until SIGINT or SIGTERM, carrying out operators' requests (pgsaga retry, pgsaga cancel); with -orders 0, serve only")
	o.log.Register(fs, "warn (nothing with chaos flags)")
	fs.StringVar(&o.metricsAddr, "metrics-addr", "", "serve Prometheus metrics at http://ADDR/metrics while it runs, e.g. 127.0.0.1:9090 (port 0 picks one; the address is printed)")
	fs.StringVar(&o.paymentsService, "payments-service", "", "run the payment step as a service of its own, on a second database (PAYMENTS_DATABASE_URL, else the first one's name + _payments), reached through this broker: "+brokers.Schemes+" (default $"+envPaymentsService+", which keeps its password off the command line)")
	fs.BoolVar(&o.declineRefunds, "decline-refunds", false, "the payment gateway declines every refund: a saga whose compensation needs one (an order cancelled after it was charged) parks as failed, its charge held, for an operator")
	fs.Float64Var(&o.duplicateRate, "duplicate-rate", 0, "chaos: share of messages delivered again (copies arrive late and out of order)")
	fs.Float64Var(&o.crashRate, "crash-rate", 0, "chaos: share of handler attempts crashed at a commit boundary (45% of them before commit, 45% after commit before the ack, 10% by killing the database connection)")
	fs.Float64Var(&o.gatewayFaultRate, "gateway-fault-rate", 0, "chaos: share of payment gateway calls that are slow, fail with 503, lose their answer after acting, or decline a charge")
	fs.Uint64Var(&o.seed, "seed", 0, "seed of the order plan and the chaos (default: random, printed)")
	fs.Usage = func() {}
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			printUsage(fs, stderr)
			return o, errHelp
		}
		return o, err
	}
	if !flagSet(fs, "payments-service") {
		o.paymentsService = os.Getenv(envPaymentsService)
	}
	err := validate(fs, &o)
	return o, err
}

func printUsage(fs *flag.FlagSet, w io.Writer) {
	fmt.Fprintf(w, `Usage: orderdemo [flags]

Runs the sample order-payment saga end to end and reports how every saga
ended. Exit status:

  0  every saga it waited for is terminal and every invariant holds; a saga
     parked because the gateway declined its refund (-decline-refunds) is
     reported as parked, with its reason, and breaks no invariant (its
     charge is held, as the ledger and the gateway agree); any other parked
     saga does;
  1  otherwise: sagas left unfinished (-timeout, or SIGINT or SIGTERM, which
     stop the wait: the workers stop and the report follows), an invariant
     broken, or a worker that stopped during the run or while serving (its
     cause is printed);
  2  bad flags;
  3  it cannot start: no database, a worker that cannot run, or a database
     whose unfinished sagas ran in the other mode (with or without
     -payments-service: finish them in that mode first); the cause is
     printed.

A run that fails once started (1, or 3 when a worker cannot run) then says
how many sagas of the database are unfinished and the exact command that
finishes them (-resume, in the run's mode), or that none is. A connection
lost on the way (sessions terminated, a server restart) is ridden out.

With -serve, SIGINT or SIGTERM after the report ends the serving, which is
no failure: the exit status is the run's (0 for -orders 0).

The database is DATABASE_URL, else a PostgreSQL on 127.0.0.1:5432 (database
"pgsaga", created if missing), else an embedded PostgreSQL it starts. With
-payments-service, the payment service has a database of its own:
PAYMENTS_DATABASE_URL, else one named after the first with "_payments", on
the same server (created if missing).

Flags:
`)
	fs.SetOutput(w)
	fs.PrintDefaults()
}

// validate checks the parsed flags together.
func validate(fs *flag.FlagSet, o *options) error {
	switch {
	case fs.NArg() > 0:
		return cliargs.Unexpected(fs.Args())
	case o.orders < 0:
		return fmt.Errorf("-orders must not be negative, got %d", o.orders)
	case o.orders > 100_000:
		return fmt.Errorf("-orders must be at most 100000, got %d", o.orders)
	case o.workers < 1 || o.workers > 16:
		return fmt.Errorf("-workers must be between 1 and 16, got %d", o.workers)
	case o.timeout <= 0:
		return fmt.Errorf("-timeout must be positive, got %s", o.timeout)
	case o.resume && flagSet(fs, "orders"):
		return errors.New("-resume places no orders; drop -orders")
	}
	if err := o.log.Validate(fs); err != nil {
		return err
	}
	if o.metricsAddr != "" {
		if err := obs.CheckMetricsAddr(o.metricsAddr); err != nil {
			return err
		}
	}
	if o.paymentsService != "" {
		if err := brokers.Check(o.paymentsService); err != nil {
			return fmt.Errorf("-payments-service: %w", err)
		}
	}
	for name, r := range map[string]float64{"-duplicate-rate": o.duplicateRate, "-crash-rate": o.crashRate, "-gateway-fault-rate": o.gatewayFaultRate} {
		if r < 0 || r > 1 || r != r {
			return fmt.Errorf("%s must be between 0 and 1, got %v", name, r)
		}
	}
	o.seedSet = flagSet(fs, "seed")
	return nil
}

func flagSet(fs *flag.FlagSet, name string) bool {
	set := false
	fs.Visit(func(f *flag.Flag) { set = set || f.Name == name })
	return set
}
