package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"regexp"
	"time"

	"github.com/pgsaga/pgsaga/cmd/internal/brokers"
	"github.com/pgsaga/pgsaga/cmd/internal/cliargs"
	"github.com/pgsaga/pgsaga/internal/cmdlog"
	"github.com/pgsaga/pgsaga/internal/obs"
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
	// log: -v, -log-level, -log-format (the worker processes' too).
	log cmdlog.Flags
	// workerProcs runs the workers as this many separate processes instead
	// of -workers in this one.
	workerProcs int
	// asyncProjection delivers the order events to the projection instead
	// of projecting them inline.
	asyncProjection bool
	// queueEveryHop queues every command and reply (no in-process
	// deliveries).
	queueEveryHop bool
	// gatewayDelay: every gateway call answers after it.
	gatewayDelay time.Duration
	profile      string
	// statementList: write the throughput phase's statements, a saga
	// each, to this file.
	statementList string
	// metricsAddr serves Prometheus metrics at http://metricsAddr/metrics
	// during the run ("": off); each worker process serves its own.
	metricsAddr string
	// paymentsService is a broker URL: the payment service runs on a
	// second fresh database, reached through that broker ("": one
	// database).
	paymentsService string
	// drop names benchmark databases to drop (-drop, repeated): the run
	// does only that.
	drop []string
}

// placers is how many clients place orders, each on a connection of its
// own: no more than sagas may be in flight (more would only wait for a
// slot), at most the constant placers, and at least two (the smallest
// pool).
func (o options) placers() int { return max(2, min(placers, o.inflight)) }

// envPaymentsService gives -payments-service when the flag is not given:
// a broker URL may hold a password, and every user of the machine can
// read a command line.
const envPaymentsService = "SAGABENCH_PAYMENTS_SERVICE"

func parseFlags(args []string, stderr io.Writer) (options, error) {
	var o options
	fs := flag.NewFlagSet("sagabench", flag.ContinueOnError)
	// The flag package prints its error and the whole usage on a bad flag;
	// run prints one line instead, and the usage goes out on -h only.
	fs.SetOutput(io.Discard)
	fs.IntVar(&o.sagas, "sagas", 20_000, "throughput phase: sagas to run (closed loop); 0 skips the phase")
	fs.IntVar(&o.inflight, "inflight", 500, "throughput phase: sagas in flight at most (also bounds the clients placing orders, at most 32, each a connection)")
	fs.Float64Var(&o.rate, "rate", 100, "latency phase: sagas offered per second (open loop); 0 skips the phase")
	fs.DurationVar(&o.duration, "duration", 30*time.Second, "latency phase: how long to offer them")
	fs.IntVar(&o.consumers, "consumers", defaultConsumers, "consumers each handler of the worker runs in parallel")
	fs.IntVar(&o.consumers, "lanes", defaultConsumers, "old name of -consumers (delivery no longer has lanes)")
	fs.IntVar(&o.workers, "workers", 1, "independent workers (routers) in this process")
	fs.IntVar(&o.workerProcs, "worker-processes", 0, "run the workers as this many separate processes (copies of this program) instead of -workers in this one; 0: none")
	fs.IntVar(&o.batch, "batch", defaultBatch, "messages a subscriber reads per transaction")
	fs.DurationVar(&o.baseline, "baseline", 5*time.Second, "how long to measure PostgreSQL's own commit rate; 0 skips it")
	fs.DurationVar(&o.idle, "idle", 10*time.Second, "how long to measure CPU use while idle; 0 skips it")
	fs.DurationVar(&o.timeout, "timeout", 10*time.Minute, "give up waiting for a phase's sagas after this long")
	fs.StringVar(&o.profile, "cpuprofile", "", "write a CPU profile of the throughput phase to this file (go tool pprof)")
	fs.StringVar(&o.statementList, "statement-list", "", "write the throughput phase's statements to this file, one a line: calls a saga, owner, statement (most called first)")
	fs.BoolVar(&o.keep, "keep", false, "keep the benchmark database instead of dropping it")
	fs.BoolVar(&o.queueEveryHop, "queue-every-hop", false, "send every trigger, command and reply through the queue, as with one process per participant, instead of starting each saga in Place's transaction and delivering the orders steps and the engine's replies in process")
	fs.BoolVar(&o.asyncProjection, "async-projection", false, "keep order_views by delivering each order event to the projection's consumer group, instead of inline in the appending transaction")
	fs.StringVar(&o.metricsAddr, "metrics-addr", "", "serve Prometheus metrics at http://ADDR/metrics during the run, e.g. 127.0.0.1:9090 (port 0 picks one; printed); each -worker-processes process serves its own on a free port, printed too")
	fs.StringVar(&o.paymentsService, "payments-service", "", "run the payment step as a service of its own, on a second fresh database, reached through this broker ("+brokers.Schemes+"); the sample's topics there are deleted first (the run starts fresh), so the broker must be the run's own (default $"+envPaymentsService+", which keeps its password off the command line)")
	fs.DurationVar(&o.gatewayDelay, "gateway-delay", 0, "the fake payment gateway answers every call after this long (a real gateway takes 100ms to seconds); at most 1s")
	fs.Func("drop", "drop this benchmark database (pgsaga_bench_…, as a run that could not drop its own names it) on the server the run used, and do nothing else; repeat it for several", func(name string) error {
		o.drop = append(o.drop, name)
		return nil
	})
	o.log.Register(fs, "warn")
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
	fmt.Fprint(w, usageText)
	fs.SetOutput(w)
	fs.PrintDefaults()
}

// usageText is the head of -h. It describes every field of the JSON line
// (a test holds it to that).
const usageText = `Usage: sagabench [flags]

Runs the order-payment saga workload on a fresh database (created next to
the one cmd/orderdemo uses, dropped afterwards) and prints the figures, the
last line of stdout being one JSON object. Exit status 0 only if every saga
finished and every invariant holds; 1 otherwise (SIGINT or SIGTERM ends the
phase under way, the figures so far are printed; a worker that stops during
the run ends it with its cause); 2 for bad flags; 3 when it cannot start
(no database, too few connections, a worker that cannot run: the cause is
printed).

A lost connection (sessions terminated, a server restart) is ridden out:
placing an order, seeding, creating and dropping the database are retried
for about eleven seconds. The database is dropped whatever ends the run
(an error, SIGINT or SIGTERM, a panic); when the server cannot be reached
to drop it, the run says so with the command that does, once it can:
sagabench -drop NAME (exit 0 once dropped, 3 if it cannot be).

The JSON line (its field names are a contract; a skipped phase's figures
are 0):

    ok                      every saga finished, every invariant holds and the
                            run was not interrupted (as the exit status)
  Throughput phase (closed loop, -sagas, -inflight):
    sagas                   sagas run
    sagas_per_s             sagas ended a second, first placement to last end
    steps_per_s             idempotent steps a second: saga reactions (a start,
                            a reply applied) and participant steps
    steps_per_saga          steps a saga (5 for this saga)
    throughput_s            how long the phase took, seconds
    sagas_per_s_by_quarter  sagas_per_s in each quarter of the phase: flat when
                            nothing degrades as the tables fill
    topic_rows_left         messages still queued at the end (retention runs)
    cpu_s_per_1k_sagas      CPU seconds per 1,000 sagas: process (this one),
                            postgres (every server process; null when they
                            cannot be read)
    statements_per_saga     statements a saga, gateway's included: counted by
                            pg_stat_statements in the run's database when the
                            server preloads it, else by this program's pools
    statements_source       "pg_stat_statements" or "client": which count;
                            "unavailable" (statements_per_saga 0) with
                            -worker-processes and no pg_stat_statements
    client_statements_per_saga
                            statements this process's pools sent a saga
                            (BEGIN and COMMIT included; not those of
                            -worker-processes)
    statements_by_owner     statements_per_saga by who sent them, told from
                            each statement's text: delivery (pgsaga's queue,
                            publishes, wake-ups, idempotency keys), engine
                            (saga instances, history, requests), domain (the
                            sample's orders, payments and event streams),
                            gateway (the fake gateway's own), transactions
                            (BEGIN, COMMIT, savepoints, whoever opened them);
                            null when statements_source is "unavailable"
    commits_per_saga        commits this process's pools made a saga: each
                            COMMIT, and each statement or pipeline sent
                            outside a transaction; the fake gateway's apart;
                            0 with -worker-processes
    gateway_commits_per_saga
                            the fake gateway's own commits a saga (its
                            bookkeeping, not the saga's)
    round_trips_per_saga    round trips this process's pools made a saga:
                            each statement sent on its own, each pipeline
                            once; the fake gateway's apart; 0 with
                            -worker-processes
  Latency phase (open loop, -rate, -duration):
    rate                    sagas offered a second
    latency_sagas           sagas timed, each from its scheduled placement to
                            the notification of its end
    p50_ms, p95_ms, p99_ms, max_ms
                            their latency percentiles and maximum
  Baseline (-baseline):
    commit_tps              PostgreSQL's single-row insert commits a second at
                            16 connections, on the same database
    steps_per_commit        steps_per_s / commit_tps
  Idle (-idle):
    idle_cpu_pct            CPU use while nothing happens, percent of one core:
                            process, postgres (as above)
  Every saga of the run, checked at the end (as cmd/orderdemo checks):
    completed, compensated, failed, unfinished
                            sagas by final status
    invariants_ok           every invariant holds
    violations              the broken ones, in words
  The run:
    config                  the settings: consumers, lanes (old name of
                            consumers), workers, batch, inflight, duration_s,
                            baseline_s, idle_s, async_projection (true: the
                            order_views projection ran as a consumer),
                            queue_every_hop (true: no in-process
                            deliveries), gateway_delay_ms (-gateway-delay),
                            worker_processes (workers run as that many
                            processes; their CPU counts as the process's),
                            payments_service (true: the payment step ran on
                            a second database, over -payments-service's
                            broker; its invariants checked across both)
    machine                 cores, goos, goarch, go (version), postgres (server
                            version)

Flags:
`

// benchDatabase matches the names of the databases runs create, the only
// ones -drop drops.
var benchDatabase = regexp.MustCompile(`^` + benchDatabasePrefix + `[0-9a-f]{8}(` + paymentsDatabaseSuffix + `)?$`)

// validate checks the parsed flags together.
func validate(fs *flag.FlagSet, o *options) error {
	for _, name := range o.drop {
		if !benchDatabase.MatchString(name) {
			return fmt.Errorf("-drop takes the benchmark's databases only (%s and 8 hex digits, %s after them for the payment service's), got %q",
				benchDatabasePrefix, paymentsDatabaseSuffix, name)
		}
	}
	switch {
	case fs.NArg() > 0:
		return cliargs.Unexpected(fs.Args())
	case o.sagas < 0 || o.sagas > 1_000_000:
		return fmt.Errorf("-sagas must be between 0 and 1000000, got %d", o.sagas)
	case o.inflight < 1:
		return fmt.Errorf("-inflight must be positive, got %d", o.inflight)
	case o.rate < 0 || o.rate > 10_000 || o.rate != o.rate:
		return fmt.Errorf("-rate must be between 0 and 10000, got %v", o.rate)
	case o.rate > 0 && o.duration <= 0:
		return fmt.Errorf("-duration must be positive, got %s", o.duration)
	case o.consumers < 1 || o.consumers > 64:
		return fmt.Errorf("-consumers must be between 1 and 64, got %d", o.consumers)
	case o.workers < 1 || o.workers > 16:
		return fmt.Errorf("-workers must be between 1 and 16, got %d", o.workers)
	case o.workerProcs < 0 || o.workerProcs > 16:
		return fmt.Errorf("-worker-processes must be between 0 and 16, got %d", o.workerProcs)
	case o.gatewayDelay < 0 || o.gatewayDelay > time.Second:
		return fmt.Errorf("-gateway-delay must be between 0 and 1s (the gateway client's timeout is 2s), got %s", o.gatewayDelay)
	case o.batch < 1 || o.batch > 1000:
		return fmt.Errorf("-batch must be between 1 and 1000, got %d", o.batch)
	case o.baseline < 0 || o.idle < 0:
		return errors.New("-baseline and -idle must not be negative")
	case o.timeout <= 0:
		return fmt.Errorf("-timeout must be positive, got %s", o.timeout)
	case o.sagas == 0 && o.rate == 0:
		return errors.New("nothing to measure: -sagas and -rate are both 0")
	case o.profile != "" && o.sagas == 0:
		return errors.New("-cpuprofile profiles the throughput phase, which -sagas 0 skips")
	case o.statementList != "" && o.sagas == 0:
		return errors.New("-statement-list lists the throughput phase's statements, which -sagas 0 skips")
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
		if o.workerProcs > 0 {
			return errors.New("-payments-service runs the payment service in this process: it cannot be combined with -worker-processes")
		}
	}
	if o.profile != "" {
		// Found now, not after minutes of seeding.
		if err := checkWritable(o.profile); err != nil {
			return fmt.Errorf("-cpuprofile: %w", err)
		}
	}
	if o.statementList != "" {
		if err := checkWritable(o.statementList); err != nil {
			return fmt.Errorf("-statement-list: %w", err)
		}
	}
	return nil
}

// checkWritable fails unless path can be written as a file, and leaves the
// file system as it found it.
func checkWritable(path string) error {
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o644)
	if errors.Is(err, os.ErrExist) {
		if f, err = os.OpenFile(path, os.O_WRONLY, 0); err != nil {
			return err
		}
		return f.Close()
	}
	if err != nil {
		return err
	}
	_ = f.Close()
	return os.Remove(path)
}

// flagSet reports whether the flag name was given.
func flagSet(fs *flag.FlagSet, name string) bool {
	set := false
	fs.Visit(func(f *flag.Flag) { set = set || f.Name == name })
	return set
}
