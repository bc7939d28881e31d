package transport

import (
	"database/sql"
	"encoding/json"
	"fmt"
	"strconv"
	"strings"
	"time"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v3/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
)

// schemaAdapter is the queue schema that watermill-sql's Publisher and
// Subscriber run through (wsql.SchemaAdapter). A consumer's copy knows the
// consumer, to which it reports each poll.
type schemaAdapter struct {
	notifyChannel string    // "" when wake-ups are off
	c             *consumer // nil for publishers
}

var _ wsql.SchemaAdapter = schemaAdapter{}

// InsertQuery fans msgs out to the topic's consumer groups (see publishSQL).
func (s schemaAdapter) InsertQuery(topic string, msgs message.Messages) (wsql.Query, error) {
	uuids := make([]string, len(msgs))
	payloads := make([][]byte, len(msgs))
	metadata := make([]string, len(msgs))
	for i, m := range msgs {
		md := m.Metadata
		if md == nil {
			md = message.Metadata{}
		}
		b, err := json.Marshal(md)
		if err != nil {
			return wsql.Query{}, fmt.Errorf("transport: encoding the metadata of %s: %w", m.UUID, err)
		}
		uuids[i], payloads[i], metadata[i] = m.UUID, m.Payload, string(b)
	}
	return wsql.Query{Query: publishSQL, Args: []any{topic, uuids, payloads, metadata, s.notifyChannel, noGroups}}, nil
}

// noGroups: no group handled the messages in process (publishSQL's $6).
var noGroups = []string{}

// SelectQuery claims the consumer's next batch (see claimSQL).
func (s schemaAdapter) SelectQuery(topic, consumerGroup string, _ wsql.OffsetsAdapter) wsql.Query {
	t := s.c.t
	return wsql.Query{
		Query: claimSQL,
		Args:  []any{topic, consumerGroup, t.statementTimeout, t.lockTimeout, t.idleTimeout, s.c.claimLimit()},
	}
}

// Metadata the transport adds to a delivered message for its own use; the
// handler's copy never carries it.
const (
	// metaDelivery is "<queue id>/<failed attempts so far>".
	metaDelivery = "_pgsaga_delivery"
	// metaUnreadable says why the stored message cannot be read.
	metaUnreadable = "_pgsaga_unreadable"
	// metaAwaited counts the times the message was handed back while its
	// handler's call ran (see Await); it is kept in the queue row.
	metaAwaited = "_pgsaga_awaited"
	// metaHandedBack counts the times the message was handed back
	// untouched (see HandBack); it is kept in the queue row.
	metaHandedBack = "_pgsaga_handed_back"
	internalPrefix = "_pgsaga_"
)

// UnmarshalMessage turns a claimed row into a message. It never fails for
// a row it could scan: a message whose metadata cannot be read is handed
// out marked unreadable, and the consumer dead-letters it in one attempt
// with the reason, instead of failing the whole batch on every poll.
func (s schemaAdapter) UnmarshalMessage(row wsql.Scanner) (wsql.Row, error) {
	var (
		r        wsql.Row
		id       int64
		attempts int
		nextIn   sql.NullFloat64
		held     bool
		dbNow    time.Time
	)
	if err := row.Scan(&id, &r.UUID, &r.Payload, &r.Metadata, &attempts, &nextIn, &held, &dbNow); err != nil {
		return wsql.Row{}, fmt.Errorf("transport: scanning a claimed message: %w", err)
	}
	if id < 0 {
		// The sentinel: nothing to claim now.
		next := time.Duration(-1)
		if nextIn.Valid {
			next = max(time.Duration(nextIn.Float64*float64(time.Second)), 0)
		}
		s.c.poll.empty(next, held)
		return wsql.Row{}, sql.ErrNoRows
	}
	msg := message.NewMessage(string(r.UUID), r.Payload)
	if len(r.Metadata) > 0 && string(r.Metadata) != "null" {
		if err := json.Unmarshal(r.Metadata, &msg.Metadata); err != nil {
			msg.Metadata = message.Metadata{}
			msg.Metadata.Set(metaUnreadable, "its metadata is not a JSON object of strings: "+err.Error())
		}
		if msg.Metadata == nil {
			msg.Metadata = message.Metadata{}
		}
	}
	msg.Metadata.Set(metaDelivery, strconv.FormatInt(id, 10)+"/"+strconv.Itoa(attempts))
	r.Offset, r.Msg = id, msg
	s.c.claimedOne(id, msg, dbNow)
	return r, nil
}

// SchemaInitializingQueries is empty: the migrations create the tables.
func (schemaAdapter) SchemaInitializingQueries(string) []wsql.Query { return nil }

// SubscribeIsolationLevel is READ COMMITTED: a claim sees every committed
// message, and a step waiting for a concurrent claim of its key sees that
// claim's outcome.
func (schemaAdapter) SubscribeIsolationLevel() sql.IsolationLevel { return sql.LevelReadCommitted }

// delivery is what the transport knows of a delivered message.
type delivery struct {
	id         int64
	failed     int    // failed attempts before this delivery
	awaited    int    // times handed back while its handler's call ran
	handedBack int    // times handed back untouched (HandBack)
	unreadable string // why the message cannot be read; "" if it can
}

func deliveryOf(md message.Metadata) (delivery, error) {
	idStr, failedStr, ok := strings.Cut(md.Get(metaDelivery), "/")
	if !ok {
		return delivery{}, ErrNoTransaction
	}
	id, err1 := strconv.ParseInt(idStr, 10, 64)
	failed, err2 := strconv.Atoi(failedStr)
	if err1 != nil || err2 != nil {
		return delivery{}, fmt.Errorf("transport: bad delivery metadata %q", md.Get(metaDelivery))
	}
	awaited, _ := strconv.Atoi(md.Get(metaAwaited))       // absent or garbled: none
	handedBack, _ := strconv.Atoi(md.Get(metaHandedBack)) // likewise
	return delivery{id: id, failed: failed, awaited: max(awaited, 0), handedBack: max(handedBack, 0),
		unreadable: md.Get(metaUnreadable)}, nil
}

// handlerCopy is the message a handler gets: msg without the transport's
// metadata, so that its Ack or Nack reaches nobody.
func handlerCopy(msg *message.Message) *message.Message {
	hm := msg.Copy()
	for k := range hm.Metadata {
		if strings.HasPrefix(k, internalPrefix) {
			delete(hm.Metadata, k)
		}
	}
	return hm
}

// offsetsAdapter is the queue's wsql.OffsetsAdapter. A queue has no offset
// to store: each attempt that handles a message deletes its row itself, with
// its other writes, whatever the subscriber makes of its ack.
type offsetsAdapter struct {
	c *consumer
}

var _ wsql.OffsetsAdapter = offsetsAdapter{}

// AckMessageQuery is what watermill-sql runs right before committing a
// batch that acked something: the consumer's permission to commit (see
// consumer.commitQuery). (A batch that acked nothing commits without it, and
// its commit guard refuses: nothing of it is kept.)
func (a offsetsAdapter) AckMessageQuery(string, wsql.Row, string) wsql.Query {
	return wsql.Query{Query: a.c.commitQuery()}
}

func (offsetsAdapter) ConsumedMessageQuery(string, wsql.Row, string, []byte) wsql.Query {
	return wsql.Query{}
}

func (offsetsAdapter) NextOffsetQuery(string, string) wsql.Query            { return wsql.Query{} }
func (offsetsAdapter) SchemaInitializingQueries(string) []wsql.Query        { return nil }
func (offsetsAdapter) BeforeSubscribingQueries(string, string) []wsql.Query { return nil }
