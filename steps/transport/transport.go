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
	"context"
	"database/sql"
	"errors"
	"fmt"
	"log/slog"
	"regexp"
	"strconv"
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

	// PollInterval is how long a subscriber waits after finding no message.
	// Ignored when NewBackoff is set. Default: 1s.
	PollInterval time.Duration

	// RetryInterval is the first wait after a failed poll (a lost
	// connection, an abandoned batch); it doubles up to MaxRetryInterval.
	// Ignored when NewBackoff is set. Default: 100ms.
	RetryInterval time.Duration

	// MaxRetryInterval caps RetryInterval's growth. Default: 5s.
	MaxRetryInterval time.Duration

	// NewBackoff builds the backoff manager of one subscription, for example
	// one woken by LISTEN/NOTIFY. Default: PollInterval after an empty poll,
	// exponential from RetryInterval after an error.
	NewBackoff func(topic, consumerGroup string) wsql.BackoffManager

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
	if c.PollInterval == 0 {
		c.PollInterval = time.Second
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
	for name, d := range map[string]time.Duration{
		"PollInterval": c.PollInterval, "RetryInterval": c.RetryInterval,
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
	schema  schemaAdapter
	offsets offsetsAdapter

	beginAttempt string // SAVEPOINT + SET LOCAL timeouts, prebuilt
	beginOwn     string // SET LOCAL timeouts, prebuilt
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
	return &Transport{
		cfg:  cfg,
		db:   cfg.DB,
		log:  cfg.Logger,
		wlog: wlog,
		schema: schemaAdapter{wsql.DefaultPostgreSQLSchema{
			GeneratePayloadType: func(string) string { return "BYTEA" },
			SubscribeBatchSize:  cfg.BatchSize,
		}},
		beginAttempt: fmt.Sprintf(beginAttemptSQL, ms(cfg.StatementTimeout), ms(cfg.LockTimeout)),
		beginOwn:     fmt.Sprintf(beginOwnSQL, ms(cfg.StatementTimeout), ms(cfg.LockTimeout)),
	}, nil
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

// CreateTopics creates the message and offset tables of topics if they do
// not exist. It is idempotent and safe to run from several processes at once
// (concurrent CREATE TABLE IF NOT EXISTS can otherwise fail on PostgreSQL's
// catalog), and must run before anything publishes to a topic inside a
// transaction.
func (t *Transport) CreateTopics(ctx context.Context, topics ...string) error {
	for _, topic := range topics {
		if err := ValidateTopic(topic); err != nil {
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
		queries := append(t.schema.SchemaInitializingQueries(topic), t.offsets.SchemaInitializingQueries(topic)...)
		for _, q := range queries {
			if _, err := tx.ExecContext(ctx, q.Query, q.Args...); err != nil {
				return fmt.Errorf("transport: creating topic %s: %w", topic, err)
			}
		}
	}
	if err := tx.Commit(); err != nil {
		return fmt.Errorf("transport: creating topics: %w", err)
	}
	return nil
}

// MessagesTable returns the quoted name of topic's message table.
func (t *Transport) MessagesTable(topic string) string { return t.schema.MessagesTable(topic) }

// OffsetsTable returns the quoted name of topic's consumer offsets table.
func (t *Transport) OffsetsTable(topic string) string { return t.offsets.MessagesOffsetsTable(topic) }

// Subscriber returns a subscriber for consumerGroup. Every subscriber of one
// group on one topic shares one serial lane, wherever it runs.
func (t *Transport) Subscriber(consumerGroup string) (message.Subscriber, error) {
	return t.subscriber("", consumerGroup)
}

func (t *Transport) subscriber(topic, consumerGroup string) (message.Subscriber, error) {
	if err := ValidateConsumerGroup(consumerGroup); err != nil {
		return nil, err
	}
	var backoff wsql.BackoffManager
	if t.cfg.NewBackoff != nil {
		backoff = t.cfg.NewBackoff(topic, consumerGroup)
	} else {
		backoff = newBackoff(t.cfg.PollInterval, t.cfg.RetryInterval, t.cfg.MaxRetryInterval)
	}
	ack := t.cfg.AckDeadline
	sub, err := wsql.NewSubscriber(t.db, wsql.SubscriberConfig{
		ConsumerGroup:  consumerGroup,
		AckDeadline:    &ack,
		PollInterval:   t.cfg.PollInterval,
		ResendInterval: t.cfg.ResendInterval,
		RetryInterval:  t.cfg.RetryInterval,
		BackoffManager: backoff,
		SchemaAdapter:  t.schema,
		OffsetsAdapter: t.offsets,
	}, t.wlog)
	if err != nil {
		return nil, fmt.Errorf("transport: creating subscriber for %s: %w", consumerGroup, err)
	}
	return &subscriber{inner: sub}, nil
}

// subscriber adapts a watermill-sql subscriber to the Router's shutdown.
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
	inner *wsql.Subscriber
	once  sync.Once
}

func (s *subscriber) Subscribe(ctx context.Context, topic string) (<-chan *message.Message, error) {
	if err := ValidateTopic(topic); err != nil {
		return nil, err
	}
	ch, err := s.inner.Subscribe(context.WithoutCancel(ctx), topic)
	if err != nil {
		if isUndefinedTable(err) {
			return nil, fmt.Errorf("%w: %s: %w", ErrUnknownTopic, topic, err)
		}
		return nil, err
	}
	context.AfterFunc(ctx, func() { _ = s.Close() })
	return ch, nil
}

func (s *subscriber) Close() error {
	s.once.Do(func() { _ = s.inner.Close() })
	return nil
}

// Publisher returns a publisher that inserts messages through tx: they exist
// if and only if tx commits. This is the outbox. It is cheap; make one per
// transaction.
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

// backoff waits pollInterval after an empty poll and, after errors, an
// interval that doubles from retry up to maxRetry; one success resets it.
type backoff struct {
	poll, retry, maxRetry time.Duration

	mu      sync.Mutex
	current time.Duration
}

func newBackoff(poll, retry, maxRetry time.Duration) *backoff {
	return &backoff{poll: poll, retry: retry, maxRetry: maxRetry}
}

func (b *backoff) HandleError(logger watermill.LoggerAdapter, noMsg bool, err error) time.Duration {
	b.mu.Lock()
	defer b.mu.Unlock()
	if err == nil {
		b.current = 0
		if noMsg {
			return b.poll
		}
		return 0
	}
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && (pgErr.Code == "40001" || pgErr.Code == "40P01") {
		// Another subscriber of the same consumer group held the lane and
		// moved its offset: expected when several processes share a lane.
		logger.Debug("Lane taken by another subscriber; polling again", watermill.LogFields{"err": err.Error()})
		return 0
	}
	if errors.As(err, &pgErr) && pgErr.Code == "25P02" {
		// The Router abandoned the batch (its offset update fails on the
		// aborted transaction): redeliver it at once.
		logger.Debug("Batch abandoned; redelivering", watermill.LogFields{"err": err.Error()})
		return 0
	}
	if b.current == 0 {
		b.current = b.retry
	} else {
		b.current = min(2*b.current, b.maxRetry)
	}
	logger.Error("Polling for messages failed; backing off", err, watermill.LogFields{"wait": b.current.String()})
	return b.current
}
