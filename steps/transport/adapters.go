package transport

import (
	"database/sql"
	"encoding/json"
	"fmt"
	"regexp"
	"strconv"
	"strings"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v3/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
)

// positionKey is the metadata key under which a consumed message carries its
// position in its topic table ("<transaction_id>/<offset>"), so that the
// attempt that handles it can store the consumer's offset itself.
const positionKey = "_pgsaga_position"

// schemaAdapter is watermill-sql's PostgreSQL schema with a BYTEA payload,
// recording each consumed message's position in its metadata. With a
// notification channel, every insert also notifies the topic's subscribers,
// in the inserting transaction (delivered only if it commits). A
// subscription's adapter (poll set) also answers an empty poll with a
// sentinel row that tells the subscription where its group stands and
// where the visibility fence is (see selectBatchSQL).
type schemaAdapter struct {
	wsql.DefaultPostgreSQLSchema
	notifyChannel string     // "" when notifications are off
	poll          *pollState // the subscription's, nil for publishers
	offsets       offsetsAdapter
}

// InsertQuery inserts msgs and, with notifications on, announces the topic
// and the inserting transaction's id: "<topic> <xid>". Identical
// notifications of one transaction are sent once.
func (s schemaAdapter) InsertQuery(topic string, msgs message.Messages) (wsql.Query, error) {
	q, err := s.DefaultPostgreSQLSchema.InsertQuery(topic, msgs)
	if err != nil || s.notifyChannel == "" {
		return q, err
	}
	n := len(q.Args)
	q.Query = fmt.Sprintf(insertNotifySQL, q.Query, n+1, n+2)
	q.Args = append(q.Args, s.notifyChannel, topic)
	return q, nil
}

// SelectQuery reads the next batch for consumerGroup, or the sentinel row
// when there is none.
func (s schemaAdapter) SelectQuery(topic string, consumerGroup string, _ wsql.OffsetsAdapter) wsql.Query {
	return wsql.Query{
		Query: fmt.Sprintf(selectBatchSQL, s.offsets.MessagesOffsetsTable(topic), s.MessagesTable(topic), s.SubscribeBatchSize),
		Args:  []any{consumerGroup},
	}
}

func (s schemaAdapter) UnmarshalMessage(row wsql.Scanner) (wsql.Row, error) {
	var (
		r   wsql.Row
		xid int64
	)
	if err := row.Scan(&r.Offset, &xid, &r.UUID, &r.Payload, &r.Metadata); err != nil {
		return wsql.Row{}, fmt.Errorf("transport: scanning a message row: %w", err)
	}
	if r.Offset < 0 {
		// The sentinel: no message for the group. Whether some wait
		// behind the fence goes to the subscription's backoff.
		var sentinel struct {
			Fenced bool `json:"fenced"`
		}
		if err := json.Unmarshal(r.Metadata, &sentinel); err != nil {
			return wsql.Row{}, fmt.Errorf("transport: reading the poll's sentinel: %w", err)
		}
		if s.poll != nil {
			s.poll.empty(sentinel.Fenced)
		}
		return wsql.Row{}, sql.ErrNoRows
	}
	msg := message.NewMessage(string(r.UUID), r.Payload)
	if r.Metadata != nil {
		if err := json.Unmarshal(r.Metadata, &msg.Metadata); err != nil {
			return wsql.Row{}, fmt.Errorf("transport: message %s: decoding metadata: %w", r.UUID, err)
		}
	}
	if msg.Metadata == nil { // stored as JSON null
		msg.Metadata = message.Metadata{}
	}
	msg.Metadata.Set(positionKey, strconv.FormatInt(xid, 10)+"/"+strconv.FormatInt(r.Offset, 10))
	r.Msg = msg
	r.ExtraData = map[string]any{"transaction_id": xid}
	return r, nil
}

// position reads what schemaAdapter recorded.
func position(md map[string]string) (xid, offset int64, err error) {
	x, o, ok := strings.Cut(md[positionKey], "/")
	if !ok {
		return 0, 0, fmt.Errorf("transport: message carries no position (%s)", positionKey)
	}
	if xid, err = strconv.ParseInt(x, 10, 64); err != nil {
		return 0, 0, fmt.Errorf("transport: bad message position %q: %w", md[positionKey], err)
	}
	if offset, err = strconv.ParseInt(o, 10, 64); err != nil {
		return 0, 0, fmt.Errorf("transport: bad message position %q: %w", md[positionKey], err)
	}
	return xid, offset, nil
}

// offsetsAdapter is watermill-sql's PostgreSQL offsets adapter whose acks
// never move an offset backwards. An attempt stores its own message's offset
// (see Router.protect); the subscriber's ack of the batch prefix, which may
// not have seen that ack, must not undo it.
type offsetsAdapter struct {
	wsql.DefaultPostgreSQLOffsetsAdapter
}

func (a offsetsAdapter) AckMessageQuery(topic string, row wsql.Row, consumerGroup string) wsql.Query {
	return wsql.Query{
		Query: fmt.Sprintf(ackBatchSQL, a.MessagesOffsetsTable(topic)),
		Args:  []any{row.Offset, row.ExtraData["transaction_id"], consumerGroup},
	}
}

var consumerGroupPattern = regexp.MustCompile(`^[A-Za-z0-9\-$:._]{1,255}$`)

// ErrInvalidConsumerGroup is returned for a consumer group name outside
// [A-Za-z0-9-$:._]{1,255}.
var ErrInvalidConsumerGroup = fmt.Errorf("transport: invalid consumer group name (1 to 255 characters from [A-Za-z0-9-$:._])")

// ValidateConsumerGroup reports whether group can name a consumer group.
func ValidateConsumerGroup(group string) error {
	if !consumerGroupPattern.MatchString(group) {
		return fmt.Errorf("%w: %q", ErrInvalidConsumerGroup, group)
	}
	return nil
}

// attemptAck builds the statements that keep a successful attempt (see
// keepAttemptSQL). The table name comes from the validated topic, the group
// from a validated name with no quote characters, and the position from
// integers the database produced.
func attemptAck(offsetsTable, consumerGroup string, xid, offset int64) string {
	return fmt.Sprintf(keepAttemptSQL, offsetsTable, strconv.FormatInt(offset, 10), strconv.FormatInt(xid, 10), "'"+consumerGroup+"'")
}
