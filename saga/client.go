package saga

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"log/slog"
	"reflect"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"

	"github.com/pgsaga/pgsaga/idempotency"
	"github.com/pgsaga/pgsaga/internal/bridge"
	"github.com/pgsaga/pgsaga/internal/dbtx"
	"github.com/pgsaga/pgsaga/internal/metadata"
	"github.com/pgsaga/pgsaga/internal/stepsrt"
	"github.com/pgsaga/pgsaga/internal/transport"
	"github.com/pgsaga/pgsaga/migrations"
	"github.com/pgsaga/pgsaga/saga/delivery"
	"github.com/pgsaga/pgsaga/steps"
	"github.com/pgsaga/pgsaga/steps/broker"
	"github.com/pgsaga/pgsaga/steps/events"
)

// Defaults of ClientConfig.
const (
	KeyTTLDefault     = 7 * 24 * time.Hour
	HistoryTTLDefault = 30 * 24 * time.Hour
)

// ClientConfig configures a Client. Zero values take the defaults.
type ClientConfig struct {
	// Transport configures delivery: batches, consumers, timeouts, the
	// retry policy, metrics and traces. Its DB and Logger are filled in.
	Transport delivery.Config

	// RegisterEvents registers the domain event types the steps append
	// (steps.Tx.Append). Optional: without it the client has an event
	// store with no types, and appending fails.
	RegisterEvents []func(*events.Registry) error
	// EventsTopic names the topic of a stream's appended events: they are
	// published to it through the appending transaction (unless
	// EventsNotPublished), for asynchronous projections and other
	// services, and the topic's inline projections (events.Projection.Inline) run
	// in that transaction. "" for none. Default: none.
	EventsTopic func(streamID string) string
	// EventsNotPublished keeps events off the outbox: for events whose
	// every projection is inline and that nothing else consumes (a message
	// published to a topic no consumer group subscribes to is
	// dead-lettered). Needs EventsTopic; the client then takes inline
	// projections only (an asynchronous one would receive nothing).
	EventsNotPublished bool

	// InProcessSteps names steps this client serves (AddSteps) that take
	// in-process deliveries: a command for one of
	// them published from a delivery attempt of this process (the
	// engine's, typically) runs at once in that attempt, with the same
	// idempotency key, stored reply and saga timeline as through the
	// queue; if it fails in any way it is queued and retried as usual.
	// For steps that touch only the database, quickly: the step's work
	// and locks join the publisher's transaction. Default: none.
	InProcessSteps []string
	// InProcessEngine lets the engine take in-process deliveries of its
	// sagas' triggers and replies: a reply a step of this process
	// publishes from its delivery attempt is applied in that attempt, and
	// the next command sent from there (in process too, if its step is
	// in InProcessSteps); and StartTx starts the saga in the caller's
	// transaction instead of publishing its trigger. Default: off, every
	// trigger and reply is queued.
	InProcessEngine bool

	// SweepInterval is how often the sweeper looks for overdue commands.
	// Default: 1s.
	SweepInterval time.Duration
	// FinishedChannel, if set, is a PostgreSQL notification channel: every
	// saga that ends (completed, compensated, failed) sends a notification
	// on it, with its id as the payload, in the transaction that ends it,
	// so it is delivered when, and only if, that transaction commits.
	// WaitFinished and ListenFinished wait on it. Each notification adds a
	// little to the finishing commit, so it is off by default. Default: ""
	// (none).
	FinishedChannel string
	// Retry is the retry policy of the client's steps (their commands) and
	// of the engine's handlers (triggers, replies, operator requests).
	// Default: Transport.Retry. A trigger or reply the engine cannot use is
	// dead-lettered, with the reason.
	Retry *delivery.RetryPolicy

	// KeyTTL is how long finished idempotency keys are kept; a duplicate
	// arriving later runs again. Default: KeyTTLDefault.
	KeyTTL time.Duration
	// Prune says which finished sagas are deleted, and when. Default: their
	// timelines after HistoryTTLDefault, instances kept.
	Prune PruneConfig
	// DisableRetention turns the retention jobs (finished keys, finished
	// sagas) off in this process: run them in another.
	DisableRetention bool

	// Broker connects the client's database to a message broker, for
	// steps served by other services on databases of their own (see
	// steps/broker): Broker.Relay names the topics relayed to the broker
	// (the commands of the steps served elsewhere; a participant service:
	// the sagas' reply topics), Broker.Receive those taken in from it (the
	// reply topics; a participant service: its steps' command topics).
	// Where a step runs is this configuration alone: saga definitions do
	// not change. Its Transport is the client's; Start runs the bridge
	// after the worker, Stop stops it after the worker (what the relay had
	// no time for stays queued for the next start). Default: none
	// (Broker.Broker nil).
	Broker broker.Config

	// Schema is the PostgreSQL schema pgsaga's tables live in. pgsaga
	// names its tables without a schema, so they are found through the
	// connections' search_path, where a schema costs no statement: set it
	// on the pool, before the schemas of your own tables
	// (pgxpool.Config.ConnConfig.RuntimeParams["search_path"] =
	// "billing, public"). Migrate creates the schema if it is missing;
	// Migrate, Setup and Start refuse a pool whose current schema (the
	// first of its search_path that exists) is another
	// (ErrSchemaNotOnPath). The transactions you give StartTx and
	// PublishTx must resolve names the same way: with a Schema, each call
	// checks so, at the cost of one statement in your transaction.
	// Lowercase letters, digits and _, up to 63. Default: "" (the
	// search_path's, public unless it says otherwise).
	Schema string

	// Logger. Default: slog.Default().
	Logger *slog.Logger
}

// Client is pgsaga in one process: the transport, the idempotency store, the
// event store, the step runtime and the saga engine over one pool, the sagas,
// steps and projections this process serves, and the workers, sweeper and
// retention jobs that run them. Build it with NewClient, use its stores to
// build your services, add what it serves, then Start it; Stop drains it.
type Client struct {
	db          *sql.DB
	transport   *transport.Transport
	idempotency *idempotency.Store
	events      *events.Store
	runtime     stepsrt.Runtime
	engine      *engine
	bridge      *bridge.Bridge // nil without a broker
	cfg         ClientConfig
	log         *slog.Logger

	mu          sync.Mutex
	steps       []steps.AnyStep
	projections []events.Projection // asynchronous
	// inline holds the inline projections by topic; replaced whole (under
	// mu) before Start, read by every append.
	inline   atomic.Pointer[map[string][]events.Projection]
	started  bool
	worker   *Worker
	stopJobs context.CancelFunc
	jobs     sync.WaitGroup
	jobErrs  []error

	life        sync.Mutex         // held by Start and Stop throughout
	cancelStart context.CancelFunc // ends a Start in progress (under mu)
	stopped     bool               // Stop was called (under mu)
	done        chan struct{}      // Stopped: closed once nothing runs after Start or Stop
	doneOnce    sync.Once

	finished finishedHub // WaitFinished's one listener
}

// NewClient validates cfg and builds a client over pool. It starts nothing
// and touches no table: run the migrations first (migrations.Apply).
func NewClient(pool *pgxpool.Pool, cfg ClientConfig) (*Client, error) {
	if pool == nil {
		return nil, errors.New("saga: NewClient needs a pool")
	}
	return newClient(stdlib.OpenDBFromPool(pool), cfg)
}

// NewClientFromDB is NewClient over a database/sql handle of a pgx pool
// (stdlib.OpenDBFromPool), for code that has one already.
func NewClientFromDB(db *sql.DB, cfg ClientConfig) (*Client, error) {
	if db == nil {
		return nil, errors.New("saga: NewClientFromDB needs a database")
	}
	return newClient(db, cfg)
}

func newClient(db *sql.DB, cfg ClientConfig) (*Client, error) {
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.KeyTTL == 0 {
		cfg.KeyTTL = KeyTTLDefault
	}
	if cfg.Prune.History == 0 && cfg.Prune.Instances == 0 {
		cfg.Prune.History = HistoryTTLDefault
	}
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	tcfg := cfg.Transport
	tcfg.DB, tcfg.Logger = db, cfg.Logger
	tr, err := transport.New(tcfg)
	if err != nil {
		return nil, err
	}
	store, err := idempotency.NewStore(idempotency.Config{DB: db, Logger: cfg.Logger, LockTimeout: keyLockTimeout})
	if err != nil {
		return nil, err
	}
	reg := events.NewRegistry()
	for _, r := range cfg.RegisterEvents {
		if err := r(reg); err != nil {
			return nil, err
		}
	}
	c := &Client{cfg: cfg, log: cfg.Logger, done: make(chan struct{})}
	ecfg := events.Config{Registry: reg}
	if cfg.EventsTopic != nil {
		ecfg.Topic, ecfg.Project = cfg.EventsTopic, c.project
		if !cfg.EventsNotPublished {
			ecfg.Publisher = func(tx delivery.DBTX) message.Publisher { return tr.Publisher(tx) }
		}
	}
	es, err := events.NewStore(ecfg)
	if err != nil {
		return nil, err
	}
	rt, err := stepsrt.New(stepsrt.Config{Transport: tr, Store: store, KeyLockTimeout: keyLockTimeout, Events: es, Retry: cfg.Retry, Logger: cfg.Logger})
	if err != nil {
		return nil, err
	}
	engine, err := newEngine(engineConfig{DB: db, Transport: tr, Retry: cfg.Retry, SweepInterval: cfg.SweepInterval,
		FinishedChannel: cfg.FinishedChannel, Logger: cfg.Logger})
	if err != nil {
		return nil, err
	}
	c.db, c.transport, c.idempotency, c.events, c.runtime, c.engine = db, tr, store, es, rt, engine
	if cfg.Broker.Broker != nil {
		bcfg := cfg.Broker
		if bcfg.Logger == nil {
			bcfg.Logger = cfg.Logger
		}
		if c.bridge, err = bridge.New(tr, bcfg); err != nil {
			return nil, err
		}
	}
	c.finished.c = c
	return c, nil
}

// validate checks what would otherwise fail only once the client runs.
func (cfg ClientConfig) validate() error {
	var errs []error
	if cfg.KeyTTL < 0 {
		errs = append(errs, fmt.Errorf("KeyTTL must not be negative, got %s", cfg.KeyTTL))
	}
	prune := cfg.Prune
	if err := prune.setDefaults(); err != nil {
		errs = append(errs, err)
	}
	if cfg.FinishedChannel != "" {
		if err := transport.ValidateChannel(cfg.FinishedChannel); err != nil {
			errs = append(errs, fmt.Errorf("FinishedChannel: %w", err))
		}
	}
	if cfg.Schema != "" {
		if err := validateSchema(cfg.Schema); err != nil {
			errs = append(errs, err)
		}
	}
	if cfg.EventsNotPublished && cfg.EventsTopic == nil {
		errs = append(errs, errors.New("EventsNotPublished needs EventsTopic"))
	}
	if cfg.Broker.Broker == nil && (len(cfg.Broker.Relay) > 0 || len(cfg.Broker.Receive) > 0) {
		errs = append(errs, errors.New("Broker.Relay and Broker.Receive need Broker.Broker"))
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("saga: invalid client config: %w", err)
	}
	return nil
}

// DB is the client's database/sql handle.
func (c *Client) DB() *sql.DB { return c.db }

// Idempotency is the idempotency key store (steps' keys, HTTP keys,
// leases of external calls).
func (c *Client) Idempotency() *idempotency.Store { return c.idempotency }

// Events is the event store steps append to.
func (c *Client) Events() *events.Store { return c.events }

// keyLockTimeout bounds how long a claim of an idempotency key (a step's,
// one at a time or a batch's) waits for a concurrent claimer of it.
const keyLockTimeout = 5 * time.Second

// Bridge is the client's bridge to its message broker (ClientConfig.Broker),
// nil without one. Start and Stop run it; a test that runs workers of its
// own (NewWorker) starts and stops it itself.
func (c *Client) Bridge() broker.Bridge {
	if c.bridge == nil {
		return nil
	}
	return c.bridge
}

// Register adds saga definitions this process drives.
func (c *Client) Register(defs ...*Definition) error {
	return c.beforeStart(func() error {
		for _, d := range defs {
			if err := c.engine.Register(d); err != nil {
				return err
			}
		}
		return nil
	})
}

// AddSteps adds participant steps this process serves.
func (c *Client) AddSteps(s ...steps.AnyStep) error {
	for _, st := range s {
		if isNil(st) {
			return errors.New("saga: AddSteps of a nil step")
		}
	}
	return c.beforeStart(func() error {
		c.mu.Lock()
		defer c.mu.Unlock()
		c.steps = append(c.steps, s...)
		return nil
	})
}

// AddProjections adds projections this process maintains.
func (c *Client) AddProjections(p ...events.Projection) error {
	for _, pr := range p {
		if pr.Name == "" || pr.Handle == nil {
			return errors.New("saga: a projection needs a Name and a Handle")
		}
		if pr.Inline && c.cfg.EventsTopic == nil {
			return fmt.Errorf("saga: inline projection %s: the client's events have no topic (ClientConfig.EventsTopic)", pr.Name)
		}
		if !pr.Inline && c.cfg.EventsNotPublished {
			return fmt.Errorf("saga: projection %s would receive nothing: the client's events are not published (ClientConfig.EventsNotPublished); make it Inline", pr.Name)
		}
		if err := transport.ValidateTopic(pr.Topic); err != nil {
			return fmt.Errorf("saga: projection %s: %w", pr.Name, err)
		}
	}
	return c.beforeStart(func() error {
		c.mu.Lock()
		defer c.mu.Unlock()
		inline := map[string][]events.Projection{}
		for topic, ps := range c.inlineByTopic() {
			inline[topic] = ps
		}
		for _, pr := range p {
			if !pr.Inline {
				c.projections = append(c.projections, pr)
				continue
			}
			inline[pr.Topic] = append(inline[pr.Topic], pr)
		}
		c.inline.Store(&inline)
		return nil
	})
}

// inlineByTopic is the inline projections by topic (nil map: none).
func (c *Client) inlineByTopic() map[string][]events.Projection {
	if m := c.inline.Load(); m != nil {
		return *m
	}
	return nil
}

// project runs the inline projections of topic on the event messages of
// an append, in its transaction (events.Config.Project).
func (c *Client) project(ctx context.Context, tx delivery.DBTX, topic string, msgs []*message.Message) error {
	ps := c.inlineByTopic()[topic]
	if len(ps) == 0 {
		return nil
	}
	for _, m := range msgs {
		// Its context is the append's, with what the event store adds.
		m.SetContext(transport.ContextWithTx(m.Context(), tx))
		for _, p := range ps {
			if err := p.Handle(m.Context(), tx, m); err != nil {
				return fmt.Errorf("saga: inline projection %s: %w", p.Name, err)
			}
		}
	}
	return nil
}

// projectionHandler runs an asynchronous projection in its delivery's
// transaction.
func projectionHandler(p events.Projection) transport.HandlerFunc {
	return func(msg *message.Message) error {
		tx, ok := transport.TxFromContext(msg.Context())
		if !ok {
			return fmt.Errorf("saga: projection %s: no delivery transaction", p.Name)
		}
		return p.Handle(msg.Context(), tx, msg)
	}
}

// beforeStart runs add unless the client started (or is starting, or was
// stopped): what a client serves is fixed when it starts.
func (c *Client) beforeStart(add func() error) error {
	c.life.Lock()
	defer c.life.Unlock()
	c.mu.Lock()
	started := c.started || c.stopped
	c.mu.Unlock()
	if started {
		return ErrClientStarted
	}
	return add()
}

// Subscriptions lists what the client's workers consume: its steps, its
// projections and its sagas' triggers and replies (Setup records them).
func (c *Client) Subscriptions() []delivery.Subscription {
	c.mu.Lock()
	served := make([]any, len(c.steps))
	for i, s := range c.steps {
		served[i] = s
	}
	subs := c.runtime.Subscriptions(served...)
	for _, p := range c.projections {
		subs = append(subs, transport.Subscription{Topic: p.Topic, ConsumerGroup: p.Name})
	}
	c.mu.Unlock()
	return append(subs, c.engine.Subscriptions()...)
}

// Setup records the step lists of the client's saga definitions (refusing
// one whose steps changed without a new Version while instances of it are
// unfinished: ErrDefinitionChanged) and its
// subscriptions, so that nothing published
// before its first worker starts goes unrouted (a message reaches the
// consumer groups its topic had when it was published). Start does it;
// call it earlier, before publishing, if publishing may come first. Safe
// in several processes at once.
func (c *Client) Setup(ctx context.Context) error {
	if err := c.checkSchema(ctx, c.db, true); err != nil {
		return err
	}
	if err := c.engine.RecordDefinitions(ctx); err != nil {
		return err
	}
	if err := c.transport.Subscribe(ctx, c.Subscriptions()...); err != nil {
		return err
	}
	if c.bridge != nil {
		return c.bridge.Setup(ctx)
	}
	return nil
}

// NewWorker builds a worker with every handler of the client: its steps,
// projections and sagas. Start runs one; more, in this process or others,
// share the work (tests start and stop several).
func (c *Client) NewWorker() (*Worker, error) {
	r, err := c.transport.NewRouter()
	if err != nil {
		return nil, err
	}
	c.mu.Lock()
	stepList := append([]steps.AnyStep(nil), c.steps...)
	projections := append([]events.Projection(nil), c.projections...)
	c.mu.Unlock()
	inProcess := map[string]bool{}
	for _, name := range c.cfg.InProcessSteps {
		inProcess[name] = true
	}
	for _, s := range stepList {
		var opts []transport.HandlerOption
		if c.cfg.InProcessEngine {
			// The replies of a batch of commands reach the engine in the
			// batch's transaction: the instances they read are loaded
			// with the batch, in one statement.
			opts = append(opts, transport.LoadPerBatch(commandLoad))
		}
		if inProcess[s.Name()] {
			opts = append(opts, transport.InProcess())
			delete(inProcess, s.Name())
		}
		if err := c.runtime.Register(r, s, opts...); err != nil {
			return nil, fmt.Errorf("saga: registering step %s: %w", s.Name(), err)
		}
	}
	for name := range inProcess {
		return nil, fmt.Errorf("saga: ClientConfig.InProcessSteps names %q, a step this client does not serve (AddSteps)", name)
	}
	for _, p := range projections {
		if err := r.AddHandler(p.Name, p.Topic, p.Name, projectionHandler(p)); err != nil {
			return nil, fmt.Errorf("saga: registering projection %s: %w", p.Name, err)
		}
	}
	var engineOpts []transport.HandlerOption
	if c.cfg.InProcessEngine {
		engineOpts = append(engineOpts, transport.InProcess())
	}
	if err := c.engine.addHandlers(r, engineOpts...); err != nil {
		return nil, err
	}
	return &Worker{engine: c.engine, router: r, stopped: make(chan struct{})}, nil
}

// Start records the subscriptions, starts a worker and the retention jobs,
// and returns once the worker runs, or with the reason it cannot. ctx
// bounds the start only; the client runs until Stop.
func (c *Client) Start(ctx context.Context) error {
	c.mu.Lock()
	if c.started || c.stopped {
		c.mu.Unlock()
		return ErrClientStarted
	}
	c.started = true
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	c.cancelStart = cancel // Stop ends a Start in progress
	c.mu.Unlock()
	c.life.Lock()
	defer c.life.Unlock()
	w, err := c.startWorker(ctx)
	c.mu.Lock()
	defer c.mu.Unlock()
	c.cancelStart = nil
	if err != nil {
		c.started = c.stopped // nothing runs: a later Start may try again, unless stopped
		return err
	}
	jobsCtx, stop := context.WithCancel(context.WithoutCancel(ctx))
	c.worker, c.stopJobs = w, stop
	if !c.cfg.DisableRetention {
		c.jobs.Go(func() {
			if err := c.RunRetention(jobsCtx); err != nil {
				c.log.Error("retention stopped", "err", err)
				c.mu.Lock()
				c.jobErrs = append(c.jobErrs, err)
				c.mu.Unlock()
			}
		})
	}
	go func() {
		<-w.Stopped()
		c.closeDone()
	}()
	return nil
}

func (c *Client) closeDone() { c.doneOnce.Do(func() { close(c.done) }) }

func (c *Client) startWorker(ctx context.Context) (*Worker, error) {
	// Before the privileges: of tables another schema holds, or none.
	if err := c.checkSchema(ctx, c.db, true); err != nil {
		return nil, err
	}
	if err := c.checkPrivileges(ctx); err != nil {
		return nil, err
	}
	if err := c.Setup(ctx); err != nil {
		return nil, err
	}
	w, err := c.NewWorker()
	if err != nil {
		return nil, err
	}
	if err := w.Start(ctx); err != nil {
		return nil, err
	}
	if c.bridge != nil {
		if err := c.bridge.Start(ctx); err != nil {
			return nil, errors.Join(err, w.Stop())
		}
	}
	return w, nil
}

// RunRetention runs the retention jobs until ctx is done, or until one fails
// (then it returns at once, with why): finished
// idempotency keys older than KeyTTL, finished sagas as Prune says. Start
// runs it unless DisableRetention; every job is safe to run in several
// processes at once. (Delivered messages need none: a queue row is deleted
// with the transaction that handled it.)
func (c *Client) RunRetention(ctx context.Context) error {
	keys, err := idempotency.NewReaper(idempotency.ReaperConfig{DB: c.db, TTL: c.cfg.KeyTTL, Logger: c.log})
	if err != nil {
		return err
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var (
		wg   sync.WaitGroup
		mu   sync.Mutex
		errs []error
	)
	for name, job := range map[string]func(context.Context) error{
		"idempotency keys": keys.Run,
		"finished sagas":   func(ctx context.Context) error { return c.engine.RunPrune(ctx, c.cfg.Prune) },
	} {
		wg.Go(func() {
			if err := job(ctx); err != nil && !errors.Is(err, context.Canceled) {
				mu.Lock()
				errs = append(errs, fmt.Errorf("saga: retention of %s: %w", name, err))
				mu.Unlock()
				cancel() // one failed job ends the run, so that it is known now
			}
		})
	}
	wg.Wait()
	return errors.Join(errs...)
}

// Stopped is closed once the client's worker has stopped, by Stop or
// because it failed (Health then says why), or once Stop was called on a
// client that never started.
func (c *Client) Stopped() <-chan struct{} { return c.done }

// Health is nil while the client runs: its worker runs, its retention jobs
// have not failed, the database answers and the client's role has the
// privileges its worker needs (delivery.ErrMissingPrivileges). Otherwise it says
// what is wrong.
func (c *Client) Health(ctx context.Context) error {
	c.mu.Lock()
	w, jobErrs := c.worker, append([]error(nil), c.jobErrs...)
	c.mu.Unlock()
	if w == nil {
		return errors.New("saga: the client is not running")
	}
	select {
	case <-w.Stopped():
		if err := w.Err(); err != nil {
			return fmt.Errorf("saga: the worker stopped: %w", err)
		}
		return errors.New("saga: the worker stopped")
	default:
	}
	if err := errors.Join(jobErrs...); err != nil {
		return err
	}
	if err := c.db.PingContext(ctx); err != nil {
		return fmt.Errorf("saga: the database does not answer: %w", err)
	}
	if err := c.checkPrivileges(ctx); err != nil {
		return fmt.Errorf("saga: the worker cannot deliver: %w", err)
	}
	return nil
}

// workerGrants are what a worker needs on the tables of sagas, steps and
// events, besides the transport's (transport.WorkerGrants, and TEMPORARY
// on the database). docs/operating.md, "Database roles", lists them.
var workerGrants = []transport.Grant{
	{Table: "saga_instances", Privileges: "SELECT, INSERT, UPDATE, DELETE"},
	{Table: "saga_history", Privileges: "SELECT, INSERT, DELETE"},
	{Table: "saga_requests", Privileges: "SELECT, INSERT, UPDATE, DELETE"},
	{Table: "saga_definitions", Privileges: "SELECT, INSERT, UPDATE"},
	{Table: "idempotency_keys", Privileges: "SELECT, INSERT, UPDATE, DELETE"},
	{Table: "domain_events", Privileges: "SELECT, INSERT"},
}

// checkPrivileges returns an error matching delivery.ErrMissingPrivileges, saying
// which, if the client's role lacks a privilege its worker needs.
func (c *Client) checkPrivileges(ctx context.Context) error {
	return c.transport.CheckPrivileges(ctx, append(append([]transport.Grant(nil), transport.WorkerGrants...), workerGrants...)...)
}

// Stop drains and stops the worker and the retention jobs, and returns
// what went wrong while the client ran. The attempts and awaited calls in
// flight finish, until ctx ends or the transport's CloseTimeout passes,
// whichever comes first; those still running then are cut off (rolled
// back, and delivered again later). A consumer whose connection hangs (a
// network partition) is left to the database, and Stop returns an error
// matching delivery.ErrCloseTimeout. A second Stop waits for the first,
// and returns what it returned.
func (c *Client) Stop(ctx context.Context) error {
	c.mu.Lock()
	c.stopped = true
	if c.cancelStart != nil {
		c.cancelStart() // a Start in progress gives up
	}
	c.mu.Unlock()
	c.life.Lock() // wait for it
	defer c.life.Unlock()
	c.mu.Lock()
	w, stop := c.worker, c.stopJobs
	c.mu.Unlock()
	var err error
	if w != nil {
		err = w.stop(ctx)
		if c.bridge != nil {
			// After the worker: nothing is received for a worker that
			// stopped; what it published last and the relay had no time
			// for stays queued, for the next start.
			err = errors.Join(err, c.bridge.Stop())
		}
	}
	if stop != nil {
		stop()
	}
	c.jobs.Wait()
	c.closeDone()
	c.mu.Lock()
	defer c.mu.Unlock()
	return errors.Join(append([]error{err}, c.jobErrs...)...)
}

// Migrate brings the database's schema up to date with the migrations of
// this version of pgsaga (migrations.Apply), and returns the versions it
// applied: none when it was current. Processes that start together queue
// on a lock; a database whose encoding is not UTF8 is refused. With a
// Schema, it creates the schema if missing and migrates in it.
func (c *Client) Migrate(ctx context.Context) ([]int64, error) {
	if err := c.createSchema(ctx); err != nil {
		return nil, err
	}
	if err := c.checkSchema(ctx, c.db, false); err != nil {
		return nil, err
	}
	return migrations.Apply(ctx, c.db)
}

// PgxTx is a pgx transaction as the transaction StartTx and PublishTx
// take: what they write goes in tx, and commits or rolls back with it.
func PgxTx(tx pgx.Tx) delivery.DBTX { return dbtx.FromPgx(tx) }

// StartTx starts an instance of the named saga from trigger, in the
// caller's transaction tx (a *sql.Tx, or a pgx.Tx through PgxTx), and
// returns its id: the saga starts if, and
// only if, tx commits (as River's InsertTx). trigger must be of the type
// the saga's trigger takes (On); its start function makes the instance's
// key, so a second start of the same instance is a no-op, and its error is
// returned here. The trigger is published to the saga's trigger topic, for
// a worker to start the saga; with ClientConfig.InProcessEngine the engine
// starts it in tx instead (in a savepoint: the instance, its timeline and
// its first command), saving that hop, and publishes the trigger only if
// it cannot. The saga's correlation id is its key.
func (c *Client) StartTx(ctx context.Context, tx delivery.DBTX, name string, trigger steps.Message) (uuid.UUID, error) {
	if err := ctx.Err(); err != nil {
		return uuid.Nil, fmt.Errorf("saga: starting %s: %w", name, context.Cause(ctx))
	}
	if err := checkTx(tx); err != nil {
		return uuid.Nil, fmt.Errorf("saga: starting %s: %w", name, err)
	}
	if err := c.checkSchema(ctx, tx, false); err != nil {
		return uuid.Nil, fmt.Errorf("saga: starting %s: %w", name, err)
	}
	msg, def, id, err := c.triggerMessage(name, trigger)
	if err != nil {
		return uuid.Nil, err
	}
	if c.cfg.InProcessEngine {
		// The start is told (metrics, its log line) once it is written in
		// full: a start that cannot be is rolled back here, queued, and
		// told by the worker that starts it. In a delivery attempt it is
		// told when the attempt commits (transport.OnCommit); a caller's
		// own commit is out of sight, so it is told when written.
		err := transport.Savepoint(ctx, tx, func(tx delivery.DBTX) error {
			m := msg.Copy()
			m.SetContext(transport.ContextWithTx(ctx, tx))
			return c.engine.handleTrigger(name, m)
		})
		if err == nil {
			return id, nil
		}
		c.log.Debug("saga: starting in the caller's transaction failed; the trigger is queued", "saga", name, "message_uuid", msg.UUID, "reason", err)
	}
	msg.SetContext(ctx) // its publish joins the caller's trace, if any
	if err := c.transport.Publisher(tx).Publish(def.Trigger, msg); err != nil {
		return uuid.Nil, fmt.Errorf("saga: starting %s: publishing to %s: %w", name, def.Trigger, err)
	}
	return id, nil
}

// triggerMessage is the message that starts saga name from trigger, the
// saga's definition and the instance's id: the same message for every
// start of one instance (its id is derived from the instance's, its
// correlation id is the key).
func (c *Client) triggerMessage(name string, trigger steps.Message) (*message.Message, *Definition, uuid.UUID, error) {
	c.engine.mu.RLock()
	def := c.engine.latest[name]
	c.engine.mu.RUnlock()
	if def == nil {
		return nil, nil, uuid.Nil, fmt.Errorf("%w: %s", ErrUnknownDefinition, name)
	}
	if isNil(trigger) || trigger.MessageType() != def.triggerType {
		got := "nil"
		if !isNil(trigger) {
			got = trigger.MessageType()
		}
		return nil, nil, uuid.Nil, fmt.Errorf("%w: %s takes %s, not %s", ErrTriggerType, name, def.triggerType, got)
	}
	// The key of the trigger as given, before encoding: invalid UTF-8 is
	// replaced on the way through JSON, and two keys that differ only
	// there would start one saga.
	given, err := def.keyOf(trigger)
	if err == nil {
		err = checkKey(given)
	}
	if err != nil {
		return nil, nil, uuid.Nil, fmt.Errorf("saga: starting %s: %w", name, err)
	}
	msg, err := steps.NewMessage(trigger, steps.Envelope{})
	if err != nil {
		return nil, nil, uuid.Nil, fmt.Errorf("saga: starting %s: %w", name, err)
	}
	key, _, err := def.start(msg)
	if err == nil && key != given {
		err = fmt.Errorf("%w: the trigger's key does not survive its encoding as JSON (%d bytes before, %d after)", ErrInvalidName, len(given), len(key))
	}
	if err != nil {
		return nil, nil, uuid.Nil, fmt.Errorf("saga: starting %s: %w", name, err)
	}
	id := ID(name, key)
	msg.UUID = uuid.NewSHA1(id, []byte("trigger")).String()
	msg.Metadata.Set(steps.MetaCorrelationID, key)
	// For this saga alone: another saga on the same trigger topic leaves
	// it (see handleTrigger).
	msg.Metadata.Set(metadata.Saga, name)
	return msg, def, id, nil
}

// PublishTx publishes msgs to topic in the caller's transaction tx (a
// *sql.Tx, or a pgx.Tx through PgxTx): they are delivered if, and only if,
// tx commits. Given a *sql.DB or *sql.Conn, the messages are written in one
// statement that commits on its own: all of them or none.
func (c *Client) PublishTx(ctx context.Context, tx delivery.DBTX, topic string, msgs ...*message.Message) error {
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("saga: publishing to %s: %w", topic, context.Cause(ctx))
	}
	if isNil(tx) {
		return fmt.Errorf("saga: publishing to %s: %w", topic, ErrNotATransaction)
	}
	for i, m := range msgs {
		if m == nil {
			return fmt.Errorf("saga: publishing to %s: %w (message %d of %d)", topic, ErrNilMessage, i+1, len(msgs))
		}
	}
	if err := c.checkSchema(ctx, tx, false); err != nil {
		return fmt.Errorf("saga: publishing to %s: %w", topic, err)
	}
	if err := c.transport.Publisher(tx).Publish(topic, msgs...); err != nil {
		return fmt.Errorf("saga: publishing to %s: %w", topic, err)
	}
	return nil
}

// checkTx refuses what is not a transaction (see ErrNotATransaction).
func checkTx(tx delivery.DBTX) error {
	switch tx.(type) {
	case *sql.DB, *sql.Conn:
		return fmt.Errorf("%w, not a %T", ErrNotATransaction, tx)
	}
	if isNil(tx) {
		return ErrNotATransaction
	}
	return nil
}

// isNil reports whether v is nil, or an interface holding a nil pointer
// (whose value methods would panic).
func isNil(v any) bool {
	if v == nil {
		return true
	}
	r := reflect.ValueOf(v)
	return r.Kind() == reflect.Pointer && r.IsNil()
}
