package main

import (
	"context"
	"crypto/rand"
	"database/sql"
	"encoding/hex"
	"fmt"
	"io"
	"log/slog"
	mrand "math/rand/v2"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgerrcode"
	"github.com/jackc/pgx/v5"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/pgsaga/pgsaga/cmd/internal/brokers"
	"github.com/pgsaga/pgsaga/cmd/internal/workerwatch"
	"github.com/pgsaga/pgsaga/internal/brokers/brokerurl"
	"github.com/pgsaga/pgsaga/internal/cmdlog"
	"github.com/pgsaga/pgsaga/internal/finddb"
	"github.com/pgsaga/pgsaga/internal/obs"
	"github.com/pgsaga/pgsaga/internal/pgdb"
	"github.com/pgsaga/pgsaga/internal/pgerr"
	"github.com/pgsaga/pgsaga/internal/pglisten"
	"github.com/pgsaga/pgsaga/internal/transport"
	"github.com/pgsaga/pgsaga/orders"
	"github.com/pgsaga/pgsaga/payments"
	"github.com/pgsaga/pgsaga/payments/fakegateway"
	"github.com/pgsaga/pgsaga/saga"
	"github.com/pgsaga/pgsaga/saga/orderpayment"
	"github.com/pgsaga/pgsaga/steps/broker"
)

// Defaults of the tuning flags: consumers per handler and batch size (see
// BENCHMARKS.md for what other values measured on the 2-core development
// machine).
const (
	defaultConsumers = 2
	defaultBatch     = 50
)

// The workload: customers, a tenth of them with no money (their orders are
// refused and compensated), orders of $10 to $90.
const (
	customers       = 1_000
	refusedEvery    = 10
	fundedCents     = 1_000_000_000
	placers         = 32 // concurrent clients placing orders, at most (see options.placers)
	finishedChannel = "pgsaga_bench_finished"
)

// The names of a run's databases: the prefix, 8 hex digits, and the
// suffix for the payment service's (-payments-service).
const (
	benchDatabasePrefix    = "pgsaga_bench_"
	paymentsDatabaseSuffix = "_payments"
)

type bench struct {
	opts   options
	out    io.Writer
	status io.Writer
	log    *slog.Logger

	found    *finddb.Found
	admin    *pgdb.DB // the found database, to create and drop the bench's
	dbName   string
	dropOnce sync.Once
	db       *pgdb.DB // the workers'
	clients  *pgdb.DB // the clients placing orders
	gwDB     *pgdb.DB // the gateway's
	gateway  *fakegateway.Gateway
	app      *orderpayment.App
	front    *orderpayment.App  // the clients' view: places orders
	fleet    *workerwatch.Fleet // running: the workers, then the bridges
	procs    []*workerProcess   // -worker-processes
	url      string             // the run's database

	stopRetention context.CancelFunc
	retentionDone chan error

	tracker      *tracker
	stopListener context.CancelFunc
	listenerDone chan struct{}
	cpu          *cpuMeter

	statements     statementCounter // what db, clients and gwDB send
	statsDB        *sql.DB          // reads pg_stat_statements, uncounted
	statsPool      *pgdb.DB
	statementStats bool // pg_stat_statements is usable in the database

	metrics *obs.MetricsServer // -metrics-addr

	// With -payments-service: the payment service on a database of its
	// own, reached through the broker.
	payDBName  string
	payDB      *pgdb.DB // its workers'
	payClients *pgdb.DB // seeding its accounts
	pay        *orderpayment.PaymentService
	payFront   *orderpayment.PaymentService
	brokers    []broker.Broker
}

// payments is where accounts are seeded: the clients' App, or the payment
// service's.
func (b *bench) payments() *payments.Service {
	if b.payFront != nil {
		return b.payFront.Payments
	}
	return b.front.Payments
}

func newBench(ctx context.Context, opts options, stdout, stderr io.Writer) (*bench, error) {
	// Progress, logs and the worker processes' stderr share the stream.
	stderr = cmdlog.Synced(stderr)
	b := &bench{opts: opts, out: stdout, status: stderr,
		log: opts.log.New(stderr, opts.log.LevelOr(slog.LevelWarn))}
	ok := false
	defer func() {
		if !ok {
			b.close()
		}
	}()

	found, err := finddb.Find(ctx, finddb.Config{Logger: b.log})
	if err != nil {
		return nil, err
	}
	b.found = found
	b.admin, err = pgdb.Open(ctx, pgdb.Config{URL: found.URL, MaxConns: 2, ApplicationName: "sagabench-admin"})
	if err != nil {
		return nil, err
	}
	suffix := make([]byte, 4)
	_, _ = rand.Read(suffix)
	b.dbName = benchDatabasePrefix + hex.EncodeToString(suffix)
	if err := createDatabase(ctx, b.admin, b.dbName); err != nil {
		name := b.dbName
		if !pgerr.ConnectionLost(err) { // else it may exist: close drops it
			b.dbName = ""
		}
		return nil, fmt.Errorf("creating the benchmark database %s: %w", name, err)
	}
	url, err := pgdb.WithDatabase(found.URL, b.dbName)
	if err != nil {
		return nil, err
	}
	b.url = url
	fmt.Fprintf(b.status, "using a fresh database %s next to %s\n", b.dbName, found.Describe())

	maxConns, need := opts.connections()
	if err := b.checkConnections(ctx, need); err != nil {
		return nil, err
	}
	if b.db, err = pgdb.Open(ctx, pgdb.Config{URL: url, MaxConns: maxConns, ApplicationName: "sagabench", Tracer: &b.statements}); err != nil {
		return nil, err
	}
	if _, err := orderpayment.Migrate(ctx, b.db.SQL); err != nil {
		return nil, err
	}
	if b.clients, err = pgdb.Open(ctx, pgdb.Config{URL: url, MaxConns: int32(opts.placers()), ApplicationName: "sagabench-clients", Tracer: &b.statements}); err != nil {
		return nil, err
	}
	gwURL := url
	if opts.paymentsService != "" {
		if gwURL, err = b.openPaymentsDB(ctx, maxConns); err != nil {
			return nil, err
		}
	}
	if b.gwDB, err = pgdb.Open(ctx, pgdb.Config{URL: gwURL, MaxConns: 8, ApplicationName: "sagabench-gateway", Tracer: b.statements.gateway()}); err != nil {
		return nil, err
	}
	if b.statsPool, err = pgdb.Open(ctx, pgdb.Config{URL: url, MaxConns: 2, ApplicationName: "sagabench-stats"}); err != nil {
		return nil, err
	}
	b.statsDB = b.statsPool.SQL
	b.statementStats = enableStatementStats(ctx, b.statsDB)
	gcfg := fakegateway.Config{DB: b.gwDB.SQL, Logger: b.log}
	if opts.gatewayDelay > 0 {
		gcfg.SlowDelay = opts.gatewayDelay
		gcfg.Faults = func(fakegateway.Call) fakegateway.Fault { return fakegateway.Slow }
	}
	if b.gateway, err = fakegateway.Start(ctx, gcfg); err != nil {
		return nil, err
	}
	tcfg := transport.Config{BatchSize: opts.batch, Consumers: opts.consumers}
	var reg *prometheus.Registry
	if opts.metricsAddr != "" {
		reg = obs.NewRegistry()
		tcfg.Metrics = reg
	}
	cfg := orderpayment.Config{DB: b.db.SQL, GatewayURL: b.gateway.URL(), Transport: tcfg,
		AsyncProjection: opts.asyncProjection, QueueEveryHop: opts.queueEveryHop, FinishedChannel: finishedChannel, Logger: b.log}
	if opts.paymentsService != "" {
		if err := b.newPaymentService(ctx, tcfg); err != nil {
			return nil, err
		}
		if cfg.PaymentsBroker, err = b.openBroker(); err != nil {
			return nil, err
		}
	}
	b.app, err = orderpayment.New(cfg)
	if err != nil {
		return nil, err
	}
	if err := b.app.Setup(ctx); err != nil {
		return nil, err
	}
	front := cfg
	front.DB, front.FinishedChannel = b.clients.SQL, ""
	b.front, err = orderpayment.New(front)
	if err != nil {
		return nil, err
	}
	if reg != nil {
		if b.pay != nil {
			prometheus.WrapRegistererWith(prometheus.Labels{"service": "orders"}, reg).MustRegister(b.app.Client.Collector())
			prometheus.WrapRegistererWith(prometheus.Labels{"service": "payments"}, reg).MustRegister(b.pay.Client.Collector())
		} else {
			reg.MustRegister(b.app.Client.Collector())
		}
		if b.metrics, err = obs.ServeMetrics(opts.metricsAddr, reg, b.log); err != nil {
			return nil, err
		}
		fmt.Fprintf(b.status, "metrics: serving http://%s/metrics\n", b.metrics.Addr())
	}
	if b.cpu, err = newCPUMeter(ctx, b.db.SQL); err != nil {
		return nil, err
	}
	if err := b.startListener(ctx); err != nil {
		return nil, err
	}
	if err := b.seed(ctx); err != nil {
		return nil, err
	}
	rctx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	b.stopRetention, b.retentionDone = cancel, make(chan error, 1)
	go func() {
		defer b.dropOnPanic()
		b.retentionDone <- b.app.RunRetention(rctx)
	}()
	ok = true
	return b, nil
}

// sidePools are the run's pools besides the workers' and the clients':
// the fake gateway's (8) and the statistics' (2). (The admin pool is open
// when the connections are counted: it counts as used.)
const sidePools = 8 + 2

// connections returns the size of the workers' pool in this process and
// how many connections the whole run may open at most.
func (o options) connections() (workersPool int32, need int) {
	perWorker := o.consumers * (len(topicsHint) + 2) // a connection per busy consumer, plus charge leases
	workersPool = int32(perWorker*o.workers + 8)
	need = int(workersPool) + o.placers() + sidePools
	if o.workerProcs > 0 {
		// The workers are elsewhere: this process seeds, checks and
		// runs the retention jobs.
		workersPool = 8
		need = int(workersPool) + o.placers() + sidePools + o.workerProcs*(perWorker+4)
	}
	if o.paymentsService != "" {
		// Each service consumes its own topics: the orders service five
		// (no charge leases), plus its relays (2) and reply receivers
		// (2); the payment service two, with their leases, plus its relay
		// and command receivers (4). And a small pool seeds accounts.
		workersPool = int32((o.consumers*5+4)*o.workers + 8)
		need = 2*int(workersPool) + o.placers() + sidePools + paySeedConns
	}
	return workersPool, need
}

// startWorkers starts the workers and returns once all run, or with the
// reason one cannot (close stops those already started). The context it
// returns ends when ctx does or when a worker stops (see workerwatch.Watch);
// call stopWatching before stopping the workers.
func (b *bench) startWorkers(ctx context.Context) (_ context.Context, stopWatching func(), _ error) {
	if b.opts.workerProcs > 0 {
		spec := workerSpec{URL: b.url, GatewayURL: b.gateway.URL(), Consumers: b.opts.consumers, Batch: b.opts.batch,
			AsyncProjection: b.opts.asyncProjection, QueueEveryHop: b.opts.queueEveryHop, MaxConns: int32(b.opts.consumers*(len(topicsHint)+2) + 4),
			LogLevel: b.opts.log.LevelOr(slog.LevelWarn).String(), LogFormat: b.opts.log.Format, Metrics: b.opts.metricsAddr != ""}
		for range b.opts.workerProcs {
			p, err := startWorkerProcess(ctx, spec, b.status)
			if err != nil {
				return nil, nil, err
			}
			b.procs = append(b.procs, p)
			if p.metricsURL != "" {
				fmt.Fprintf(b.status, "metrics: worker process %d serving %s\n", p.cmd.Process.Pid, p.metricsURL)
			}
		}
		ctx, stopWatching = workerwatch.Watch(ctx, b.procs)
		return ctx, stopWatching, nil
	}
	fleet, err := workerwatch.StartFleet(ctx, b.opts.workers, workerwatch.Sample(b.app, b.pay)...)
	b.fleet = fleet
	if err != nil {
		return nil, nil, err
	}
	ctx, stopWatching = workerwatch.Watch(ctx, b.fleet.Workers)
	return ctx, stopWatching, nil
}

// openPaymentsDB creates, migrates and opens the payment service's fresh
// database, next to the run's; it returns its URL.
func (b *bench) openPaymentsDB(ctx context.Context, maxConns int32) (string, error) {
	b.payDBName = b.dbName + paymentsDatabaseSuffix
	if err := createDatabase(ctx, b.admin, b.payDBName); err != nil {
		name := b.payDBName
		if !pgerr.ConnectionLost(err) {
			b.payDBName = ""
		}
		return "", fmt.Errorf("creating the payment service's database %s: %w", name, err)
	}
	url, err := pgdb.WithDatabase(b.found.URL, b.payDBName)
	if err != nil {
		return "", err
	}
	if b.payDB, err = pgdb.Open(ctx, pgdb.Config{URL: url, MaxConns: maxConns, ApplicationName: "sagabench-payments", Tracer: &b.statements}); err != nil {
		return "", err
	}
	if _, err := orderpayment.Migrate(ctx, b.payDB.SQL); err != nil {
		return "", err
	}
	if b.payClients, err = pgdb.Open(ctx, pgdb.Config{URL: url, MaxConns: paySeedConns, ApplicationName: "sagabench-payments-clients"}); err != nil {
		return "", err
	}
	fmt.Fprintf(b.status, "payment service: a fresh database %s, reached through %s\n", b.payDBName, brokerurl.Describe(b.opts.paymentsService))
	return url, nil
}

// openBroker connects to the -payments-service broker: each service its
// own connections, as separate processes would have.
func (b *bench) openBroker() (broker.Broker, error) {
	br, err := brokers.Open(b.opts.paymentsService, b.log)
	if err != nil {
		return nil, fmt.Errorf("-payments-service: %w", err)
	}
	b.brokers = append(b.brokers, br)
	return br, nil
}

// newPaymentService builds the payment service (its workers and bridge
// start with the others) and its clients' view, for seeding. The run's
// databases are fresh: so must the broker's topics be, or what an earlier
// run left there (commands re-sent after its sagas ended) would be
// delivered to this one's.
func (b *bench) newPaymentService(ctx context.Context, tcfg transport.Config) error {
	br, err := b.openBroker()
	if err != nil {
		return err
	}
	if r, ok := br.(broker.Resetter); ok {
		def, err := saga.Define(orderpayment.Spec(orderpayment.Steps(orderpayment.StepTimeouts{})))
		if err != nil {
			return err
		}
		topics := []string{payments.ChargeTopic, payments.RefundTopic, def.ReplyTopic}
		if err := r.Reset(ctx, topics...); err != nil {
			return fmt.Errorf("-payments-service: %w", err)
		}
		fmt.Fprintf(b.status, "payment service: the sample's topics at the broker start empty (%v)\n", topics)
	}
	b.pay, err = orderpayment.NewPaymentService(orderpayment.PaymentServiceConfig{DB: b.payDB.SQL, GatewayURL: b.gateway.URL(),
		Broker: br, Transport: tcfg, Logger: b.log})
	if err != nil {
		return err
	}
	if err := b.pay.Setup(ctx); err != nil {
		return err
	}
	b.payFront, err = orderpayment.NewPaymentService(orderpayment.PaymentServiceConfig{DB: b.payClients.SQL, GatewayURL: b.gateway.URL(),
		Broker: br, Transport: tcfg, Logger: b.log})
	return err
}

// paySeedConns is the pool that seeds the payment service's accounts.
const paySeedConns = 4

// topicsHint is the number of topics the sample's worker consumes, for
// sizing the pool: trigger, charge, refund, confirm, cancel, replies,
// projection.
var topicsHint = [7]struct{}{}

// checkConnections fails early, and clearly, when the server or the role
// cannot take the connections the run needs: short of them, seeding or a
// worker's start fails midway with "too many connections".
func (b *bench) checkConnections(ctx context.Context, need int) error {
	var (
		maxConns, used, roleLimit, roleUsed int
		role                                string
	)
	err := b.admin.SQL.QueryRowContext(ctx, `SELECT current_setting('max_connections')::int, (SELECT count(*) FROM pg_stat_activity),
    current_user, CASE WHEN r.rolsuper THEN -1 ELSE r.rolconnlimit END,
    (SELECT count(*) FROM pg_stat_activity WHERE usename = current_user)
FROM pg_roles r WHERE r.rolname = current_user`).Scan(&maxConns, &used, &role, &roleLimit, &roleUsed)
	if err != nil {
		return fmt.Errorf("reading max_connections and the role's connection limit: %w", err)
	}
	if free := maxConns - used - 3; need > free {
		return fmt.Errorf("this run needs up to %d connections but the server has %d free (max_connections %d): use fewer -consumers or -workers, or raise max_connections", need, free, maxConns)
	}
	// A superuser's limit is not enforced.
	if free := roleLimit - roleUsed; roleLimit >= 0 && need > free {
		return fmt.Errorf("this run needs up to %d connections but role %s may open %d more (CONNECTION LIMIT %d): use fewer -consumers or -workers, or raise the limit (ALTER ROLE %s CONNECTION LIMIT %d)",
			need, role, max(free, 0), roleLimit, pgx.Identifier{role}.Sanitize(), roleUsed+need)
	}
	return nil
}

func (b *bench) startListener(ctx context.Context) error {
	b.tracker = newTracker()
	listening := make(chan struct{})
	var once sync.Once
	l, err := pglisten.New(pglisten.Config{
		DB:       b.db.SQL,
		Channels: []string{finishedChannel},
		OnNotify: func(_, payload string) {
			if id, err := uuid.Parse(payload); err == nil {
				b.tracker.finish(id, time.Now())
			}
		},
		OnListen: func() {
			first := false
			once.Do(func() { first = true; close(listening) })
			if !first {
				// Notifications sent while the connection was down are
				// lost: look for sagas that finished meanwhile.
				go func() {
					defer b.dropOnPanic()
					b.recheck(ctx)
				}()
			}
		},
		Logger: b.log,
	})
	if err != nil {
		return err
	}
	lctx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	b.stopListener = cancel
	b.listenerDone = make(chan struct{})
	go func() {
		defer b.dropOnPanic()
		defer close(b.listenerDone)
		_ = l.Run(lctx)
	}()
	// Sagas must not finish unheard: wait for the first LISTEN.
	select {
	case <-listening:
		return nil
	case <-time.After(30 * time.Second):
		return fmt.Errorf("could not LISTEN on %s", finishedChannel)
	}
}

// recheck finishes the tracked sagas that ended while nobody listened.
func (b *bench) recheck(ctx context.Context) {
	ids := b.tracker.pendingIDs()
	if len(ids) == 0 {
		return
	}
	rows, err := b.db.SQL.QueryContext(ctx, `SELECT id FROM saga_instances WHERE id = ANY ($1::uuid[]) AND finished_at IS NOT NULL`, ids)
	if err != nil {
		b.log.Warn("rechecking finished sagas", "err", err)
		return
	}
	defer rows.Close()
	now := time.Now()
	for rows.Next() {
		var id uuid.UUID
		if rows.Scan(&id) == nil {
			b.tracker.finish(id, now)
		}
	}
}

// seed creates the customers, in parallel.
func (b *bench) seed(ctx context.Context) error {
	fmt.Fprintf(b.status, "seeding %d customers (every %dth with no money)\n", customers, refusedEvery)
	var (
		wg       sync.WaitGroup
		next     atomic.Int64
		firstErr error
		mu       sync.Mutex
	)
	for range 8 {
		wg.Go(func() {
			defer b.dropOnPanic()
			for {
				i := int(next.Add(1)) - 1
				if i >= customers {
					return
				}
				id := customerID(i)
				err := b.front.Orders.AddCustomer(ctx, id, "Customer "+id)
				if err == nil {
					err = b.payments().OpenAccount(ctx, id)
				}
				if err == nil && i%refusedEvery != 0 {
					err = b.payments().Deposit(ctx, id, fundedCents, "bench-seed")
				}
				if err != nil {
					mu.Lock()
					firstErr = cmpErr(firstErr, fmt.Errorf("seeding customer %s: %w", id, err))
					mu.Unlock()
					return
				}
			}
		})
	}
	wg.Wait()
	return firstErr
}

func cmpErr(first, err error) error {
	if first != nil {
		return first
	}
	return err
}

func customerID(i int) string { return fmt.Sprintf("bench-%04d", i) }

// place places one order and registers its saga with the tracker under
// phase, timed from start.
func (b *bench) place(ctx context.Context, phase string, i int, rng *mrand.Rand, start time.Time) error {
	res, err := b.front.Orders.Place(ctx, orders.PlaceRequest{
		Key:         fmt.Sprintf("%s-%d", phase, i),
		CustomerID:  customerID(rng.IntN(customers)),
		AmountCents: int64(1_000 + 100*rng.IntN(81)),
	})
	if err != nil {
		return err
	}
	b.tracker.add(saga.ID(orderpayment.Name, res.OrderID.String()), phase, start)
	return nil
}

// stopWorkers drains and stops the workers, then the bridges.
func (b *bench) stopWorkers() {
	b.fleet.Stop(b.log)
	b.fleet = nil
	var wg sync.WaitGroup
	for _, p := range b.procs {
		wg.Go(func() {
			defer b.dropOnPanic()
			if err := p.stop(); err != nil {
				b.log.Error("stopping a worker process", "err", err)
			}
		})
	}
	wg.Wait()
	b.procs = nil
}

func (b *bench) close() {
	b.stopWorkers()
	if b.metrics != nil {
		if err := b.metrics.Close(); err != nil {
			b.log.Error("stopping the metrics server", "err", err)
		}
	}
	if b.stopRetention != nil {
		b.stopRetention()
		if err := <-b.retentionDone; err != nil {
			b.log.Error("retention", "err", err)
		}
	}
	if b.stopListener != nil {
		b.stopListener()
		<-b.listenerDone
	}
	if b.gateway != nil {
		_ = b.gateway.Close()
	}
	for _, br := range b.brokers {
		_ = br.Close()
	}
	for _, db := range []*pgdb.DB{b.statsPool, b.gwDB, b.clients, b.db, b.payClients, b.payDB} {
		if db != nil {
			db.Close()
		}
	}
	if b.admin != nil {
		b.dropDatabases()
		b.admin.Close()
	}
	if b.found != nil {
		if err := b.found.Close(); err != nil {
			b.log.Error("stopping the embedded PostgreSQL", "err", err)
		}
	}
}

// dropDatabases drops the run's databases, unless -keep, once: from close,
// or from a goroutine of the run's that panics (dropOnPanic). A lost
// connection is retried (pgerr.RetryLost: about eleven seconds, so a
// server that restarts is waited for); a database it cannot drop it names,
// with the command that drops it.
func (b *bench) dropDatabases() {
	b.dropOnce.Do(func() {
		for _, name := range []string{b.dbName, b.payDBName} {
			switch {
			case name == "":
			case b.opts.keep:
				fmt.Fprintf(b.status, "kept database %s\n", name)
			default:
				ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
				if err := dropDatabase(ctx, b.admin, name); err != nil {
					fmt.Fprintf(b.status, "sagabench: could not drop the benchmark database %s (%v); drop it with: %s\n", name, err, dropCommand(name))
				}
				cancel()
			}
		}
	})
}

// dropOnPanic, deferred first in each goroutine the run starts, drops the
// run's databases when a panic there is about to end the process, then
// lets the panic go on. (A panic in run's own goroutine unwinds through
// close, which drops them.)
func (b *bench) dropOnPanic() {
	if p := recover(); p != nil {
		b.dropDatabases()
		panic(p)
	}
}

// createDatabase creates database name, which must not exist yet (another
// run's). A lost connection is retried (pgerr.RetryLost), as database/sql
// itself may send CREATE DATABASE again when its answer was lost: so the
// database existing by then is this run's own.
func createDatabase(ctx context.Context, admin *pgdb.DB, name string) error {
	var exists bool
	err := pgerr.RetryLost(ctx, func(ctx context.Context) error {
		return admin.SQL.QueryRowContext(ctx, databaseExistsSQL, name).Scan(&exists)
	})
	switch {
	case err != nil:
		return err
	case exists:
		return fmt.Errorf("database %s exists already", name)
	}
	return pgerr.RetryLost(ctx, func(ctx context.Context) error {
		_, err := admin.SQL.ExecContext(ctx, "CREATE DATABASE "+pgx.Identifier{name}.Sanitize())
		if pgerr.Is(err, pgerrcode.DuplicateDatabase) {
			return nil
		}
		return err
	})
}

const databaseExistsSQL = `SELECT EXISTS (SELECT FROM pg_database WHERE datname = $1)`

// dropDatabase drops database name, retrying over a lost connection (it is
// a no-op the second time).
func dropDatabase(ctx context.Context, admin *pgdb.DB, name string) error {
	return pgerr.RetryLost(ctx, func(ctx context.Context) error {
		_, err := admin.SQL.ExecContext(ctx, "DROP DATABASE IF EXISTS "+pgx.Identifier{name}.Sanitize()+" WITH (FORCE)")
		return err
	})
}

// dropCommand is the command that drops database name on the server this
// run used.
func dropCommand(name string) string {
	cmd := "go run ./cmd/sagabench -drop " + name
	if os.Getenv(pgdb.EnvURL) != "" {
		cmd += " (with " + pgdb.EnvURL + " as for this run)"
	}
	return cmd
}

// dropNamed is -drop: it drops the databases named (benchmark databases
// only, as validate checks) on the server a run would use, and says which
// it dropped.
func dropNamed(ctx context.Context, opts options, stdout, stderr io.Writer) int {
	log := opts.log.New(stderr, opts.log.LevelOr(slog.LevelWarn))
	found, err := finddb.Find(ctx, finddb.Config{Logger: log})
	if err != nil {
		fmt.Fprintln(stderr, "sagabench:", err)
		return exitNoService
	}
	defer func() {
		if err := found.Close(); err != nil {
			log.Error("stopping the embedded PostgreSQL", "err", err)
		}
	}()
	admin, err := pgdb.Open(ctx, pgdb.Config{URL: found.URL, MaxConns: 2, ApplicationName: "sagabench-admin"})
	if err != nil {
		fmt.Fprintln(stderr, "sagabench:", err)
		return exitNoService
	}
	defer admin.Close()
	code := exitOK
	for _, name := range opts.drop {
		var exists bool
		err := admin.SQL.QueryRowContext(ctx, databaseExistsSQL, name).Scan(&exists)
		if err == nil && exists {
			err = dropDatabase(ctx, admin, name)
		}
		switch {
		case err != nil:
			fmt.Fprintf(stderr, "sagabench: dropping database %s: %v\n", name, err)
			code = exitNoService
		case exists:
			fmt.Fprintf(stdout, "dropped database %s\n", name)
		default:
			fmt.Fprintf(stdout, "no database %s (dropped already)\n", name)
		}
	}
	return code
}
