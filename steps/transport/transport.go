// Package transport wires Watermill and watermill-sql (v3) over PostgreSQL so
// that a handler's transaction cannot lie: what a handler writes, the messages
// it publishes and the consumer's offset commit together or not at all.
//
// watermill-sql reads a batch of messages in one REPEATABLE READ transaction
// and hands each handler that transaction. Used naively it has sharp edges,
// each verified against a real server (DESIGN §6) and each covered here:
//
//   - A nack does not roll anything back: the message is redelivered in the
//     same transaction and the failed attempt's writes stay. The Router wraps
//     every delivery attempt in a savepoint, innermost, panic-safe, and rolls
//     it back on failure.
//   - A failed statement aborts the transaction, which would stall the lane
//     until the ack deadline. The savepoint rollback revives it.
//   - When the ack deadline passes or the router closes while a handler runs,
//     the subscriber commits whatever the handler wrote so far. Statements run
//     on a context the message cannot cancel and are bounded by SET LOCAL
//     statement_timeout; the ack deadline defaults far above any step; and
//     Router.Close drains in-flight handlers before the subscribers stop.
//   - The payload column is JSON by default. Topic tables here use BYTEA, so
//     any payload round-trips byte for byte.
//   - Publishing inside a transaction cannot create topic tables: create them
//     up front with CreateTopics.
//   - A transaction that can no longer commit (a lost connection, a savepoint
//     that cannot be rolled back) is abandoned: the batch fails to store its
//     offset, rolls back whole, and is redelivered, in seconds rather than at
//     the ack deadline.
//
// One consumer group on one topic is one serial lane however many processes
// subscribe to it; Lanes spreads a logical topic over several.
package transport

import (
	"bytes"
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v3/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgconn"
)

// Config configures a Transport. Zero values take the documented defaults.
type Config struct {
	// DB is the database/sql handle over the process's pgx pool
	// (stdlib.OpenDBFromPool). Required.
	DB *sql.DB

	// Logger receives the transport's and Watermill's logs. Watermill's info
	// logs are lowered to debug. Default: slog.Default().
	Logger *slog.Logger

	// BatchSize is how many messages a subscriber reads per transaction.
	// Larger batches commit less often but redeliver more after a crash and
	// hold their transaction open longer. Keep it below 64: every message's
	// savepoint that writes leaves a subtransaction id in the batch
	// transaction, and PostgreSQL caches only 64 per backend before every
	// snapshot in the cluster gets slower (PGPROC_MAX_CACHED_SUBXIDS).
	// Default: 50.
	BatchSize int

	// DisableNotify turns wake-ups off: subscribers then poll every
	// PollInterval. By default every publish sends a notification in its
	// transaction (delivered only if it commits) and idle subscribers wait
	// for one on their lane instead of polling; the process holds one
	// LISTEN connection of the pool for all its subscribers while any runs.
	DisableNotify bool

	// NotifyChannel is the notification channel of wake-ups. Default:
	// DefaultNotifyChannel.
	NotifyChannel string

	// PollInterval is how long an idle subscriber waits before polling
	// again when wake-ups are off or the listening connection is down.
	// Default: 1s.
	PollInterval time.Duration

	// IdlePollInterval is how long an idle subscriber waits for a wake-up
	// before polling anyway: a safety net, not the normal path. Default: 10s.
	IdlePollInterval time.Duration

	// RetryInterval is the first wait after a failed poll (a lost
	// connection, an abandoned batch); it doubles up to MaxRetryInterval.
	// Default: 100ms.
	RetryInterval time.Duration

	// MaxRetryInterval caps RetryInterval's growth. Default: 5s.
	MaxRetryInterval time.Duration

	// Lanes spreads every topic over this many lanes. A consumer group on
	// one watermill-sql topic is a single serial lane; a topic with n lanes
	// is stored as n topics, "<topic>.0" … "<topic>.<n-1>", each with its
	// own offsets, and a Router handler reads all of them in parallel.
	// Messages with the same lane key (LaneKey) always go to the same lane,
	// in order. Dead-letter topics (DefaultDeadLetterTopic and
	// Retry.DeadLetterTopic) keep one lane unless TopicLanes says otherwise.
	// CreateTopics records each topic's count and refuses to change it while
	// the old lanes hold unconsumed messages. Default: 1.
	Lanes int

	// TopicLanes overrides Lanes for the topics it names.
	TopicLanes map[string]int

	// LaneKey returns the key that picks msg's lane on topic. Default: the
	// metadata MetaPartitionKey, else "saga_id", else the message UUID: all
	// messages of one saga stay in one lane.
	LaneKey func(topic string, msg *message.Message) string

	// ResendInterval is how long a subscriber waits before redelivering a
	// nacked message (in the same transaction). Default: 100ms.
	ResendInterval time.Duration

	// StatementTimeout bounds every statement of a delivery attempt (SET
	// LOCAL statement_timeout). Default: 10s.
	StatementTimeout time.Duration

	// LockTimeout bounds every lock wait of an attempt (SET LOCAL
	// lock_timeout); a wait that outlasts it fails the attempt, which is
	// retried. Default: 5s.
	LockTimeout time.Duration

	// AckDeadline is how long one message may take, all its attempts and
	// retries included. When it passes, watermill-sql commits the batch
	// without the message, including whatever a still-running handler wrote,
	// so it must sit far above the slowest step. Must be at least three
	// times StatementTimeout. Default: 5m.
	AckDeadline time.Duration

	// Retry is the retry policy of every handler that does not set its own
	// (WithRetry). Default: see RetryPolicy.
	Retry RetryPolicy

	// Intercept wraps every handler of the transport's routers and of
	// HandleInTx, inside each attempt (after its savepoint opens, before its
	// offset is stored): what the wrapper writes or fails is part of the
	// attempt. Test kits use it to inject faults at commit boundaries. It
	// receives the handler's name. Default: none.
	Intercept func(handler string, h HandlerFunc) HandlerFunc

	// CloseTimeout bounds how long Router.Close waits for in-flight handlers.
	// Handlers still running then are cut off: their attempt's transaction is
	// made to fail so nothing partial commits. Default: 30s.
	CloseTimeout time.Duration
}

func (c *Config) setDefaults() {
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	if c.BatchSize == 0 {
		c.BatchSize = 50
	}
	if c.NotifyChannel == "" {
		c.NotifyChannel = DefaultNotifyChannel
	}
	if c.PollInterval == 0 {
		c.PollInterval = time.Second
	}
	if c.IdlePollInterval == 0 {
		c.IdlePollInterval = 10 * time.Second
	}
	if c.Lanes == 0 {
		c.Lanes = 1
	}
	if c.LaneKey == nil {
		c.LaneKey = defaultLaneKey
	}
	if c.RetryInterval == 0 {
		c.RetryInterval = 100 * time.Millisecond
	}
	if c.MaxRetryInterval == 0 {
		c.MaxRetryInterval = 5 * time.Second
	}
	if c.ResendInterval == 0 {
		c.ResendInterval = 100 * time.Millisecond
	}
	if c.StatementTimeout == 0 {
		c.StatementTimeout = 10 * time.Second
	}
	if c.LockTimeout == 0 {
		c.LockTimeout = 5 * time.Second
	}
	if c.AckDeadline == 0 {
		c.AckDeadline = 5 * time.Minute
	}
	if c.CloseTimeout == 0 {
		c.CloseTimeout = 30 * time.Second
	}
	c.Retry.setDefaults()
}

func (c *Config) validate() error {
	var errs []error
	if c.DB == nil {
		errs = append(errs, errors.New("DB is required"))
	}
	if c.BatchSize < 1 {
		errs = append(errs, fmt.Errorf("BatchSize must be positive, got %d", c.BatchSize))
	}
	if c.Lanes < 1 || c.Lanes > MaxLanes {
		errs = append(errs, fmt.Errorf("Lanes must be between 1 and %d, got %d", MaxLanes, c.Lanes))
	}
	for topic, n := range c.TopicLanes {
		if n < 1 || n > MaxLanes {
			errs = append(errs, fmt.Errorf("TopicLanes[%q] must be between 1 and %d, got %d", topic, MaxLanes, n))
		}
	}
	if c.NotifyChannel != "" && (len(c.NotifyChannel) > 63 || !topicPattern.MatchString(c.NotifyChannel)) {
		errs = append(errs, fmt.Errorf("NotifyChannel must be 1 to 63 characters from [A-Za-z0-9-$:._], got %q", c.NotifyChannel))
	}
	for name, d := range map[string]time.Duration{
		"PollInterval": c.PollInterval, "IdlePollInterval": c.IdlePollInterval, "RetryInterval": c.RetryInterval,
		"MaxRetryInterval": c.MaxRetryInterval, "ResendInterval": c.ResendInterval,
		"StatementTimeout": c.StatementTimeout, "AckDeadline": c.AckDeadline, "LockTimeout": c.LockTimeout,
		"CloseTimeout": c.CloseTimeout,
	} {
		if d < 0 {
			errs = append(errs, fmt.Errorf("%s must not be negative, got %s", name, d))
		}
	}
	if c.StatementTimeout > 0 && c.StatementTimeout < time.Millisecond {
		errs = append(errs, fmt.Errorf("StatementTimeout must be at least 1ms, got %s", c.StatementTimeout))
	}
	if c.LockTimeout > 0 && c.LockTimeout < time.Millisecond {
		errs = append(errs, fmt.Errorf("LockTimeout must be at least 1ms, got %s", c.LockTimeout))
	}
	if c.AckDeadline < 3*c.StatementTimeout {
		errs = append(errs, fmt.Errorf("AckDeadline (%s) must be at least three times StatementTimeout (%s): the subscriber commits a batch whose handler outlives it", c.AckDeadline, c.StatementTimeout))
	}
	if c.AckDeadline > 0 {
		retry := c.Retry
		if err := retry.validate(c.AckDeadline); err != nil {
			errs = append(errs, err)
		}
	}
	if c.MaxRetryInterval < c.RetryInterval {
		errs = append(errs, fmt.Errorf("MaxRetryInterval (%s) must not be below RetryInterval (%s)", c.MaxRetryInterval, c.RetryInterval))
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("transport: invalid config: %w", err)
	}
	return nil
}

// Transport creates routers, subscribers and transaction-bound publishers
// that share one database and one schema.
type Transport struct {
	cfg     Config
	db      *sql.DB
	log     *slog.Logger
	wlog    watermill.LoggerAdapter
	schema  schemaAdapter // for publishing and naming tables
	offsets offsetsAdapter
	hub     *wakeHub // nil when wake-ups are off

	beginBatch string // SET LOCAL timeouts + SAVEPOINT, prebuilt
	beginOwn   string // SET LOCAL timeouts, prebuilt
}

// New validates cfg and returns a Transport.
func New(cfg Config) (*Transport, error) {
	cfg.setDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	wlog := watermill.NewSlogLoggerWithLevelMapping(cfg.Logger, map[slog.Level]slog.Level{
		slog.LevelInfo: slog.LevelDebug,
	})
	t := &Transport{
		cfg:  cfg,
		db:   cfg.DB,
		log:  cfg.Logger,
		wlog: wlog,
		schema: schemaAdapter{DefaultPostgreSQLSchema: wsql.DefaultPostgreSQLSchema{
			GeneratePayloadType: func(string) string { return "BYTEA" },
			SubscribeBatchSize:  cfg.BatchSize,
		}},
		beginBatch: fmt.Sprintf(beginBatchSQL, ms(cfg.StatementTimeout), ms(cfg.LockTimeout)),
		beginOwn:   fmt.Sprintf(beginOwnSQL, ms(cfg.StatementTimeout), ms(cfg.LockTimeout)),
	}
	if !cfg.DisableNotify {
		t.schema.notifyChannel = cfg.NotifyChannel
		t.hub = newWakeHub(t)
	}
	return t, nil
}

func ms(d time.Duration) string { return strconv.FormatInt(d.Milliseconds(), 10) }

// Config returns the configuration with defaults filled in.
func (t *Transport) Config() Config { return t.cfg }

// DB returns the database handle the transport uses.
func (t *Transport) DB() *sql.DB { return t.db }

// Errors callers can branch on.
var (
	// ErrInvalidTopic is returned for a topic name watermill-sql cannot
	// store: characters outside [A-Za-z0-9-$:._], or longer than MaxTopicLen.
	ErrInvalidTopic = errors.New("transport: invalid topic name")
	// ErrInvalidMessageID is returned for a message whose UUID is empty or
	// longer than the 36 characters watermill-sql's uuid column holds.
	ErrInvalidMessageID = errors.New("transport: message UUID must be 1 to 36 characters")
	// ErrUnknownTopic is returned when a topic's table does not exist; create
	// it with CreateTopics before publishing or subscribing.
	ErrUnknownTopic = errors.New("transport: topic table does not exist (create it with CreateTopics)")
)

// MaxTopicLen keeps "watermill_offsets_<topic>" within PostgreSQL's 63-byte
// identifiers; longer names would be truncated and could collide.
const MaxTopicLen = 63 - len("watermill_offsets_")

var topicPattern = regexp.MustCompile(`^[A-Za-z0-9\-$:._]+$`)

// ValidateTopic reports whether topic can name a watermill-sql table.
func ValidateTopic(topic string) error {
	if topic == "" || len(topic) > MaxTopicLen || !topicPattern.MatchString(topic) {
		return fmt.Errorf("%w: %q (1 to %d characters from [A-Za-z0-9-$:._])", ErrInvalidTopic, topic, MaxTopicLen)
	}
	return nil
}

// CreateTopics creates the message and offset tables of topics, of every
// lane of each, if they do not exist, and records each topic's lane count.
// It is idempotent and safe to run from several processes at once
// (concurrent CREATE TABLE IF NOT EXISTS can otherwise fail on PostgreSQL's
// catalog), and must run before anything publishes to a topic inside a
// transaction. A topic whose lane count changed is refused with
// ErrLanesChanged while its old lanes hold unconsumed messages.
func (t *Transport) CreateTopics(ctx context.Context, topics ...string) error {
	for _, topic := range topics {
		if err := t.validateLanes(topic); err != nil {
			return err
		}
	}
	tx, err := t.db.BeginTx(ctx, nil)
	if err != nil {
		return fmt.Errorf("transport: creating topics: %w", err)
	}
	defer tx.Rollback() //nolint:errcheck // a no-op after Commit
	if _, err := tx.ExecContext(ctx, lockTopicsSQL, topicsLockID); err != nil {
		return fmt.Errorf("transport: creating topics: %w", err)
	}
	for _, topic := range topics {
		if err := t.recordLanes(ctx, tx, topic); err != nil {
			return err
		}
		for _, lane := range t.LaneTopics(topic) {
			queries := append(t.schema.SchemaInitializingQueries(lane), t.offsets.SchemaInitializingQueries(lane)...)
			for _, q := range queries {
				if _, err := tx.ExecContext(ctx, q.Query, q.Args...); err != nil {
					return fmt.Errorf("transport: creating topic %s: %w", lane, err)
				}
			}
		}
	}
	if err := tx.Commit(); err != nil {
		return fmt.Errorf("transport: creating topics: %w", err)
	}
	return nil
}

// ErrLanesChanged is returned by CreateTopics for a topic whose lane count
// differs from the one recorded while its old lanes still hold messages not
// every consumer group has consumed: they would be stranded, and keys would
// change lanes under running sagas. Drain the topic with the old count
// first.
var ErrLanesChanged = errors.New("transport: lane count changed while the old lanes hold unconsumed messages")

// recordLanes records topic's lane count, refusing a change while the old
// lanes hold unconsumed messages.
func (t *Transport) recordLanes(ctx context.Context, tx *sql.Tx, topic string) error {
	n := t.LanesOf(topic)
	var old int
	err := tx.QueryRowContext(ctx, lanesOfTopicSQL, topic).Scan(&old)
	switch {
	case errors.Is(err, sql.ErrNoRows):
		if _, err := tx.ExecContext(ctx, recordLanesSQL, topic, n); err != nil {
			return fmt.Errorf("transport: recording the lanes of %s: %w", topic, lanesTableHint(err))
		}
		return nil
	case err != nil:
		return fmt.Errorf("transport: reading the lanes of %s: %w", topic, lanesTableHint(err))
	case old == n:
		return nil
	}
	pending := 0
	for _, lane := range laneNames(topic, old) {
		var exists bool
		if err := tx.QueryRowContext(ctx, tableExistsSQL, t.MessagesTable(lane)).Scan(&exists); err != nil {
			return fmt.Errorf("transport: checking the lanes of %s: %w", topic, err)
		}
		if !exists {
			continue
		}
		var c int
		q := fmt.Sprintf(unconsumedSQL, t.MessagesTable(lane), t.OffsetsTable(lane))
		if err := tx.QueryRowContext(ctx, q).Scan(&c); err != nil {
			return fmt.Errorf("transport: checking the lanes of %s: %w", topic, err)
		}
		pending += c
	}
	if pending > 0 {
		return fmt.Errorf("%w: topic %s has %d lanes (configured: %d) holding %d unconsumed messages; run with %d lanes until they are consumed",
			ErrLanesChanged, topic, old, n, pending, old)
	}
	t.log.Info("changing a drained topic's lane count", "topic", topic, "from", old, "to", n)
	if _, err := tx.ExecContext(ctx, recordLanesSQL, topic, n); err != nil {
		return fmt.Errorf("transport: recording the lanes of %s: %w", topic, err)
	}
	return nil
}

func lanesTableHint(err error) error {
	if isUndefinedTable(err) {
		return fmt.Errorf("%w (apply the migrations first: migrations.Apply)", err)
	}
	return err
}

// MessagesTable returns the quoted name of a physical topic's message
// table. For a topic spread over several lanes, see LaneTopics and
// MessagesFrom.
func (t *Transport) MessagesTable(topic string) string { return t.schema.MessagesTable(topic) }

// OffsetsTable returns the quoted name of a physical topic's consumer
// offsets table.
func (t *Transport) OffsetsTable(topic string) string { return t.offsets.MessagesOffsetsTable(topic) }

// MessagesFrom returns a FROM item, aliased alias, holding the messages of
// every lane of topic (the columns of watermill-sql's message table), for
// inspection and tests. alias must be a plain identifier.
func (t *Transport) MessagesFrom(topic, alias string) string {
	lanes := t.LaneTopics(topic)
	if len(lanes) == 1 {
		return t.MessagesTable(lanes[0]) + " " + alias
	}
	parts := make([]string, len(lanes))
	for i, l := range lanes {
		parts[i] = "SELECT * FROM " + t.MessagesTable(l)
	}
	return "(" + strings.Join(parts, " UNION ALL ") + ") " + alias
}

// Subscriber returns a subscriber for consumerGroup. Every subscriber of one
// group on one topic shares one serial lane, wherever it runs. It reads
// physical topics: for a topic spread over lanes, subscribe to each of
// LaneTopics, or use a Router, which does.
func (t *Transport) Subscriber(consumerGroup string) (message.Subscriber, error) {
	if err := ValidateConsumerGroup(consumerGroup); err != nil {
		return nil, err
	}
	return &subscriber{t: t, group: consumerGroup}, nil
}

// subscription is one watermill-sql subscriber reading one physical topic,
// with the backoff manager (and wake-ups) of that topic.
type subscription struct {
	inner *wsql.Subscriber
	poll  *pollState
}

func (t *Transport) subscribe(topic, consumerGroup string) (*subscription, error) {
	poll := newPollState(t.cfg, t.hub, topic)
	schema := t.schema
	schema.poll, schema.offsets = poll, t.offsets
	ack := t.cfg.AckDeadline
	sub, err := wsql.NewSubscriber(t.db, wsql.SubscriberConfig{
		ConsumerGroup:  consumerGroup,
		AckDeadline:    &ack,
		PollInterval:   t.cfg.PollInterval,
		ResendInterval: t.cfg.ResendInterval,
		RetryInterval:  t.cfg.RetryInterval,
		BackoffManager: poll,
		SchemaAdapter:  schema,
		OffsetsAdapter: t.offsets,
	}, t.wlog)
	if err != nil {
		poll.close()
		return nil, fmt.Errorf("transport: creating subscriber for %s on %s: %w", consumerGroup, topic, err)
	}
	return &subscription{inner: sub, poll: poll}, nil
}

func (s *subscription) close() {
	// First end the backoff's wait: the subscriber waits for its polling
	// goroutine, which may be in it.
	s.poll.close()
	_ = s.inner.Close()
}

// subscriber adapts watermill-sql subscribers to the Router's shutdown.
//
// watermill-sql begins each batch transaction with the subscription context,
// and database/sql rolls a transaction back the moment that context is
// cancelled, which Watermill's router does on close. That rollback races the
// subscriber's own commit of the acked prefix of the batch, so work that was
// finished and acked could be thrown away on every restart. The subscription
// therefore runs on a context that is never cancelled, and the subscriber is
// stopped through Close instead, after which it commits what was acked. It
// also turns "relation does not exist" into ErrUnknownTopic.
type subscriber struct {
	t     *Transport
	group string

	mu     sync.Mutex
	subs   []*subscription
	closed bool
}

func (s *subscriber) Subscribe(ctx context.Context, topic string) (<-chan *message.Message, error) {
	if err := ValidateTopic(topic); err != nil {
		return nil, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return nil, errors.New("transport: subscriber is closed")
	}
	sub, err := s.t.subscribe(topic, s.group)
	if err != nil {
		return nil, err
	}
	ch, err := sub.inner.Subscribe(context.WithoutCancel(ctx), topic)
	if err != nil {
		sub.close()
		if isUndefinedTable(err) {
			if n := s.t.LanesOf(topic); n > 1 {
				return nil, fmt.Errorf("%w: %s is spread over %d lanes: subscribe to each of LaneTopics(%q), or use a Router", ErrUnknownTopic, topic, n, topic)
			}
			return nil, fmt.Errorf("%w: %s: %w", ErrUnknownTopic, topic, err)
		}
		return nil, err
	}
	s.subs = append(s.subs, sub)
	context.AfterFunc(ctx, func() { _ = s.Close() })
	return ch, nil
}

func (s *subscriber) Close() error {
	s.mu.Lock()
	subs := s.subs
	s.subs, s.closed = nil, true
	s.mu.Unlock()
	for _, sub := range subs {
		sub.close()
	}
	return nil
}

// Publisher returns a publisher that inserts messages through tx: they exist
// if and only if tx commits. This is the outbox. Messages to a topic spread
// over lanes go to the lane of their key, in order. It is cheap; make one
// per transaction.
func (t *Transport) Publisher(tx Tx) message.Publisher {
	return &txPublisher{t: t, tx: tx}
}

type txPublisher struct {
	t  *Transport
	tx Tx
}

func (p *txPublisher) Publish(topic string, msgs ...*message.Message) error {
	if err := ValidateTopic(topic); err != nil {
		return err
	}
	if len(msgs) == 0 {
		return nil
	}
	for _, m := range msgs {
		if m.UUID == "" || len(m.UUID) > 36 {
			return fmt.Errorf("%w: %q (topic %s)", ErrInvalidMessageID, m.UUID, topic)
		}
		if m.Metadata == nil {
			m.Metadata = message.Metadata{}
		}
	}
	n := p.t.LanesOf(topic)
	if n == 1 {
		return p.insert(topic, msgs)
	}
	byLane := make([][]*message.Message, n)
	for _, m := range msgs {
		i := laneIndex(p.t.cfg.LaneKey(topic, m), n)
		byLane[i] = append(byLane[i], m)
	}
	for i, lane := range byLane {
		if len(lane) == 0 {
			continue
		}
		if err := p.insert(laneName(topic, i, n), lane); err != nil {
			return err
		}
	}
	return nil
}

// insert inserts msgs into one physical topic: at the end of the attempt
// when tx is a Router attempt's (see Deferrer), at once otherwise.
func (p *txPublisher) insert(topic string, msgs []*message.Message) error {
	if a, ok := p.tx.(*attemptTx); ok {
		return p.deferInsert(a, topic, msgs)
	}
	pub, err := wsql.NewPublisher(executor{p.tx}, wsql.PublisherConfig{SchemaAdapter: p.t.schema}, p.t.wlog)
	if err != nil {
		return fmt.Errorf("transport: publishing to %s: %w", topic, err)
	}
	if err := pub.Publish(topic, msgs...); err != nil {
		if isUndefinedTable(err) {
			return fmt.Errorf("%w: %s", ErrUnknownTopic, topic)
		}
		return fmt.Errorf("transport: publishing to %s: %w", topic, err)
	}
	return nil
}

func (p *txPublisher) deferInsert(a *attemptTx, topic string, msgs []*message.Message) error {
	args := make([]any, 0, 3*len(msgs))
	for _, m := range msgs {
		md, err := json.Marshal(m.Metadata)
		if err != nil {
			return fmt.Errorf("transport: publishing to %s: encoding metadata of %s: %w", topic, m.UUID, err)
		}
		// Copied: the statement is sent after Publish returns, and the
		// caller may reuse the payload's memory by then.
		args = append(args, m.UUID, bytes.Clone(m.Payload), string(md))
	}
	if err := a.DeferExec(context.Background(), insertMessagesSQL(p.t.MessagesTable(topic), len(msgs)), args...); err != nil {
		return fmt.Errorf("transport: publishing to %s: %w", topic, err)
	}
	if p.t.schema.notifyChannel != "" {
		return a.deferNotify(p.t.schema.notifyChannel, topic)
	}
	return nil
}

func (p *txPublisher) Close() error { return nil }

// executor adapts a Tx to the wider interface watermill-sql's publisher takes.
type executor struct{ Tx }

func (e executor) Exec(query string, args ...any) (sql.Result, error) {
	return e.ExecContext(context.Background(), query, args...)
}

func (e executor) Query(query string, args ...any) (*sql.Rows, error) {
	return e.QueryContext(context.Background(), query, args...)
}

func (e executor) QueryRow(query string, args ...any) *sql.Row {
	return e.QueryRowContext(context.Background(), query, args...)
}

func isUndefinedTable(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && pgErr.Code == "42P01"
}
