package transport

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strings"
	"unicode/utf8"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v3/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/pgsaga/pgsaga/internal/dbtx"
)

// Publisher returns a watermill-sql publisher that inserts messages through
// tx: they exist if and only if tx commits (the outbox). Each message is
// queued for every consumer group subscribed to its topic when the insert
// runs; a message no group subscribes to is stored as a dead letter saying
// so. In a delivery attempt, the insert is queued (see Queuer) and sent with
// the attempt's other writes; a handler of the attempt's router that takes
// in-process deliveries (InProcess) handles it there and then. It is
// cheap; make one per transaction.
func (t *Transport) Publisher(tx Tx) message.Publisher {
	return &txPublisher{t: t, tx: tx}
}

// QueuedPublisher is Publisher without in-process deliveries: every
// message is queued for every consumer group of its topic, also from a
// delivery attempt whose router has handlers that take them (InProcess).
// It is for messages meant to arrive later, in a transaction of their own:
// a redelivery a test simulates, say.
func (t *Transport) QueuedPublisher(tx Tx) message.Publisher {
	return &txPublisher{t: t, tx: tx, queued: true}
}

type txPublisher struct {
	t      *Transport
	tx     Tx
	queued bool // no in-process deliveries
}

func (p *txPublisher) Publish(topic string, msgs ...*message.Message) error {
	// A bad name is permanent: a handler that publishes it does so on
	// every attempt.
	if err := ValidateTopic(topic); err != nil {
		return Permanent(err)
	}
	if len(msgs) == 0 {
		return nil
	}
	for _, m := range msgs {
		if m.UUID == "" || len(m.UUID) > 255 {
			return Permanent(fmt.Errorf("%w: it has %d bytes (topic %s)", ErrInvalidMessageID, len(m.UUID), topic))
		}
		if err := storable(m); err != nil {
			return Permanent(fmt.Errorf("transport: publishing to %s: %w", topic, err))
		}
		if n := messageSize(m); n > p.t.cfg.MaxMessageBytes {
			return Permanent(fmt.Errorf("%w: message %s to %s has %d bytes, the limit is %d", ErrMessageTooLarge, m.UUID, topic, n, p.t.cfg.MaxMessageBytes))
		}
	}
	for _, m := range msgs {
		p.t.traceSend(p.tx, topic, m)
	}
	var exec wsql.ContextExecutor = executor{p.tx}
	if a, ok := p.tx.(*attemptTx); ok {
		if routes := a.local.of(topic); len(routes) > 0 && !p.queued {
			return p.publishLocal(a, topic, routes, msgs)
		}
		exec = queueExecutor{a: a, name: "publishing to " + topic}
	} else if q, ok := p.tx.(dbtx.Queuer); ok {
		exec = queuingExecutor{executor: executor{p.tx}, q: q, name: "publishing to " + topic}
	}
	pub, err := wsql.NewPublisher(exec, wsql.PublisherConfig{SchemaAdapter: p.t.schema}, p.t.wlog)
	if err != nil {
		return fmt.Errorf("transport: publishing to %s: %w", topic, err)
	}
	if err := pub.Publish(topic, msgs...); err != nil {
		return fmt.Errorf("transport: publishing to %s: %w", topic, migrationHint(err))
	}
	return nil
}

func (p *txPublisher) Close() error { return nil }

// executor adapts a Tx to the wider interface watermill-sql's publisher
// takes.
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

// queuingExecutor is the publisher's executor on a dbtx.Queuer other than
// an attempt (a dbtx.Pipe): its inserts are queued, its reads run.
type queuingExecutor struct {
	executor
	q    dbtx.Queuer
	name string
}

func (q queuingExecutor) ExecContext(_ context.Context, query string, args ...any) (sql.Result, error) {
	if err := q.q.QueueExec(q.name, query, args...); err != nil {
		return nil, err
	}
	return result{}, nil
}

func (q queuingExecutor) Exec(query string, args ...any) (sql.Result, error) {
	return q.ExecContext(context.Background(), query, args...)
}

// queueExecutor is the publisher's executor inside a delivery attempt: its
// inserts are queued on the attempt (see Queuer).
type queueExecutor struct {
	a    *attemptTx
	name string
}

var errQueueOnly = errors.New("transport: a publisher's executor in a delivery attempt only queues inserts")

func (q queueExecutor) ExecContext(_ context.Context, query string, args ...any) (sql.Result, error) {
	if query == publishSQL {
		// watermill-sql's publisher runs InsertQuery's statement: its rows
		// are written with the batch's other publishes.
		if err := q.a.queuePublishQuery(args, nil); err != nil {
			return nil, err
		}
		return result{}, nil
	}
	if err := q.a.QueueExec(q.name, query, args...); err != nil {
		return nil, err
	}
	return result{}, nil
}

func (q queueExecutor) Exec(query string, args ...any) (sql.Result, error) {
	return q.ExecContext(context.Background(), query, args...)
}

func (queueExecutor) QueryContext(context.Context, string, ...any) (*sql.Rows, error) {
	return nil, errQueueOnly
}

func (queueExecutor) Query(string, ...any) (*sql.Rows, error) { return nil, errQueueOnly }

func (q queueExecutor) QueryRowContext(ctx context.Context, query string, args ...any) *sql.Row {
	return q.a.QueryRowContext(ctx, query, args...)
}

func (q queueExecutor) QueryRow(query string, args ...any) *sql.Row {
	return q.a.QueryRowContext(context.Background(), query, args...)
}

// storable checks, before anything is sent, what PostgreSQL would refuse
// of m: a UUID that is not UTF-8 text without NUL (SQLSTATE 22021), and
// metadata holding a NUL, which jsonb cannot store (22P05, unsupported
// Unicode escape sequence). Inside a delivery attempt a publish is written
// when its batch ends, where a refusal could not be pinned on the message.
func storable(m *message.Message) error {
	if !utf8.ValidString(m.UUID) || strings.ContainsRune(m.UUID, 0) {
		return fmt.Errorf("%w: its UUID %q is not UTF-8 text without NUL (SQLSTATE 22021, invalid byte sequence)", ErrUnstorable, m.UUID)
	}
	for k, v := range m.Metadata {
		if strings.ContainsRune(k, 0) || strings.ContainsRune(v, 0) {
			return fmt.Errorf("%w: message %s: metadata %q holds a NUL, which jsonb refuses (SQLSTATE 22P05, unsupported Unicode escape sequence \\u0000)", ErrUnstorable, m.UUID, k)
		}
	}
	return nil
}

// messageSize is what MaxMessageBytes counts of m: its payload, and its
// metadata's keys and values.
func messageSize(m *message.Message) int {
	n := len(m.Payload)
	for k, v := range m.Metadata {
		n += len(k) + len(v)
	}
	return n
}
