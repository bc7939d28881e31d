package transport

import (
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
// recording each consumed message's position in its metadata.
type schemaAdapter struct {
	wsql.DefaultPostgreSQLSchema
}

func (s schemaAdapter) UnmarshalMessage(row wsql.Scanner) (wsql.Row, error) {
	r, err := s.DefaultPostgreSQLSchema.UnmarshalMessage(row)
	if err != nil {
		return r, err
	}
	xid, ok := r.ExtraData["transaction_id"].(int64)
	if !ok {
		return r, fmt.Errorf("transport: message %s has no transaction id", r.UUID)
	}
	if r.Msg.Metadata == nil { // stored as JSON null
		r.Msg.Metadata = message.Metadata{}
	}
	r.Msg.Metadata.Set(positionKey, strconv.FormatInt(xid, 10)+"/"+strconv.FormatInt(r.Offset, 10))
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

// attemptAck builds the statement that ends a successful attempt: store the
// message's offset for the group (never backwards), then release the
// savepoint, in one round trip. The table name comes from the validated
// topic, the group from a validated name with no quote characters, and the
// position from integers the database produced.
func attemptAck(offsetsTable, consumerGroup string, xid, offset int64) string {
	return fmt.Sprintf(ackAttemptSQL, offsetsTable, strconv.FormatInt(offset, 10), strconv.FormatInt(xid, 10), "'"+consumerGroup+"'")
}
