// Package transport delivers pgsaga's messages through PostgreSQL with
// Watermill's Router and watermill-sql (v3)'s Publisher and Subscriber, so
// that a handler's transaction cannot lie: what a handler writes, the
// messages it publishes and the removal of the message it handled commit
// together or not at all.
//
// Delivery is by queue, not by offset log. A publish fans a message out to
// every consumer group subscribed to its topic: one row per group in
// pgsaga_queue, inserted in the publisher's transaction (the outbox). A
// consumer claims a batch of its group's rows with FOR UPDATE SKIP LOCKED in
// one READ COMMITTED transaction and runs each message's attempt in a
// savepoint of it; a handled message's row is deleted in that transaction.
// So:
//
//   - a message can be delivered the moment its publisher commits, whatever
//     else runs on the server: no transaction elsewhere, in this database or
//     another, holds it back;
//   - consumers of one group, in one process or many, never wait for one
//     another: each claims what the others do not hold;
//   - a failed attempt is rolled back and its message released with its
//     attempt count and a time before which it is not claimed again (the
//     backoff): no transaction is held while it waits, and nothing else
//     waits behind it; after RetryPolicy.MaxAttempts, or at once for a
//     permanent failure or a message that cannot be read, it goes to
//     pgsaga_dead_letters with the reason;
//   - a delivery transaction lasts at most Config.MaxTransactionDuration:
//     an attempt that outlives Config.AttemptTimeout is cut off and rolled
//     back, and a batch stops starting attempts after Config.BatchTimeout,
//     releasing the rest;
//   - no attempt commits in part: a commit guard refuses to commit a
//     delivery transaction while an attempt is open, whoever asks (a
//     handler's COMMIT, a subscriber giving up on a slow handler);
//   - the transport's own writes at the end of an attempt (published
//     messages, key completions, timelines, the message's removal) are
//     queued by the code that makes them and sent in one pipelined round
//     trip on the attempt's connection (see Queue); handler SQL is never
//     parsed.
//
// Idle consumers wait for a notification that their topic got messages
// (sent only if the publisher commits), for the next retry of a failed
// message, or for Config.IdlePollInterval, whichever comes first.
package transport

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"sync"

	pub "github.com/pgsaga/pgsaga/saga/delivery"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/jackc/pgerrcode"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/stdlib"

	"github.com/pgsaga/pgsaga/internal/pgerr"
	"github.com/pgsaga/pgsaga/internal/pgserver"
	"github.com/pgsaga/pgsaga/internal/telemetry"
)

// Transport creates routers, subscribers and transaction-bound publishers
// over one database.
type Transport struct {
	cfg     Config
	db      *sql.DB
	log     *slog.Logger
	wlog    watermill.LoggerAdapter
	schema  schemaAdapter // for publishing
	hub     *wakeHub      // nil when wake-ups are off
	trace   *telemetry.Tracing
	metrics *telemetry.Metrics // nil: nothing counted

	// Timeouts of delivery transactions, in milliseconds, as set_config
	// takes them.
	statementTimeout, lockTimeout, idleTimeout string

	checkMu sync.Mutex
	checked bool // the server passed checkServer

	late lateLog // batches whose first delivery came too late

	calls awaitedCalls // awaited calls running in this process (MaxAwaitedCalls)

	pollFailures pollFailures // its consumers' failed polls, told together
}

// New validates cfg and returns a Transport. It does not connect.
func New(cfg Config) (*Transport, error) {
	setDefaults(&cfg)
	if err := validate(&cfg); err != nil {
		return nil, err
	}
	t := &Transport{
		cfg: cfg,
		db:  cfg.DB,
		log: cfg.Logger,
		wlog: watermill.NewSlogLoggerWithLevelMapping(cfg.Logger, map[slog.Level]slog.Level{
			slog.LevelInfo: slog.LevelDebug,
		}),
		trace:            telemetry.NewTracing(cfg.TracerProvider),
		statementTimeout: ms(cfg.StatementTimeout),
		lockTimeout:      ms(cfg.LockTimeout),
		idleTimeout:      strconv.FormatInt(cfg.MaxTransactionDuration().Milliseconds(), 10),
	}
	if cfg.Metrics != nil {
		m, err := telemetry.NewMetrics(cfg.Metrics)
		if err != nil {
			return nil, fmt.Errorf("transport: %w", err)
		}
		t.metrics = m
	}
	// Publishes always notify: a process that does not listen must still
	// wake those that do.
	t.schema.notifyChannel = cfg.NotifyChannel
	if !cfg.DisableNotify {
		t.hub = newWakeHub(t)
	}
	return t, nil
}

func ms(d interface{ Milliseconds() int64 }) string { return strconv.FormatInt(d.Milliseconds(), 10) }

// Tracing makes the transport's spans; the packages built on it make
// theirs with it too.
func (t *Transport) Tracing() *telemetry.Tracing { return t.trace }

// Metrics counts what this process does: nil (which counts nothing) unless
// Config.Metrics is set.
func (t *Transport) Metrics() *telemetry.Metrics { return t.metrics }

// Config returns the configuration with defaults filled in.
func (t *Transport) Config() Config { return t.cfg }

// DB returns the database handle the transport uses.
func (t *Transport) DB() *sql.DB { return t.db }

// Subscription is a consumer group of a topic.
type Subscription = pub.Subscription

// Subscribe records subscriptions: from now on every message published to
// each topic is queued for the group, whether or not a consumer of it runs
// yet. Routers record their own when they start; call Subscribe at set-up so
// that nothing published before the first worker starts goes unrouted (a
// message no group subscribes to is kept only as a dead letter). It is
// idempotent and safe from several processes at once.
func (t *Transport) Subscribe(ctx context.Context, subs ...Subscription) error {
	if err := t.checkServer(ctx); err != nil {
		return err
	}
	for _, s := range subs {
		if err := ValidateTopic(s.Topic); err != nil {
			return err
		}
		if err := ValidateConsumerGroup(s.ConsumerGroup); err != nil {
			return err
		}
		if _, err := t.db.ExecContext(ctx, subscribeSQL, s.Topic, s.ConsumerGroup); err != nil {
			return fmt.Errorf("transport: subscribing %s to %s: %w", s.ConsumerGroup, s.Topic, migrationHint(err))
		}
	}
	return nil
}

// DropConsumerGroup forgets consumerGroup of topic: messages published to
// topic are no longer queued for it, and those queued are deleted. It
// returns how many were. Use it for a group that no longer runs anywhere;
// a Router that runs the group again subscribes it again.
func (t *Transport) DropConsumerGroup(ctx context.Context, topic, consumerGroup string) (int64, error) {
	if err := ValidateTopic(topic); err != nil {
		return 0, err
	}
	if err := ValidateConsumerGroup(consumerGroup); err != nil {
		return 0, err
	}
	res, err := t.db.ExecContext(ctx, dropGroupSQL, topic, consumerGroup)
	if err != nil {
		return 0, fmt.Errorf("transport: dropping consumer group %s of %s: %w", consumerGroup, topic, err)
	}
	n, _ := res.RowsAffected()
	return n, nil
}

// checkServer refuses a database pgsaga cannot work on (see ErrNotUTF8),
// and a configuration the processes already running on it do not share
// (see ErrSettingsDiffer), once per Transport.
func (t *Transport) checkServer(ctx context.Context) error {
	t.checkMu.Lock()
	defer t.checkMu.Unlock()
	if t.checked {
		return nil
	}
	if err := pgserver.RequireUTF8(ctx, t.db); err != nil {
		return fmt.Errorf("transport: %w", err)
	}
	channel, err := t.agree(ctx, "notify_channel", t.cfg.NotifyChannel)
	if err != nil {
		return err
	}
	if channel != t.cfg.NotifyChannel {
		return fmt.Errorf("%w: the processes on this database wake each other on the channel %q, and this one is configured with %q (NotifyChannel); "+
			"they would never wake each other: configure %q, or stop every process and update pgsaga_settings",
			ErrSettingsDiffer, channel, t.cfg.NotifyChannel, channel)
	}
	t.checked = true
	return nil
}

// execWaiting runs query in a transaction of its own whose lock waits are
// bounded by Config.LockTimeout, and reports whether it changed a row. The
// bounds and the query go in one pipeline, which the server runs as one
// implicit transaction: one round trip, no BEGIN nor COMMIT.
func (t *Transport) execWaiting(query string, args ...any) (bool, error) {
	ctx, cancel := context.WithTimeout(context.Background(), t.cfg.LockTimeout+t.cfg.StatementTimeout)
	defer cancel()
	c, err := t.acquire(ctx)
	if err != nil {
		return false, err
	}
	defer c.release()
	b := &pgx.Batch{}
	b.Queue(boundWaitSQL, t.lockTimeout, t.statementTimeout)
	b.Queue(query, args...)
	br := c.pg.SendBatch(ctx, b)
	_, err = br.Exec()
	var tag pgconn.CommandTag
	if err == nil {
		tag, err = br.Exec()
	}
	if cerr := br.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return false, err
	}
	return tag.RowsAffected() > 0, nil
}

// agree records value as the shared setting name, unless one is recorded,
// and returns the recorded value. A process that starts at the same time
// may record it first: agreeSQL then waits for its commit and returns no
// row (its snapshot predates that commit), and the next run reads it.
func (t *Transport) agree(ctx context.Context, name, value string) (string, error) {
	for range 3 {
		var recorded string
		err := t.db.QueryRowContext(ctx, agreeSQL, name, value).Scan(&recorded)
		if errors.Is(err, sql.ErrNoRows) {
			continue
		}
		if err != nil {
			return "", fmt.Errorf("transport: reading the shared settings: %w", migrationHint(err))
		}
		return recorded, nil
	}
	return "", fmt.Errorf("transport: reading the shared setting %s: it was recorded and then removed while this process started", name)
}

func migrationHint(err error) error {
	if pgerr.UndefinedTable(err) || pgerr.Is(err, pgerrcode.UndefinedFunction) {
		return fmt.Errorf("%w (apply the migrations first: migrations.Apply)", err)
	}
	return err
}

// conn is one pooled connection the transport runs a transaction on: the
// database/sql connection its statements and watermill-sql use, and the
// same connection's pgx handle for the transport's pipelined writes.
type conn struct {
	sql *sql.Conn
	pg  *pgx.Conn
}

const guardInstalled = "pgsaga.commit_guard"

// acquire takes a connection from the pool, with the commit guard
// installed on it.
func (t *Transport) acquire(ctx context.Context) (*conn, error) {
	sc, err := t.db.Conn(ctx)
	if err != nil {
		return nil, fmt.Errorf("transport: acquiring a connection: %w", err)
	}
	c := &conn{sql: sc}
	if err := sc.Raw(func(dc any) error {
		pc, ok := dc.(*stdlib.Conn)
		if !ok {
			return fmt.Errorf("%w, not %T", ErrNotPgx, dc)
		}
		c.pg = pc.Conn()
		return nil
	}); err != nil {
		_ = sc.Close()
		return nil, err
	}
	data := c.pg.PgConn().CustomData()
	if data[guardInstalled] == nil {
		if _, err := c.pg.Exec(ctx, installGuardSQL); err != nil {
			_ = sc.Close()
			return nil, fmt.Errorf("transport: installing the commit guard: %w", migrationHint(err))
		}
		data[guardInstalled] = true
	}
	return c, nil
}

// release returns the connection to the pool.
func (c *conn) release() {
	_ = c.sql.Close()
}
