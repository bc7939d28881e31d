package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"math/rand/v2"
	"slices"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/google/uuid"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/pgsaga/pgsaga/cmd/internal/brokers"
	"github.com/pgsaga/pgsaga/cmd/internal/workerwatch"
	"github.com/pgsaga/pgsaga/internal/brokers/brokerurl"
	"github.com/pgsaga/pgsaga/internal/cmdlog"
	"github.com/pgsaga/pgsaga/internal/finddb"
	"github.com/pgsaga/pgsaga/internal/obs"
	"github.com/pgsaga/pgsaga/internal/pgdb"
	"github.com/pgsaga/pgsaga/internal/pgerr"
	"github.com/pgsaga/pgsaga/internal/transport"
	"github.com/pgsaga/pgsaga/orders"
	"github.com/pgsaga/pgsaga/payments"
	"github.com/pgsaga/pgsaga/payments/fakegateway"
	"github.com/pgsaga/pgsaga/saga"
	"github.com/pgsaga/pgsaga/saga/orderpayment"
	"github.com/pgsaga/pgsaga/saga/sagatest"
	"github.com/pgsaga/pgsaga/steps/broker"
)

type demo struct {
	opts   options
	out    io.Writer // the report (stdout)
	status io.Writer // progress: stdout, or stderr with -json
	errs   io.Writer // why it failed (stderr)
	log    *slog.Logger

	found    *finddb.Found
	db       *pgdb.DB
	gwDB     *pgdb.DB
	chaosDB  *pgdb.DB
	injector *sagatest.Injector
	gateway  *fakegateway.Gateway
	app      *orderpayment.App
	fleet    *workerwatch.Fleet // running: the workers, then the bridges
	metrics  *obs.MetricsServer

	// With -payments-service: the payment service, on its database,
	// reached through a broker.
	payDB        *pgdb.DB
	payDBName    string
	payChaosDB   *pgdb.DB
	payInjector  *sagatest.Injector
	pay          *orderpayment.PaymentService
	brokers      []broker.Broker
	brokerFaults []*sagatest.BrokerInjector
}

// faults are the handlers' faults the chaos flags ask for.
func (d *demo) faults() sagatest.Faults {
	return sagatest.Faults{
		Seed:                  d.opts.seed,
		DuplicateRate:         d.opts.duplicateRate,
		CrashBeforeCommitRate: 0.45 * d.opts.crashRate,
		CrashAfterCommitRate:  0.45 * d.opts.crashRate,
		KillConnectionRate:    0.1 * d.opts.crashRate,
	}
}

// split reports whether the payment service runs apart.
func (d *demo) split() bool { return d.opts.paymentsService != "" }

// payments is the payments domain: the App's, or the payment service's.
func (d *demo) payments() *payments.Service {
	if d.pay != nil {
		return d.pay.Payments
	}
	return d.app.Payments
}

func newDemo(ctx context.Context, opts options, stdout, stderr io.Writer) (*demo, error) {
	// Progress (with -json), errors and the workers' logs share stderr.
	stderr = cmdlog.Synced(stderr)
	level := slog.LevelWarn
	if opts.chaos() {
		// Injected crashes and killed connections make retries and
		// abandoned batches routine: the report and the invariants tell
		// what matters. -v or -log-level shows them.
		level = slog.LevelError + 4
	}
	d := &demo{opts: opts, out: stdout, status: stdout, errs: stderr,
		log: opts.log.New(stderr, opts.log.LevelOr(level))}
	if opts.json {
		d.status = stderr
	}
	if !opts.seedSet {
		d.opts.seed = uint64(time.Now().UnixNano())
	}
	ok := false
	defer func() {
		if !ok {
			d.close()
		}
	}()

	found, err := finddb.Find(ctx, finddb.Config{Logger: d.log, Getenv: opts.getenv})
	if err != nil {
		return nil, err
	}
	d.found = found
	fmt.Fprintln(d.status, "using", found.Describe())
	fmt.Fprintln(d.status, inspectHint(found))
	// Each worker holds a connection per busy lane (seven handlers) and a
	// charge a second one for its gateway lease.
	d.db, err = pgdb.Open(ctx, pgdb.Config{URL: found.URL, MaxConns: int32(12 + 10*opts.workers), ApplicationName: "orderdemo"})
	if err != nil {
		return nil, err
	}
	applied, err := orderpayment.Migrate(ctx, d.db.SQL)
	if err != nil {
		return nil, err
	}
	if len(applied) > 0 {
		fmt.Fprintf(d.status, "migrations: applied %v\n", applied)
	}
	gwURL := found.URL
	if d.split() {
		if gwURL, err = d.openPaymentsDB(ctx, opts); err != nil {
			return nil, err
		}
	}
	// The gateway is another service: a pool of its own, on the payment
	// service's database when it has one.
	d.gwDB, err = pgdb.Open(ctx, pgdb.Config{URL: gwURL, MaxConns: 4, ApplicationName: "orderdemo-gateway"})
	if err != nil {
		return nil, err
	}
	gwCfg := fakegateway.Config{DB: d.gwDB.SQL, Logger: d.log}
	tcfg := transport.Config{PollInterval: 50 * time.Millisecond, RetryInterval: 50 * time.Millisecond}
	if d.opts.chaos() {
		fmt.Fprintf(d.status, "chaos: duplicates %.0f%%, crashes %.0f%%, gateway faults %.0f%%, seed %d (repeat with -seed %d)\n",
			100*d.opts.duplicateRate, 100*d.opts.crashRate, 100*d.opts.gatewayFaultRate, d.opts.seed, d.opts.seed)
		gwCfg.Faults = orderpayment.GatewayFaults(d.opts.seed, d.opts.gatewayFaultRate)
		gwCfg.SlowDelay, gwCfg.LostHang = 200*time.Millisecond, 3*time.Second
		d.chaosDB, err = pgdb.Open(ctx, pgdb.Config{URL: found.URL, MaxConns: 4, ApplicationName: "orderdemo-chaos"})
		if err != nil {
			return nil, err
		}
		d.injector, err = sagatest.NewInjector(d.chaosDB.SQL, d.faults(), d.log)
		if err != nil {
			return nil, err
		}
		tcfg.Intercept = d.injector.Intercept
		// A killed connection costs its whole batch: smaller batches keep
		// each kill's cost small.
		tcfg.BatchSize = 10
	}
	payTcfg := tcfg
	var ordersFaults, payFaults broker.Faults
	if d.split() && d.opts.chaos() {
		// The payment service's database gets an injector of its own (a
		// copy goes to its message's database); the bridges get broker
		// faults: redeliveries at the duplicate rate, and each relay
		// killed twice at most between a publish and its commit (at a
		// tenth of the crash rate: a crash abandons the relay's whole
		// batch, so a relay crashing often would never commit one).
		d.payChaosDB, err = pgdb.Open(ctx, pgdb.Config{URL: gwURL, MaxConns: 4, ApplicationName: "orderdemo-chaos"})
		if err != nil {
			return nil, err
		}
		if d.payInjector, err = sagatest.NewInjector(d.payChaosDB.SQL, d.faults(), d.log); err != nil {
			return nil, err
		}
		payTcfg.Intercept = d.payInjector.Intercept
		for i := range 2 {
			bf, err := sagatest.NewBrokerInjector(sagatest.BrokerFaults{Seed: d.opts.seed + uint64(i),
				RedeliverRate: d.opts.duplicateRate, RelayCrashRate: d.opts.crashRate / 10, MaxRelayCrashes: 2})
			if err != nil {
				return nil, err
			}
			d.brokerFaults = append(d.brokerFaults, bf)
		}
		ordersFaults, payFaults = d.brokerFaults[0], d.brokerFaults[1]
	}
	if d.opts.declineRefunds {
		fmt.Fprintln(d.status, "refunds: the gateway declines every refund (-decline-refunds); a saga that needs one parks for an operator")
		gwCfg.Faults = declineRefunds(gwCfg.Faults)
	}
	d.gateway, err = fakegateway.Start(ctx, gwCfg)
	if err != nil {
		return nil, err
	}
	var reg *prometheus.Registry
	if d.opts.metricsAddr != "" {
		reg = obs.NewRegistry()
		tcfg.Metrics = reg
	}
	cfg := orderpayment.Config{
		DB:            d.db.SQL,
		GatewayURL:    d.gateway.URL(),
		Transport:     tcfg,
		SweepInterval: 500 * time.Millisecond,
		Logger:        d.log,
	}
	if d.split() {
		payTcfg.Metrics = tcfg.Metrics
		if err := d.startPaymentService(ctx, payTcfg, payFaults); err != nil {
			return nil, err
		}
		if cfg.PaymentsBroker, err = d.openBroker(); err != nil {
			return nil, err
		}
		cfg.BrokerFaults = ordersFaults
	}
	d.app, err = orderpayment.New(cfg)
	if err != nil {
		return nil, err
	}
	// Before this mode's groups are recorded: a refused switch records
	// nothing, and the run it advises (in the other mode) can start.
	if err := d.forgetOtherMode(ctx); err != nil {
		return nil, err
	}
	if err := d.app.Setup(ctx); err != nil {
		return nil, err
	}
	if reg != nil {
		if d.split() {
			// Both services' collectors read the same metrics from their
			// own database: a service label tells them apart.
			prometheus.WrapRegistererWith(prometheus.Labels{"service": "orders"}, reg).MustRegister(d.app.Client.Collector())
			prometheus.WrapRegistererWith(prometheus.Labels{"service": "payments"}, reg).MustRegister(d.pay.Client.Collector())
		} else {
			reg.MustRegister(d.app.Client.Collector())
		}
		if d.metrics, err = obs.ServeMetrics(d.opts.metricsAddr, reg, d.log); err != nil {
			return nil, err
		}
		fmt.Fprintf(d.status, "metrics: serving http://%s/metrics\n", d.metrics.Addr())
	}
	ok = true
	return d, nil
}

// forgetOtherMode drops, in the orders database, the consumer groups of
// the payment step that the other mode recorded there: with
// -payments-service, the local steps' groups (a worker of a one-database
// run would otherwise charge from this database too, and their queues
// grow); without it, the relay's (its queue would grow, and a later
// -payments-service run would relay old commands). It refuses while a
// saga of the database is unfinished: its payment commands wait in the
// other mode's queues (here, or in the payment service's database), and
// sent again in this mode they would charge where the accounts are not
// (and compensate) while the other side went on charging.
func (d *demo) forgetOtherMode(ctx context.Context) error {
	topics := []string{payments.ChargeTopic, payments.RefundTopic}
	groups := []string{payments.ChargeStepName, payments.RefundStepName}
	why, other := "the payment step runs in the payment service (-payments-service)", "without -payments-service"
	if !d.split() {
		groups = []string{transport.RelayGroup, transport.RelayGroup}
		why, other = "the payment step runs here (no -payments-service)", "with -payments-service"
	}
	tr, err := transport.New(transport.Config{DB: d.db.SQL, Logger: d.log})
	if err != nil {
		return err
	}
	var drop []int
	for i, topic := range topics {
		recorded, err := tr.SubscribedGroups(ctx, topic)
		if err != nil {
			return err
		}
		if slices.Contains(recorded, groups[i]) {
			drop = append(drop, i)
		}
	}
	if len(drop) == 0 {
		return nil
	}
	unfinished, err := d.unfinished(ctx)
	if err != nil {
		return err
	}
	if n := len(unfinished); n > 0 {
		is, them, resume := "are", "them", "orderdemo -resume -payments-service URL"
		if n == 1 {
			is, them = "is", "it"
		}
		if d.split() {
			resume = "orderdemo -resume"
		}
		return fmt.Errorf("%s of this database %s unfinished and ran %s: finish %s in that mode first (%s), or use another database (DATABASE_URL); switching now would strand their payment commands in the other mode's queues",
			plural(n, "saga", "sagas"), is, other, them, resume)
	}
	for _, i := range drop {
		n, err := tr.DropConsumerGroup(ctx, topics[i], groups[i])
		if err != nil {
			return err
		}
		fmt.Fprintf(d.status, "dropped consumer group %s of %s in this database, with the %d messages it held: %s\n", groups[i], topics[i], n, why)
	}
	return nil
}

// openPaymentsDB finds, migrates and opens the payment service's database:
// PAYMENTS_DATABASE_URL, else one next to the orders database. It returns
// its URL.
func (d *demo) openPaymentsDB(ctx context.Context, opts options) (string, error) {
	url := opts.getenv(paymentsDatabaseEnv)
	where := pgdb.Describe(url) + " from " + paymentsDatabaseEnv
	if url == "" {
		var err error
		if url, err = d.found.Sibling(ctx, "payments"); err != nil {
			return "", fmt.Errorf("the payment service's database: %w (or set %s)", err, paymentsDatabaseEnv)
		}
		where = "database " + databaseName(url) + " next to it"
	}
	var err error
	d.payDBName = databaseName(url)
	d.payDB, err = pgdb.Open(ctx, pgdb.Config{URL: url, MaxConns: int32(12 + 10*opts.workers), ApplicationName: "orderdemo-payments"})
	if err != nil {
		return "", err
	}
	applied, err := orderpayment.Migrate(ctx, d.payDB.SQL)
	if err != nil {
		return "", fmt.Errorf("the payment service's database: %w", err)
	}
	fmt.Fprintf(d.status, "payment service: %s, reached through %s\n", where, brokerurl.Describe(opts.paymentsService))
	if len(applied) > 0 {
		fmt.Fprintf(d.status, "payment service: migrations applied %v\n", applied)
	}
	return url, nil
}

// paymentsDatabaseEnv names the payment service's database.
const paymentsDatabaseEnv = "PAYMENTS_DATABASE_URL"

// databaseName is the database a URL names.
func databaseName(url string) string {
	cfg, err := pgdb.ParseConfig(url)
	if err != nil {
		return "?"
	}
	return cfg.ConnConfig.Database
}

// openBroker connects to the -payments-service broker (each service has
// its own connections, as separate processes would).
func (d *demo) openBroker() (broker.Broker, error) {
	b, err := brokers.Open(d.opts.paymentsService, d.log)
	if err != nil {
		return nil, fmt.Errorf("-payments-service: %w", err)
	}
	d.brokers = append(d.brokers, b)
	return b, nil
}

// startPaymentService builds the payment service and records its
// subscriptions and topics; its workers and bridge start with the others'.
func (d *demo) startPaymentService(ctx context.Context, tcfg transport.Config, faults broker.Faults) error {
	b, err := d.openBroker()
	if err != nil {
		return err
	}
	d.pay, err = orderpayment.NewPaymentService(orderpayment.PaymentServiceConfig{
		DB: d.payDB.SQL, GatewayURL: d.gateway.URL(), Broker: b, BrokerFaults: faults, Transport: tcfg, Logger: d.log,
	})
	if err != nil {
		return err
	}
	return d.pay.Setup(ctx)
}

// declineRefunds makes every refund call a decline, and leaves the other
// calls to faults (nil: none).
func declineRefunds(faults func(fakegateway.Call) fakegateway.Fault) func(fakegateway.Call) fakegateway.Fault {
	return func(c fakegateway.Call) fakegateway.Fault {
		switch {
		case c.Op == "refund":
			return fakegateway.Decline
		case faults != nil:
			return faults(c)
		}
		return fakegateway.None
	}
}

// startWorkers starts the workers and returns once all run, or with the
// reason one cannot (close stops those already started). The context it
// returns ends when ctx does or when a worker stops (see workerwatch.Watch);
// call stopWatching before stopping the workers.
func (d *demo) startWorkers(ctx context.Context) (_ context.Context, stopWatching func(), _ error) {
	fleet, err := workerwatch.StartFleet(ctx, d.opts.workers, workerwatch.Sample(d.app, d.pay)...)
	d.fleet = fleet
	if err != nil {
		return nil, nil, err
	}
	ctx, stopWatching = workerwatch.Watch(ctx, d.fleet.Workers)
	return ctx, stopWatching, nil
}

// stopWorkers drains and stops the workers, then the bridges (what the
// workers published last is relayed).
func (d *demo) stopWorkers() {
	d.fleet.Stop(d.log)
	d.fleet = nil
}

func (d *demo) close() {
	d.stopWorkers()
	if d.metrics != nil {
		if err := d.metrics.Close(); err != nil {
			d.log.Error("stopping the metrics server", "err", err)
		}
	}
	for _, inj := range []*sagatest.Injector{d.injector, d.payInjector} {
		if inj != nil {
			_ = inj.Close()
		}
	}
	for _, b := range d.brokers {
		_ = b.Close()
	}
	for _, db := range []*pgdb.DB{d.chaosDB, d.payChaosDB, d.payDB} {
		if db != nil {
			db.Close()
		}
	}
	d.chaosDB, d.payChaosDB, d.payDB = nil, nil, nil
	if d.gateway != nil {
		_ = d.gateway.Close()
	}
	if d.gwDB != nil {
		d.gwDB.Close()
	}
	if d.db != nil {
		d.db.Close()
	}
	if d.found != nil {
		if err := d.found.Close(); err != nil {
			d.log.Error("stopping the embedded PostgreSQL", "err", err)
		}
	}
}

// run runs the orders (or the resume) and reports; with -serve it then
// serves operators' requests until ctx ends (SIGINT, SIGTERM), and with
// -orders 0 -serve it serves only. Whatever stopped a run that failed, it
// then says how to finish the sagas it left (sayHowToFinish).
func (d *demo) run(ctx context.Context) int {
	code := d.runAndServe(ctx)
	if code != exitOK {
		d.stopWorkers() // so that the count holds
		d.sayHowToFinish(ctx)
	}
	return code
}

func (d *demo) runAndServe(ctx context.Context) int {
	if d.opts.serve && d.opts.orders == 0 && !d.opts.resume {
		return d.serve(ctx, exitOK)
	}
	code, reported := d.runOrders(ctx)
	if !d.opts.serve || !reported || ctx.Err() != nil {
		return code
	}
	return d.serve(ctx, code)
}

// sayHowToFinish says how many sagas of the database are unfinished (what
// -resume would drive on, this run's and any other's) and the command
// that finishes them, or that none is; when they cannot be counted (the
// database is gone), it says why and gives the command. Its lines follow
// the cause of the failure, which stays the last that names the program.
// It asks for five seconds at most (a connection lost meanwhile is
// retried), even after SIGINT or SIGTERM.
func (d *demo) sayHowToFinish(ctx context.Context) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer cancel()
	ids, err := pgerr.RetryLostValue(ctx, d.unfinished)
	switch {
	case err != nil:
		fmt.Fprintf(d.errs, "could not count the unfinished sagas (%v); once the database takes connections again, finish them with: %s\n",
			err, d.resumeCommand())
	case len(ids) > 0:
		fmt.Fprintf(d.errs, "%s unfinished in this database; to finish, run: %s\n",
			plural(len(ids), "saga is", "sagas are"), d.resumeCommand())
	default:
		fmt.Fprintln(d.errs, "no saga of this database is unfinished (-resume has nothing to do)")
	}
}

// resumeCommand is the command that finishes this run's sagas: -resume in
// this run's mode, with the environment that names its databases.
func (d *demo) resumeCommand() string {
	cmd := "go run ./cmd/orderdemo -resume"
	if d.split() {
		// The broker as this run named it, unless that would print a
		// secret: then it is to be given as for this run.
		broker := d.opts.paymentsService
		if brokerurl.Describe(broker) != broker {
			broker = "<the broker URL of this run>"
		}
		cmd += " -payments-service " + broker
	}
	var env []string
	if d.opts.getenv(pgdb.EnvURL) != "" {
		env = append(env, pgdb.EnvURL)
	}
	if d.split() && d.opts.getenv(paymentsDatabaseEnv) != "" {
		env = append(env, paymentsDatabaseEnv)
	}
	if len(env) > 0 {
		cmd += " (with " + strings.Join(env, " and ") + " as for this run)"
	}
	return cmd
}

// serve runs the workers until ctx ends, so that operators' requests
// (pgsaga retry, pgsaga cancel) are carried out, and returns code (the
// run's exit status): the end of ctx is the normal end of serving. A
// worker that cannot start or stops meanwhile is a failure.
func (d *demo) serve(ctx context.Context, code int) int {
	wctx, stopWatching, err := d.startWorkers(ctx)
	if err != nil {
		fmt.Fprintln(d.errs, "orderdemo:", err)
		return exitNoService
	}
	defer stopWatching()
	fmt.Fprintf(d.status, "serving operator requests (pgsaga retry <id>, pgsaga cancel <id>) with %s; stop with Ctrl-C (SIGINT) or SIGTERM\n",
		plural(d.opts.workers, "worker", "workers"))
	<-wctx.Done()
	stopped := workerwatch.Stopped(wctx)
	stopWatching() // the workers' own stop below is no failure
	if stopped != nil {
		fmt.Fprintf(d.errs, "orderdemo: %v while serving\n", stopped)
		return exitFailed
	}
	fmt.Fprintln(d.status, "stopping the workers; requests asked from now on wait for the next worker")
	d.stopWorkers()
	return code
}

// runOrders places the orders (or finds the sagas to resume), waits for
// them and reports; reported is false when it stopped before the report.
func (d *demo) runOrders(ctx context.Context) (code int, reported bool) {
	start := time.Now()
	var (
		ids []uuid.UUID
		err error
	)
	if d.opts.resume {
		// Count before any worker runs: workers finish sagas while the
		// others start, and those would be missing from the count and the
		// report.
		ids, err = d.unfinished(ctx)
		if err != nil {
			fmt.Fprintln(d.errs, "orderdemo:", err)
			return exitNoService, false
		}
		fmt.Fprintf(d.status, "resuming %s\n", plural(len(ids), "unfinished saga", "unfinished sagas"))
	}
	ctx, stopWatching, err := d.startWorkers(ctx)
	if err != nil {
		fmt.Fprintln(d.errs, "orderdemo:", err)
		return exitNoService, false
	}
	defer stopWatching()
	if !d.opts.resume {
		ids, err = d.placeOrders(ctx)
		if err == nil && ctx.Err() != nil && len(ids) < d.opts.orders {
			err = context.Cause(ctx) // interrupted between two orders
		}
		if err != nil {
			d.placingFailed(ctx, err)
			return exitFailed, false
		}
	}
	finished := d.wait(ctx, ids, start)
	stopWatching() // the workers' own stop below is no failure
	if err := workerwatch.Stopped(ctx); err != nil {
		fmt.Fprintln(d.errs, "orderdemo:", err)
		return exitFailed, false
	}
	// Stop the workers before checking, so nothing moves under the check.
	d.stopWorkers()
	var report orderpayment.Report
	if d.split() {
		report, err = orderpayment.CheckSplit(context.Background(), d.db.SQL, d.payDB.SQL, ids)
	} else {
		report, err = orderpayment.Check(context.Background(), d.db.SQL, ids)
	}
	if err != nil {
		fmt.Fprintln(d.errs, "orderdemo: checking invariants:", err)
		return exitFailed, false
	}
	return d.report(ids, report, time.Since(start), finished), true
}

// placingFailed says why placing the orders stopped: a worker that
// stopped, an interruption (whose cancelled calls are no failure of their
// own), or err.
func (d *demo) placingFailed(ctx context.Context, err error) {
	switch {
	case workerwatch.Stopped(ctx) != nil:
		fmt.Fprintln(d.errs, "orderdemo:", workerwatch.Stopped(ctx))
	case ctx.Err() != nil:
		fmt.Fprintln(d.errs, "orderdemo: interrupted while placing the orders")
	default:
		fmt.Fprintln(d.errs, "orderdemo:", err)
	}
}

// placeOrders seeds customers and places the orders: some beyond their
// customer's balance, some cancelled by the customer a moment later.
func (d *demo) placeOrders(ctx context.Context) ([]uuid.UUID, error) {
	if d.opts.orders == 0 {
		return []uuid.UUID{}, nil
	}
	run := uuid.NewString()[:6]
	rng := rand.New(rand.NewPCG(d.opts.seed, 2))
	customers := max(4, d.opts.orders/6)
	ids := make([]string, customers)
	for i := range ids {
		ids[i] = fmt.Sprintf("demo-%s-%02d", run, i)
		if err := d.app.Orders.AddCustomer(ctx, ids[i], fmt.Sprintf("Customer %d", i)); err != nil {
			return nil, err
		}
		if err := d.payments().OpenAccount(ctx, ids[i]); err != nil {
			return nil, err
		}
		if err := d.payments().Deposit(ctx, ids[i], 25_000, "demo-seed"); err != nil {
			return nil, err
		}
	}
	fmt.Fprintf(d.status, "seeded %s with $250.00 each; placing %s of $10 to $90 (run %s)\n",
		plural(customers, "customer", "customers"), plural(d.opts.orders, "order", "orders"), run)

	type plan struct {
		customer string
		cents    int64
		cancel   time.Duration // < 0: never
	}
	plans := make([]plan, d.opts.orders)
	for i := range plans {
		plans[i] = plan{customer: ids[rng.IntN(customers)], cents: int64(1_000 + 100*rng.IntN(81)), cancel: -1}
		if rng.IntN(8) == 0 {
			plans[i].cancel = time.Duration(rng.IntN(400)) * time.Millisecond
		}
	}
	var (
		mu      sync.Mutex
		sagas   = make([]uuid.UUID, len(plans))
		errs    []error
		wg      sync.WaitGroup
		cancels sync.WaitGroup
		next    = make(chan int)
	)
	for range 4 {
		wg.Go(func() {
			for i := range next {
				p := plans[i]
				res, err := d.app.Orders.Place(ctx, orders.PlaceRequest{Key: fmt.Sprintf("%s-order-%d", run, i), CustomerID: p.customer, AmountCents: p.cents})
				if err != nil {
					mu.Lock()
					errs = append(errs, err)
					mu.Unlock()
					continue
				}
				sagas[i] = saga.ID(orderpayment.Name, res.OrderID.String())
				if p.cancel >= 0 {
					cancels.Go(func() {
						time.Sleep(p.cancel)
						err := d.app.Orders.CancelByCustomer(ctx, res.OrderID, "the customer changed their mind")
						if err != nil && ctx.Err() == nil {
							d.log.Info("customer cancellation lost the race", "order", res.OrderID, "err", err)
						}
					})
				}
			}
		})
	}
dispatch:
	for i := range plans {
		if ctx.Err() != nil { // select would pick at random between the two
			break
		}
		select {
		case next <- i:
		case <-ctx.Done():
			break dispatch
		}
	}
	close(next)
	wg.Wait()
	cancels.Wait()
	if len(errs) > 0 {
		return nil, fmt.Errorf("placing orders: %d failed, first: %w", len(errs), errs[0])
	}
	// Only the orders placed: an interruption leaves the rest unplaced,
	// and the caller tells it by the count.
	placed := make([]uuid.UUID, 0, len(sagas))
	for _, id := range sagas {
		if id != uuid.Nil {
			placed = append(placed, id)
		}
	}
	return placed, nil
}

// unfinished lists the sagas -resume waits for: every running or
// compensating one, and one for every order whose saga has not started yet.
func (d *demo) unfinished(ctx context.Context) ([]uuid.UUID, error) {
	rows, err := d.db.SQL.QueryContext(ctx, unfinishedSQL, orderpayment.Name)
	if err != nil {
		return nil, fmt.Errorf("listing unfinished sagas: %w", err)
	}
	defer rows.Close()
	ids := []uuid.UUID{} // not nil: nil means "every saga" to the checker
	for rows.Next() {
		var sagaID, orderID *string
		if err := rows.Scan(&sagaID, &orderID); err != nil {
			return nil, err
		}
		switch {
		case sagaID != nil:
			ids = append(ids, uuid.MustParse(*sagaID))
		case orderID != nil:
			ids = append(ids, saga.ID(orderpayment.Name, *orderID))
		}
	}
	return ids, rows.Err()
}

const unfinishedSQL = `SELECT id::text, NULL FROM saga_instances
WHERE saga_type = $1 AND status IN ('running', 'compensating')
UNION ALL
SELECT NULL, e.payload->>'order_id' FROM domain_events e
WHERE e.event_type = 'orders.placed'
  AND NOT EXISTS (SELECT FROM saga_instances s WHERE s.saga_type = $1 AND s.data->>'order_id' = e.payload->>'order_id')`

// wait shows progress until every saga in ids is terminal, the timeout
// passes or ctx is cancelled; it reports whether all finished.
func (d *demo) wait(ctx context.Context, ids []uuid.UUID, start time.Time) bool {
	deadline := time.NewTimer(d.opts.timeout)
	defer deadline.Stop()
	tick := time.NewTicker(250 * time.Millisecond)
	defer tick.Stop()
	lastPrint := time.Time{}
	for {
		counts, err := d.counts(ctx, ids)
		if err != nil && ctx.Err() == nil { // an interruption is said below
			d.log.Warn("counting sagas", "err", err)
		}
		unfinished := counts.notStarted + counts.byStatus[saga.StatusRunning] + counts.byStatus[saga.StatusCompensating]
		if err == nil && (unfinished == 0 || time.Since(lastPrint) >= time.Second) {
			fmt.Fprintf(d.status, "%6.1fs  sagas %d: starting %d · running %d · compensating %d · completed %d · compensated %d · failed %d\n",
				time.Since(start).Seconds(), len(ids), counts.notStarted, counts.byStatus[saga.StatusRunning], counts.byStatus[saga.StatusCompensating],
				counts.byStatus[saga.StatusCompleted], counts.byStatus[saga.StatusCompensated], counts.byStatus[saga.StatusFailed])
			lastPrint = time.Now()
		}
		if err == nil && unfinished == 0 {
			return true
		}
		select {
		case <-ctx.Done():
			if workerwatch.Stopped(ctx) == nil { // else run says why
				fmt.Fprintln(d.status, "interrupted; stopping the workers")
			}
			return false
		case <-deadline.C:
			fmt.Fprintf(d.status, "gave up waiting after %s\n", d.opts.timeout)
			return false
		case <-tick.C:
		}
	}
}

type sagaCounts struct {
	byStatus   map[saga.Status]int
	notStarted int
}

func (d *demo) counts(ctx context.Context, ids []uuid.UUID) (sagaCounts, error) {
	c := sagaCounts{byStatus: map[saga.Status]int{}}
	strs := make([]string, len(ids))
	for i, id := range ids {
		strs[i] = id.String()
	}
	rows, err := d.db.SQL.QueryContext(ctx, `SELECT status, count(*) FROM saga_instances WHERE id::text = ANY ($1::text[]) GROUP BY status`, strs)
	if err != nil {
		return c, err
	}
	defer rows.Close()
	total := 0
	for rows.Next() {
		var st string
		var n int
		if err := rows.Scan(&st, &n); err != nil {
			return c, err
		}
		c.byStatus[saga.Status(st)] = n
		total += n
	}
	c.notStarted = len(ids) - total
	return c, rows.Err()
}

// summary is the -json output; its field names are a contract.
type summary struct {
	Resumed            bool           `json:"resumed"`
	Sagas              int            `json:"sagas"`
	Completed          int            `json:"completed"`
	Compensated        int            `json:"compensated"`
	Failed             int            `json:"failed"`
	Unfinished         int            `json:"unfinished"`
	CompensatedReasons map[string]int `json:"compensated_reasons"`
	P50Millis          float64        `json:"p50_ms"`
	P99Millis          float64        `json:"p99_ms"`
	DurationMillis     float64        `json:"duration_ms"`
	GatewayCharges     int            `json:"gateway_charges"`
	GatewayRefunds     int            `json:"gateway_refunds"`
	GatewayCalls       int            `json:"gateway_calls"`
	Seed               uint64         `json:"seed"`
	Chaos              *chaosSummary  `json:"chaos,omitempty"`
	// PaymentsService is set with -payments-service.
	PaymentsService *paymentsService `json:"payments_service,omitempty"`
	InvariantsOK    bool             `json:"invariants_ok"`
	Violations      []string         `json:"violations"`
	// FailedReasons counts the parked sagas by what parked them (the
	// compensation that failed, and why).
	FailedReasons map[string]int `json:"failed_reasons"`
	// Parked lists the parked sagas, oldest first, with their reasons.
	Parked []parkedSaga `json:"parked"`
}

// parkedSaga is a saga parked as failed, waiting for an operator.
type parkedSaga struct {
	SagaID string `json:"saga_id"`
	Reason string `json:"reason"`
}

// chaosSummary says what was injected and how it was absorbed.
type chaosSummary struct {
	Duplicated        int            `json:"duplicated"`
	Copies            int            `json:"copies"`
	CrashesBefore     int            `json:"crashes_before_commit"`
	CrashesAfter      int            `json:"crashes_after_commit"`
	ConnectionsKilled int            `json:"connections_killed"`
	GatewayFaults     map[string]int `json:"gateway_faults"`
	Attempts          int            `json:"handler_attempts"`
	Retries           int            `json:"handler_retries"`
	Replayed          int            `json:"replies_replayed"`
	// Broker: the faults at the broker boundary (-payments-service).
	Broker *brokerChaos `json:"broker,omitempty"`
}

// brokerChaos says what was injected at the broker boundary.
type brokerChaos struct {
	Received     int `json:"received"`
	Redelivered  int `json:"redelivered"`
	RelayCrashes int `json:"relay_crashes"`
}

// paymentsService says where the payment service ran (-payments-service)
// and what crossed the broker.
type paymentsService struct {
	Broker       string `json:"broker"`
	Database     string `json:"database"`
	Relayed      int64  `json:"relayed"`
	Received     int64  `json:"received"`
	DeadLettered int64  `json:"dead_lettered"`
}

func (d *demo) report(ids []uuid.UUID, r orderpayment.Report, took time.Duration, finished bool) int {
	s := summary{
		Resumed: d.opts.resume, Sagas: len(ids),
		Completed: r.Sagas[saga.StatusCompleted], Compensated: r.Sagas[saga.StatusCompensated], Failed: r.Sagas[saga.StatusFailed],
		CompensatedReasons: map[string]int{}, FailedReasons: map[string]int{}, Parked: []parkedSaga{},
		P50Millis: ms(r.P50), P99Millis: ms(r.P99), DurationMillis: ms(took),
		InvariantsOK: r.OK(), Violations: []string{},
	}
	s.Unfinished = len(ids) - s.Completed - s.Compensated - s.Failed
	for _, v := range r.Violations {
		s.Violations = append(s.Violations, v.String())
	}
	reasons, err := d.reasons(ids)
	if err == nil {
		s.CompensatedReasons = reasons
	}
	parked, err := d.parked(ids)
	if err == nil {
		s.Parked = parked
		for _, p := range parked {
			s.FailedReasons[parkCause(p.Reason)]++
		}
	}
	s.Seed = d.opts.seed
	gw, gwErr := fakegateway.ReadStats(context.Background(), d.gwDB.SQL)
	if gwErr == nil {
		s.GatewayCharges, s.GatewayRefunds, s.GatewayCalls = gw.Charges, gw.Refunds, gw.Calls
	}
	if d.injector != nil {
		st := d.injector.Stats()
		if d.payInjector != nil {
			st = st.Add(d.payInjector.Stats())
		}
		c := &chaosSummary{Duplicated: st.Duplicated, Copies: st.Copies, CrashesBefore: st.CrashesBefore, CrashesAfter: st.CrashesAfter,
			ConnectionsKilled: st.ConnectionsKilled, Attempts: st.Attempts, Retries: st.Retries, Replayed: st.Replayed, GatewayFaults: map[string]int{}}
		for f, n := range gw.Faults {
			c.GatewayFaults[string(f)] = n
		}
		if len(d.brokerFaults) > 0 {
			c.Broker = &brokerChaos{}
			for _, bf := range d.brokerFaults {
				st := bf.Stats()
				c.Broker.Received += st.Received
				c.Broker.Redelivered += st.Redelivered
				c.Broker.RelayCrashes += st.RelayCrashes
			}
		}
		s.Chaos = c
	}
	if d.split() {
		s.PaymentsService = &paymentsService{Broker: brokerurl.Describe(d.opts.paymentsService), Database: d.payDBName}
		for _, b := range []broker.Bridge{d.app.Client.Bridge(), d.pay.Client.Bridge()} {
			st := b.Stats()
			s.PaymentsService.Relayed += st.Relayed
			s.PaymentsService.Received += st.Received
			s.PaymentsService.DeadLettered += st.DeadLettered
		}
	}

	if d.opts.json {
		b, _ := json.Marshal(s)
		fmt.Fprintln(d.out, string(b))
	} else {
		d.printTable(s)
	}
	if !finished || s.Unfinished > 0 || !r.OK() {
		return exitFailed
	}
	return exitOK
}

func (d *demo) reasons(ids []uuid.UUID) (map[string]int, error) {
	strs := make([]string, len(ids))
	for i, id := range ids {
		strs[i] = id.String()
	}
	rows, err := d.db.SQL.Query(`SELECT coalesce(failure_reason, ''), count(*) FROM saga_instances
		WHERE id::text = ANY ($1::text[]) AND status = 'compensated' GROUP BY 1`, strs)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	out := map[string]int{}
	for rows.Next() {
		var reason string
		var n int
		if err := rows.Scan(&reason, &n); err != nil {
			return nil, err
		}
		out[reason] = n
	}
	return out, rows.Err()
}

// parked lists the failed sagas among ids with their reasons, oldest
// first.
func (d *demo) parked(ids []uuid.UUID) ([]parkedSaga, error) {
	strs := make([]string, len(ids))
	for i, id := range ids {
		strs[i] = id.String()
	}
	rows, err := d.db.SQL.Query(`SELECT id::text, coalesce(failure_reason, '') FROM saga_instances
		WHERE id::text = ANY ($1::text[]) AND status = 'failed' ORDER BY finished_at, id`, strs)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	out := []parkedSaga{}
	for rows.Next() {
		var p parkedSaga
		if err := rows.Scan(&p.SagaID, &p.Reason); err != nil {
			return nil, err
		}
		out = append(out, p)
	}
	return out, rows.Err()
}

// parkCause is what parked a saga: its failure reason after the original
// failure ("confirm: order cancelled by customer; then compensation of
// charge failed: refund declined by the gateway" parks for the part after
// "; then ").
func parkCause(reason string) string {
	if i := strings.LastIndex(reason, "; then "); i >= 0 {
		return reason[i+len("; then "):]
	}
	return reason
}

// maxParkedListed bounds the parked sagas the table lists one by one.
const maxParkedListed = 10

func (d *demo) printTable(s summary) {
	w := d.out
	fmt.Fprintln(w)
	what := "orders placed this run"
	if s.Resumed {
		what = "unfinished sagas resumed"
	}
	fmt.Fprintf(w, "  %-12s %d (%s)\n", "sagas", s.Sagas, what)
	fmt.Fprintf(w, "  %-12s %d (charged and confirmed)\n", "completed", s.Completed)
	fmt.Fprintf(w, "  %-12s %d%s\n", "compensated", s.Compensated, reasonList(s.CompensatedReasons))
	if len(s.FailedReasons) == 0 {
		fmt.Fprintf(w, "  %-12s %d (parked for an operator)\n", "failed", s.Failed)
	} else {
		fmt.Fprintf(w, "  %-12s %d (parked for an operator: %s)\n", "failed", s.Failed, reasonCounts(s.FailedReasons))
		for i, p := range s.Parked {
			if i == maxParkedListed {
				fmt.Fprintf(w, "  %-12s … and %d more (pgsaga sagas --status failed)\n", "", len(s.Parked)-i)
				break
			}
			fmt.Fprintf(w, "  %-12s %s  %s\n", "", p.SagaID, p.Reason)
		}
		fmt.Fprintf(w, "  %-12s pgsaga show <id> tells its story; once the cause is fixed, pgsaga retry <id> with a worker running (-serve)\n", "")
	}
	if s.Unfinished > 0 {
		fmt.Fprintf(w, "  %-12s %d\n", "unfinished", s.Unfinished)
	}
	fmt.Fprintf(w, "  %-12s %s\n", "latency", latencyText(s))
	fmt.Fprintf(w, "  %-12s %s\n", "time taken", fmtMillis(s.DurationMillis))
	fmt.Fprintf(w, "  %-12s %s, %s, %s (all runs)\n", "gateway", plural(s.GatewayCharges, "charge", "charges"),
		plural(s.GatewayRefunds, "refund", "refunds"), plural(s.GatewayCalls, "call", "calls"))
	if p := s.PaymentsService; p != nil {
		fmt.Fprintf(w, "  %-12s database %s through %s: %s relayed, %s received, %d dead-lettered\n", "payments", p.Database, p.Broker,
			plural(int(p.Relayed), "message", "messages"), plural(int(p.Received), "message", "messages"), p.DeadLettered)
	}
	if c := s.Chaos; c != nil {
		fmt.Fprintf(w, "  %-12s %s duplicated (%s), %s before commit, %d after commit, %s killed\n", "chaos",
			plural(c.Duplicated, "message", "messages"), plural(c.Copies, "copy", "copies"),
			plural(c.CrashesBefore, "crash", "crashes"), c.CrashesAfter, plural(c.ConnectionsKilled, "connection", "connections"))
		fmt.Fprintf(w, "  %-12s gateway faults %s (all runs); %s, of which %s; %s answered from the store\n", "",
			countList(c.GatewayFaults, "none"), plural(c.Attempts, "handler attempt", "handler attempts"),
			plural(c.Retries, "retry", "retries"), plural(c.Replayed, "duplicate command", "duplicate commands"))
		if b := c.Broker; b != nil {
			fmt.Fprintf(w, "  %-12s broker: %s of %s redelivered, %s\n", "", plural(b.Redelivered, "message", "messages"),
				plural(b.Received, "received", "received"), plural(b.RelayCrashes, "relay crash", "relay crashes"))
		}
		fmt.Fprintf(w, "  %-12s seed %d\n", "", s.Seed)
	}
	switch {
	case s.InvariantsOK && s.Failed == 0:
		fmt.Fprintf(w, "  %-12s all hold: every saga finished and none parked, no pending keys, no account below zero,\n", "invariants")
		fmt.Fprintf(w, "  %-12s one charge per order at most, completed = charged once, compensated = nothing held,\n", "")
		fmt.Fprintf(w, "  %-12s orders match their sagas and their views, the gateway matches the ledger\n", "")
	case s.InvariantsOK:
		explained := "the parked saga is explained by a declined refund, its charge held"
		if s.Failed > 1 {
			explained = fmt.Sprintf("the %d parked sagas are each explained by a declined refund, the charge held", s.Failed)
		}
		fmt.Fprintf(w, "  %-12s all hold: every saga finished, and %s;\n", "invariants", explained)
		fmt.Fprintf(w, "  %-12s no pending keys, no account below zero, one charge per order at most, completed = charged once,\n", "")
		fmt.Fprintf(w, "  %-12s compensated = nothing held, orders match their sagas and their views, the gateway matches the ledger\n", "")
	default:
		fmt.Fprintf(w, "  %-12s BROKEN\n", "invariants")
		for _, v := range s.Violations {
			fmt.Fprintf(w, "    - %s\n", v)
		}
	}
}

func reasonList(reasons map[string]int) string {
	if len(reasons) == 0 {
		return ""
	}
	return " (" + reasonCounts(reasons) + ")"
}

// reasonCounts reads "charge: insufficient funds: 11, confirm: order
// cancelled by customer: 3", most frequent first.
func reasonCounts(reasons map[string]int) string {
	parts := make([]string, 0, len(reasons))
	for _, k := range byCount(reasons) {
		parts = append(parts, fmt.Sprintf("%s: %d", k, reasons[k]))
	}
	return strings.Join(parts, ", ")
}

// countList reads "lost 4, slow 4, decline 1", most frequent first, or
// none when counts is empty.
func countList(counts map[string]int, none string) string {
	if len(counts) == 0 {
		return none
	}
	parts := make([]string, 0, len(counts))
	for _, k := range byCount(counts) {
		parts = append(parts, fmt.Sprintf("%s %d", k, counts[k]))
	}
	return strings.Join(parts, ", ")
}

// byCount returns the keys of counts, most frequent first, then by name.
func byCount(counts map[string]int) []string {
	keys := slices.Collect(maps.Keys(counts))
	sort.Slice(keys, func(i, j int) bool {
		return counts[keys[i]] > counts[keys[j]] || counts[keys[i]] == counts[keys[j]] && keys[i] < keys[j]
	})
	return keys
}

// latencyText is the latency line of the table: there is none to show
// when no saga finished (and "p50 0ms" would claim one).
func latencyText(s summary) string {
	switch {
	case s.Sagas == 0:
		return "none (no sagas)"
	case s.Completed+s.Compensated+s.Failed == 0:
		return "none (no saga finished)"
	}
	return fmt.Sprintf("p50 %s, p99 %s (order placed to saga finished)", fmtMillis(s.P50Millis), fmtMillis(s.P99Millis))
}

// plural is n followed by the noun's singular or plural form.
func plural(n int, one, many string) string {
	if n == 1 {
		return "1 " + one
	}
	return fmt.Sprintf("%d %s", n, many)
}

func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }

func fmtMillis(v float64) string {
	if v >= 1000 {
		return fmt.Sprintf("%.2fs", v/1000)
	}
	return fmt.Sprintf("%.0fms", v)
}

// inspectHint says how the operator's tool reads the database the sample
// uses: pgsaga finds only what it is told, or a sample's embedded server
// while it runs.
func inspectHint(found *finddb.Found) string {
	switch found.Source {
	case finddb.FromLocalhost: // the probe's URL: no password
		return "inspect it with: go run ./cmd/pgsaga --database-url '" + found.URL + "' sagas"
	case finddb.FromEnv:
		return "inspect it with (DATABASE_URL names it): go run ./cmd/pgsaga sagas"
	default:
		return "inspect it with (while this server runs: -orders 0 -serve keeps it): go run ./cmd/pgsaga sagas"
	}
}
