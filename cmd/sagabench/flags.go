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
	sagas     int
	inflight  int
	rate      float64
	duration  time.Duration
	consumers int
	workers   int
	batch     int
	baseline  time.Duration
	idle      time.Duration
	timeout   time.Duration
	keep      bool
	verbose   bool
	profile   string
}

func parseFlags(args []string, stderr io.Writer) (options, error) {
	var o options
	fs := flag.NewFlagSet("sagabench", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.IntVar(&o.sagas, "sagas", 20_000, "throughput phase: sagas to run (closed loop); 0 skips the phase")
	fs.IntVar(&o.inflight, "inflight", 500, "throughput phase: sagas in flight at most")
	fs.Float64Var(&o.rate, "rate", 100, "latency phase: sagas offered per second (open loop); 0 skips the phase")
	fs.DurationVar(&o.duration, "duration", 30*time.Second, "latency phase: how long to offer them")
	fs.IntVar(&o.consumers, "consumers", defaultConsumers, "consumers each handler of the worker runs in parallel")
	fs.IntVar(&o.consumers, "lanes", defaultConsumers, "old name of -consumers (delivery no longer has lanes)")
	fs.IntVar(&o.workers, "workers", 1, "independent workers (routers) in this process")
	fs.IntVar(&o.batch, "batch", defaultBatch, "messages a subscriber reads per transaction")
	fs.DurationVar(&o.baseline, "baseline", 5*time.Second, "how long to measure PostgreSQL's own commit rate; 0 skips it")
	fs.DurationVar(&o.idle, "idle", 10*time.Second, "how long to measure CPU use while idle; 0 skips it")
	fs.DurationVar(&o.timeout, "timeout", 10*time.Minute, "give up waiting for a phase's sagas after this long")
	fs.StringVar(&o.profile, "cpuprofile", "", "write a CPU profile of the throughput phase to this file (go tool pprof)")
	fs.BoolVar(&o.keep, "keep", false, "keep the benchmark database instead of dropping it")
	fs.BoolVar(&o.verbose, "v", false, "log what the workers do (to stderr)")
	fs.Usage = func() {
		fmt.Fprintf(fs.Output(), `Usage: sagabench [flags]

Runs the order-payment saga workload on a fresh database (created next to
the one cmd/orderdemo uses, dropped afterwards) and prints the figures, the
last line of stdout being one JSON object. Exit status 0 only if every saga
finished and every invariant holds; 1 otherwise; 2 for bad flags; 3 when it
cannot start.

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
	case o.sagas < 0 || o.sagas > 1_000_000:
		return o, fmt.Errorf("-sagas must be between 0 and 1000000, got %d", o.sagas)
	case o.inflight < 1:
		return o, fmt.Errorf("-inflight must be positive, got %d", o.inflight)
	case o.rate < 0 || o.rate > 10_000 || o.rate != o.rate:
		return o, fmt.Errorf("-rate must be between 0 and 10000, got %v", o.rate)
	case o.rate > 0 && o.duration <= 0:
		return o, fmt.Errorf("-duration must be positive, got %s", o.duration)
	case o.consumers < 1 || o.consumers > 64:
		return o, fmt.Errorf("-consumers must be between 1 and 64, got %d", o.consumers)
	case o.workers < 1 || o.workers > 16:
		return o, fmt.Errorf("-workers must be between 1 and 16, got %d", o.workers)
	case o.batch < 1 || o.batch > 1000:
		return o, fmt.Errorf("-batch must be between 1 and 1000, got %d", o.batch)
	case o.baseline < 0 || o.idle < 0:
		return o, errors.New("-baseline and -idle must not be negative")
	case o.timeout <= 0:
		return o, fmt.Errorf("-timeout must be positive, got %s", o.timeout)
	case o.sagas == 0 && o.rate == 0:
		return o, errors.New("nothing to measure: -sagas and -rate are both 0")
	}
	return o, nil
}
