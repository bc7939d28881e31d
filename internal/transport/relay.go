package transport

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"time"

	pub "github.com/pgsaga/pgsaga/saga/delivery"

	"github.com/ThreeDotsLabs/watermill/message"
)

// RelayGroup is the consumer group of the relay to a message broker
// (steps/broker): subscribed to a topic (Subscribe), it gets every message
// published to the topic queued for it, like any group; the relay reads
// them with ClaimRelay, in the order they were queued.
const RelayGroup = "pgsaga.relay"

// RelayHandler names the relay in the dead letters it leaves.
const RelayHandler = "pgsaga.relay"

// ReceiveHandler names the receiving side of a bridge from a message broker
// (steps/broker) in the dead letters it leaves: messages it took in that
// no queue here can hold. ReplayDeadLetter refuses them (ErrNotReplayable).
const ReceiveHandler = pub.ReceiveHandler

// ErrRelayHeld is returned by ClaimRelay while another transaction holds
// the topic's relay: a relay runs in another process (or goroutine).
// It never reaches users: the bridge waits for the topic instead.
var ErrRelayHeld = errors.New("transport: another relay holds this topic")

// RelayBatch is a batch of a topic's messages queued for RelayGroup,
// oldest first, in a transaction of its own. Only one batch of a topic
// exists at a time on the database (a transaction-scoped advisory lock), so
// a relay that publishes them in Messages order, and stops at the first it
// cannot publish, keeps their order: messages published one after the
// other by causally ordered transactions (an event stream's versions, a
// saga's commands) reach the broker in that order.
//
// Record what became of each message (Relayed, DeadLetter), then Commit;
// messages not recorded stay queued, at the head, for the next batch. The
// transaction is bounded like a delivery batch
// (Config.MaxTransactionDuration): a relay that dies or freezes holding it
// gives it up, and its messages are claimed again.
type RelayBatch struct {
	// Messages are the batch's messages, oldest first. Their metadata
	// is as published, without the transport's own entries.
	Messages []*message.Message

	t      *Transport
	topic  string
	conn   *sql.Conn
	tx     *sql.Tx
	cancel context.CancelFunc
	ids    []int64 // of Messages
	start  time.Time

	claimed     int
	relayed     []int64
	deadIDs     []int64
	deadReasons []string
	closed      bool
}

// ClaimRelay opens a relay batch of at most limit messages of topic, or
// returns ErrRelayHeld if another relay holds the topic. A message whose
// metadata cannot be read is not handed out: it is dead-lettered when the
// batch commits, with the reason. ctx bounds the claim only; the batch
// lives until Commit or Rollback, at most Config.MaxTransactionDuration.
func (t *Transport) ClaimRelay(ctx context.Context, topic string, limit int) (*RelayBatch, error) {
	if err := ValidateTopic(topic); err != nil {
		return nil, err
	}
	if limit <= 0 {
		return nil, fmt.Errorf("transport: ClaimRelay needs a positive limit, got %d", limit)
	}
	if err := t.checkServer(ctx); err != nil {
		return nil, err
	}
	conn, err := t.db.Conn(ctx)
	if err != nil {
		return nil, fmt.Errorf("transport: relay of %s: acquiring a connection: %w", topic, err)
	}
	txCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), t.cfg.MaxTransactionDuration())
	b := &RelayBatch{t: t, topic: topic, conn: conn, cancel: cancel, start: time.Now()}
	fail := func(err error) (*RelayBatch, error) {
		b.Rollback()
		return nil, fmt.Errorf("transport: relay of %s: %w", topic, migrationHint(err))
	}
	if b.tx, err = conn.BeginTx(txCtx, &sql.TxOptions{Isolation: sql.LevelReadCommitted}); err != nil {
		return fail(err)
	}
	// The claim runs under the caller's ctx too: a relay that stops gives
	// up a claim waiting for a lock.
	stop := context.AfterFunc(ctx, cancel)
	defer stop()
	var held bool
	if err := b.tx.QueryRowContext(txCtx, relayLockSQL, topic, t.statementTimeout, t.lockTimeout, t.idleTimeout).Scan(&held); err != nil {
		return fail(err)
	}
	if !held {
		b.Rollback()
		return nil, ErrRelayHeld
	}
	rows, err := b.tx.QueryContext(txCtx, relayClaimSQL, topic, limit)
	if err != nil {
		return fail(err)
	}
	defer rows.Close()
	for rows.Next() {
		var (
			id      int64
			uuid    string
			payload []byte
			md      []byte
		)
		if err := rows.Scan(&id, &uuid, &payload, &md); err != nil {
			return fail(err)
		}
		b.claimed++
		msg := message.NewMessage(uuid, payload)
		if len(md) > 0 && string(md) != "null" {
			if err := json.Unmarshal(md, &msg.Metadata); err != nil {
				b.deadIDs = append(b.deadIDs, id)
				b.deadReasons = append(b.deadReasons, "its metadata is not a JSON object of strings: "+err.Error())
				continue
			}
		}
		if msg.Metadata == nil {
			msg.Metadata = message.Metadata{}
		}
		for k := range msg.Metadata {
			if strings.HasPrefix(k, internalPrefix) {
				delete(msg.Metadata, k)
			}
		}
		b.Messages = append(b.Messages, msg)
		b.ids = append(b.ids, id)
	}
	if err := rows.Err(); err != nil {
		return fail(err)
	}
	return b, nil
}

// Topic is the batch's topic.
func (b *RelayBatch) Topic() string { return b.topic }

// Started is when the batch was claimed.
func (b *RelayBatch) Started() time.Time { return b.start }

// Claimed counts the messages the batch claimed: Messages and those
// found unreadable. A batch that claimed its limit may not have emptied
// the queue.
func (b *RelayBatch) Claimed() int { return b.claimed }

// Relayed records that Messages[i] reached the broker: it leaves the queue
// when the batch commits.
func (b *RelayBatch) Relayed(i int) { b.relayed = append(b.relayed, b.ids[i]) }

// DeadLetter records that Messages[i] can never be relayed (the broker
// refuses it for good: too large, say): it moves to pgsaga_dead_letters
// with reason (made Storable: a reason the database refused would fail
// the batch's commit every time) when the batch commits, and the relay
// goes on without it.
func (b *RelayBatch) DeadLetter(i int, reason string) {
	b.deadIDs = append(b.deadIDs, b.ids[i])
	b.deadReasons = append(b.deadReasons, Storable(reason))
}

// DeadLettered counts the messages the batch dead-letters when it commits,
// those it found unreadable included.
func (b *RelayBatch) DeadLettered() int { return len(b.deadIDs) }

// Commit removes the relayed messages from the queue, moves the dead
// letters and ends the batch. Nothing recorded: it only ends it. A failed
// commit keeps every message queued; those relayed already will be
// relayed again.
func (b *RelayBatch) Commit() error {
	if b.closed {
		return sql.ErrTxDone
	}
	if len(b.relayed) == 0 && len(b.deadIDs) == 0 {
		b.Rollback()
		return nil
	}
	ctx, cancel := context.WithTimeout(context.Background(), b.t.cfg.StatementTimeout)
	defer cancel()
	_, err := b.tx.ExecContext(ctx, relayDoneSQL, b.relayed, b.deadIDs, b.deadReasons, RelayHandler)
	if err == nil {
		err = b.tx.Commit()
	}
	b.Rollback()
	if err != nil {
		return fmt.Errorf("transport: relay of %s: committing the batch: %w", b.topic, err)
	}
	if n := len(b.deadIDs); n > 0 {
		for range n {
			b.t.metrics.DeadLettered(b.topic, RelayHandler)
		}
	}
	return nil
}

// Rollback ends the batch, keeping every message queued. It is a no-op
// once the batch ended.
func (b *RelayBatch) Rollback() {
	if b.closed {
		return
	}
	b.closed = true
	if b.tx != nil {
		_ = b.tx.Rollback()
	}
	b.cancel()
	_ = b.conn.Close()
}

const (
	// relayLockSQL bounds the relay's transaction like a delivery batch
	// ($2 statement, $3 lock, $4 idle-in-transaction timeouts, in ms) and
	// takes the relay of topic $1, if no other transaction holds it.
	relayLockSQL = `SELECT set_config('statement_timeout', $2, true) IS NOT NULL
    AND set_config('lock_timeout', $3, true) IS NOT NULL
    AND set_config('idle_in_transaction_session_timeout', $4, true) IS NOT NULL
    AND pg_try_advisory_xact_lock(hashtextextended('pgsaga.relay/' || $1, 0))`

	// relayClaimSQL reads the head of topic $1's relay queue, at most $2
	// messages, in the order they were queued (pgsaga_queue_relay_idx). It
	// locks them, against a group dropped meanwhile; it skips none, since
	// skipping would reorder.
	relayClaimSQL = `SELECT id, uuid, payload, metadata FROM pgsaga_queue
WHERE topic = $1 AND consumer_group = 'pgsaga.relay'
ORDER BY id
LIMIT $2
FOR UPDATE`

	// relayDoneSQL removes the relayed messages ($1) and moves those that
	// cannot be relayed ($2, with the reasons $3) to the dead letters,
	// handled by $4.
	relayDoneSQL = `WITH relayed AS (
    DELETE FROM pgsaga_queue WHERE id = ANY ($1::bigint[])
), dead AS (
    DELETE FROM pgsaga_queue q USING unnest($2::bigint[], $3::text[]) AS r(id, reason)
    WHERE q.id = r.id
    RETURNING q.*, r.reason
)
INSERT INTO pgsaga_dead_letters (uuid, topic, consumer_group, handler, payload, metadata, reason, attempts, created_at)
SELECT uuid, topic, consumer_group, $4, payload,
    pgsaga_dead_letter_metadata(metadata, topic, consumer_group, $4, reason, 1), reason, 1, created_at
FROM dead`
)
