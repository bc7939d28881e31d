package bridge_test

import (
	"context"
	"errors"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/internal/bridge"
	"github.com/pgsaga/pgsaga/internal/testdb"
	"github.com/pgsaga/pgsaga/internal/testnats"
	"github.com/pgsaga/pgsaga/internal/transport"
	"github.com/pgsaga/pgsaga/saga/delivery"
	"github.com/pgsaga/pgsaga/steps/broker"
	"github.com/pgsaga/pgsaga/steps/broker/natsjs"
)

// A message another service published to the broker is queued here for
// each consumer group of its topic, with its id, payload and metadata as
// published, whatever they hold: line breaks, surrounding spaces,
// characters outside ASCII, keys NATS headers cannot carry, keys in NATS's
// own header space (which JetStream would otherwise obey).
func TestReceiveQueuesAMessageWhole(t *testing.T) {
	t.Parallel()
	f := newFixture(t, testnats.URL(t), testdb.Shared(t))
	c := newCollector()
	f.consume(f.topic, "local", c)
	f.bridge(broker.Config{Receive: []string{f.topic}, Group: "g" + randomID()})

	msg := message.NewMessage("id with spaces\nand a line break "+randomID(), []byte("payload\x00with a NUL and \xff bytes"))
	msg.Metadata = message.Metadata{
		"reason":               "first line\r\nsecond line",
		"padded":               "  spaces around  ",
		"unicode":              "naïve — 日本",
		"key: with colon":      "v",
		"Nats-Expected-Stream": "another-stream",
		"Nats-Msg-Id":          "not the id",
		"":                     "empty key",
		"plain":                "value",
	}
	require.NoError(t, f.br.Publish(context.Background(), f.topic, msg))
	got := c.wait(t, 1)[0]
	assert.Equal(t, msg.UUID, got.UUID)
	assert.Equal(t, msg.Payload, got.Payload)
	assert.Equal(t, msg.Metadata, got.Metadata)
}

// A message published by a plain NATS client, with no Watermill id, takes
// a stable id from its stream position, so that a redelivery is the same
// message.
func TestReceiveAForeignMessage(t *testing.T) {
	t.Parallel()
	f := newFixture(t, testnats.URL(t), testdb.Shared(t))
	c := newCollector()
	f.consume(f.topic, "local", c)
	f.bridge(broker.Config{Receive: []string{f.topic}, Group: "g" + randomID()})
	nc, _ := testnats.ConnectTo(t, f.url)
	m := nats.NewMsg(f.topic)
	m.Data = []byte(`{"from":"elsewhere"}`)
	m.Header.Set("type", "Foreign")
	js, err := jetstream.New(nc)
	require.NoError(t, err)
	ack, err := js.PublishMsg(context.Background(), m)
	require.NoError(t, err)
	got := c.wait(t, 1)[0]
	assert.Equal(t, "nats:"+natsjs.StreamName(f.topic)+":"+strconv.FormatUint(ack.Sequence, 10), got.UUID)
	assert.Equal(t, "Foreign", got.Metadata.Get("type"))
}

// What the database can never store (a NUL or bytes that are not UTF-8
// in a header, an id too long, a header sent twice, an encoded header that
// does not decode) is dead-lettered on receipt, with the reason, and
// acknowledged: the broker does not deliver it again, and the messages
// after it flow.
func TestReceiveDeadLettersWhatCannotBeQueued(t *testing.T) {
	t.Parallel()
	f, c, group := newReceiver(t)
	nc, _ := testnats.ConnectTo(t, f.url)
	js, err := jetstream.New(nc)
	require.NoError(t, err)
	ctx := context.Background()
	bad := map[string]func(m *nats.Msg){
		"nul":      func(m *nats.Msg) { m.Header.Set("note", "a\x00b") },
		"not-utf8": func(m *nats.Msg) { m.Header.Set("note", "a\xffb") },
		"long-id":  func(m *nats.Msg) { m.Header.Set(natsjs.HeaderUUID, strings.Repeat("x", 300)) },
		"twice":    func(m *nats.Msg) { m.Header.Add("note", "1"); m.Header.Add("note", "2") },
		"encoded":  func(m *nats.Msg) { m.Header.Set(natsjs.HeaderEncoded, "%%% not base64") },
	}
	for name, spoil := range bad {
		m := nats.NewMsg(f.topic)
		m.Data = []byte(name)
		m.Header.Set(natsjs.HeaderUUID, "bad-"+name)
		spoil(m)
		_, err := js.PublishMsg(ctx, m)
		require.NoError(t, err, name)
	}
	good := message.NewMessage("good-"+randomID(), []byte("fine"))
	require.NoError(t, f.br.Publish(ctx, f.topic, good))
	got := c.wait(t, 1)
	require.Len(t, got, 1, "only the good message is queued")
	assert.Equal(t, good.UUID, got[0].UUID)

	require.Eventually(t, func() bool {
		var n int
		require.NoError(t, f.db.SQL.QueryRow(`SELECT count(*) FROM pgsaga_dead_letters WHERE topic = $1`, f.topic).Scan(&n))
		return n == len(bad)
	}, time.Minute, 10*time.Millisecond)
	rows, err := f.db.SQL.Query(`SELECT payload, handler, consumer_group, reason FROM pgsaga_dead_letters WHERE topic = $1`, f.topic)
	require.NoError(t, err)
	defer rows.Close()
	for rows.Next() {
		var payload, handler, grp, reason string
		require.NoError(t, rows.Scan(&payload, &handler, &grp, &reason))
		assert.Equal(t, delivery.ReceiveHandler, handler)
		assert.Equal(t, group, grp)
		assert.Contains(t, reason, "received from the broker but cannot be queued", payload)
	}
	require.NoError(t, rows.Err())
	// Acknowledged, every one: nothing is pending or delivered again.
	cons, err := js.Consumer(ctx, natsjs.StreamName(f.topic), natsjs.ConsumerName(group, f.topic))
	require.NoError(t, err)
	require.Eventually(t, func() bool {
		info, err := cons.Info(ctx)
		require.NoError(t, err)
		return info.NumAckPending == 0 && info.AckFloor.Stream == uint64(len(bad)+1)
	}, time.Minute, 10*time.Millisecond)
	info, err := cons.Info(ctx)
	require.NoError(t, err)
	assert.Zero(t, info.NumRedelivered)
}

// While the database refuses to queue a message (here a trigger, as a
// database that does not answer would), it is handed back and the broker
// delivers it again; once the database takes it, it is queued, once.
func TestReceiveHandsBackWhatTheDatabaseRefusesNow(t *testing.T) {
	t.Parallel()
	db := testdb.Fresh(t)
	f := newFixture(t, testnats.URL(t), db)
	_, err := db.SQL.Exec(`CREATE TABLE refuse (on_ boolean NOT NULL);
INSERT INTO refuse VALUES (true);
CREATE SEQUENCE refusals;
CREATE FUNCTION refuse() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF (SELECT on_ FROM refuse) THEN
        PERFORM nextval('refusals');
        RAISE EXCEPTION 'refused for now' USING ERRCODE = 'object_not_in_prerequisite_state';
    END IF;
    RETURN NEW;
END $$;
CREATE TRIGGER refuse BEFORE INSERT ON pgsaga_queue FOR EACH ROW EXECUTE FUNCTION refuse()`)
	require.NoError(t, err)
	c := newCollector()
	f.consume(f.topic, "local", c)
	f.bridge(broker.Config{Receive: []string{f.topic}, Group: "g" + randomID(), Consumers: 1})
	msg := message.NewMessage("m-"+randomID(), []byte("later"))
	require.NoError(t, f.br.Publish(context.Background(), f.topic, msg))
	require.Eventually(t, func() bool {
		var n int64
		require.NoError(t, db.SQL.QueryRow(`SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM refusals`).Scan(&n))
		return n >= 2
	}, time.Minute, 10*time.Millisecond, "refused, handed back, delivered again, refused again")
	_, err = db.SQL.Exec(`UPDATE refuse SET on_ = false`)
	require.NoError(t, err)
	got := c.wait(t, 1)
	assert.Equal(t, msg.UUID, got[0].UUID)
	var dead int
	require.NoError(t, db.SQL.QueryRow(`SELECT count(*) FROM pgsaga_dead_letters`).Scan(&dead))
	assert.Zero(t, dead, "a refusal the database may get over is no dead letter")
}

// A bridge's config is checked whole.
func TestBridgeConfig(t *testing.T) {
	t.Parallel()
	f := newFixture(t, testnats.URL(t), testdb.Shared(t))
	for name, tc := range map[string]struct {
		tr  *transport.Transport
		cfg broker.Config
	}{
		"nothing":          {f.tr, broker.Config{Broker: f.br}},
		"no transport":     {nil, broker.Config{Broker: f.br, Relay: []string{"a"}}},
		"no broker":        {f.tr, broker.Config{Relay: []string{"a"}}},
		"bad topic":        {f.tr, broker.Config{Broker: f.br, Relay: []string{"a b"}}},
		"twice":            {f.tr, broker.Config{Broker: f.br, Relay: []string{"a", "a"}}},
		"round in circles": {f.tr, broker.Config{Broker: f.br, Relay: []string{"a"}, Receive: []string{"a"}}},
		"bad group":        {f.tr, broker.Config{Broker: f.br, Receive: []string{"a"}, Group: "a group"}},
		"consumers":        {f.tr, broker.Config{Broker: f.br, Receive: []string{"a"}, Consumers: -1}},
		"slow broker":      {f.tr, broker.Config{Broker: bounded{f.br, time.Hour}, Relay: []string{"a"}}},
	} {
		_, err := bridge.New(tc.tr, tc.cfg)
		assert.ErrorIs(t, err, broker.ErrInvalidConfig, name)
	}
}

// Stopping a bridge while the broker has handed it messages that no
// consumer took yet: it stops (no panic: watermill-nats alone sent them to
// a closed channel), the messages being queued are queued and acknowledged,
// the rest are handed back, and the next bridge receives every message.
func TestReceiveStopsWithABacklog(t *testing.T) {
	t.Parallel()
	f := newFixture(t, testnats.URL(t), testdb.Shared(t))
	ctx := context.Background()
	require.NoError(t, f.br.Provision(ctx, f.topic))
	const n = 300
	ids := map[string]bool{}
	for range n {
		m := message.NewMessage(uuid.NewString(), []byte("{}"))
		ids[m.UUID] = true
		require.NoError(t, f.br.Publish(ctx, f.topic, m))
	}
	c := newCollector()
	f.consume(f.topic, "local", c)
	group := "g" + randomID()
	cfg := broker.Config{Broker: f.br, Receive: []string{f.topic}, Group: group, Logger: testLogger()}
	first, err := bridge.New(f.tr, cfg)
	require.NoError(t, err)
	require.NoError(t, first.Start(ctx))
	require.Eventually(t, func() bool { return first.Stats().Received >= 10 }, time.Minute, time.Millisecond)
	require.NoError(t, first.Stop())

	f.bridge(cfg)
	seen := map[string]int{}
	for k := n; len(seen) < n; k++ {
		clear(seen)
		for _, m := range c.wait(t, k) {
			seen[m.UUID]++
		}
	}
	twice := 0
	for id := range ids {
		if seen[id] > 1 {
			twice++
		}
	}
	// A message handed back while the broker was delivering it may come
	// twice (at least once); what was queued was acknowledged, so no more
	// than the consumers held (2 of them, 8 messages each) come again.
	assert.LessOrEqual(t, twice, 2*8, "messages received twice")
}

// A group's consumer deleted at the broker under a running bridge (an
// operator's mistake) is created again: messages published afterwards
// arrive. (A new consumer starts again from the stream's oldest message:
// what came before is delivered again, which receivers absorb.)
func TestReceiveAfterTheConsumerIsDeleted(t *testing.T) {
	t.Parallel()
	f, c, group := newReceiver(t)
	ctx := context.Background()
	before := message.NewMessage(uuid.NewString(), []byte("{}"))
	require.NoError(t, f.br.Publish(ctx, f.topic, before))
	c.wait(t, 1)
	// nats-server 2.9 sometimes answers a consumer's deletion with an
	// error while its files are written ("directory not empty"), having
	// deleted it or not: delete until it is gone.
	require.Eventually(t, func() bool {
		err := f.js.DeleteConsumer(ctx, natsjs.StreamName(f.topic), natsjs.ConsumerName(group, f.topic))
		return err == nil || errors.Is(err, jetstream.ErrConsumerNotFound)
	}, time.Minute, 50*time.Millisecond)
	after := message.NewMessage(uuid.NewString(), []byte("{}"))
	require.NoError(t, f.br.Publish(ctx, f.topic, after))
	for n := 2; ; n++ {
		if got := c.wait(t, n); got[len(got)-1].UUID == after.UUID {
			break
		}
	}
}

// Queuing a received message is bounded: a queue insert that waits for a
// lock someone holds on the queue (a table rewrite, say) gives up after
// the transport's LockTimeout, and the message is delivered again and
// queued once the lock is gone; the consumer is never stuck.
func TestReceiveGivesUpOnALockedQueue(t *testing.T) {
	t.Parallel()
	db := testdb.Fresh(t)
	f := newFixture(t, testnats.URL(t), db)
	cfg := transportConfig(db)
	cfg.LockTimeout = 200 * time.Millisecond
	tr, err := transport.New(cfg)
	require.NoError(t, err)
	f.tr = tr
	c := newCollector()
	f.consume(f.topic, "local", c)
	b := f.bridge(broker.Config{Receive: []string{f.topic}, Group: "g" + randomID(), Consumers: 1})
	ctx := context.Background()
	lock, err := db.SQL.BeginTx(ctx, nil)
	require.NoError(t, err)
	_, err = lock.ExecContext(ctx, `LOCK TABLE pgsaga_queue IN EXCLUSIVE MODE`)
	require.NoError(t, err)
	msg := message.NewMessage(uuid.NewString(), []byte("{}"))
	require.NoError(t, f.br.Publish(ctx, f.topic, msg))
	require.Eventually(t, func() bool { return b.Stats().HandedBack > 0 }, time.Minute, 10*time.Millisecond,
		"the insert gave up waiting for the lock and handed the message back")
	require.NoError(t, lock.Rollback())
	got := c.wait(t, 1)
	assert.Equal(t, msg.UUID, got[0].UUID)
}

// bounded is a broker whose publish may take up to bound.
type bounded struct {
	broker.Broker
	bound time.Duration
}

func (b bounded) MaxPublishDuration() time.Duration { return b.bound }

// nats.go takes a message with no data and a Status header for a message
// of the server's own: it never reaches the handler, and a 400 stops the
// consumer. A message of pgsaga's with no payload and such metadata
// (Status, Description, in any case) travels encoded and arrives whole;
// the messages after it arrive too.
func TestReceiveAnEmptyMessageWithStatusMetadata(t *testing.T) {
	t.Parallel()
	f, c, _ := newReceiver(t)
	ctx := context.Background()
	var sent []*message.Message
	for _, md := range []message.Metadata{
		{"Status": "400", "Description": "Bad Request"},
		{"status": "409", "description": "Consumer Deleted"},
		{"STATUS": "100"},
		{"Status": "404", "Description": "No Messages"},
		{"plain": "after them"},
	} {
		m := message.NewMessage(uuid.NewString(), nil)
		m.Metadata = md
		require.NoError(t, f.br.Publish(ctx, f.topic, m))
		sent = append(sent, m)
	}
	got := c.wait(t, len(sent))
	byID := map[string]*message.Message{}
	for _, m := range got {
		byID[m.UUID] = m
	}
	for _, m := range sent {
		require.Contains(t, byID, m.UUID)
		assert.Equal(t, m.Metadata, byID[m.UUID].Metadata)
		assert.Empty(t, byID[m.UUID].Payload)
	}
}

// A message another client published with no data and a Status header
// passes, in nats.go, for a status message of the server's: no handler
// ever sees it. A 400 stops nats.go's consumer: the receiver consumes
// again at once. Any other status (100, 404, …) uses up the one message
// the receiver asked for: the pull expires soon (within half the ack
// wait, at most 5s), and the receiver asks again. Either way the messages
// after it arrive, well within the stall a default pull (30s, every ack
// wait again) would have cost.
func TestReceiveGoesOnPastAForeignStatusMessage(t *testing.T) {
	t.Parallel()
	for _, status := range []string{"400", "100", "404", "408"} {
		t.Run(status, func(t *testing.T) {
			t.Parallel()
			f, c, _ := newReceiver(t)
			nc, _ := testnats.ConnectTo(t, f.url)
			js, err := jetstream.New(nc)
			require.NoError(t, err)
			ctx := context.Background()
			poison := nats.NewMsg(f.topic)
			poison.Header.Set("Status", status)
			poison.Header.Set("Description", "From Elsewhere")
			_, err = js.PublishMsg(ctx, poison)
			require.NoError(t, err)
			var want []string
			for range 3 {
				m := message.NewMessage(uuid.NewString(), []byte(`{}`))
				require.NoError(t, f.br.Publish(ctx, f.topic, m))
				want = append(want, m.UUID)
			}
			var ids []string
			for _, m := range c.waitWithin(t, len(want), 20*time.Second) {
				ids = append(ids, m.UUID)
			}
			assert.ElementsMatch(t, want, ids)
		})
	}
}

// JetStream's ack wait runs from a message's delivery to the process; a
// receiver that took several messages at a time held the later ones
// waiting for the inserts of the earlier ones, past the ack wait, and the
// broker delivered them again: each was queued twice, though one insert's
// bound (which New checks) is within the ack wait. A receiver now takes a
// message once it is free for it. (Each insert takes a fifth of the ack
// wait here.)
func TestReceiveTakesNoMoreThanItCanQueueWithinTheAckWait(t *testing.T) {
	t.Parallel()
	db := testdb.Fresh(t)
	_, err := db.SQL.Exec(`CREATE FUNCTION slow_insert() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN PERFORM pg_sleep(0.4); RETURN NEW; END $$;
CREATE TRIGGER slow_insert BEFORE INSERT ON pgsaga_queue FOR EACH ROW WHEN (NEW.consumer_group = 'local') EXECUTE FUNCTION slow_insert()`)
	require.NoError(t, err)
	url := testnats.URL(t)
	f := newFixture(t, url, db)
	cfg := transportConfig(db)
	cfg.StatementTimeout = 900 * time.Millisecond // an insert's bound: 1.8s
	tr, err := transport.New(cfg)
	require.NoError(t, err)
	br, err := natsjs.New(natsjs.Config{URL: url, Logger: testLogger(), AckWait: 2 * time.Second})
	require.NoError(t, err)
	t.Cleanup(func() { _ = br.Close() })
	ctx := context.Background()
	require.NoError(t, tr.Subscribe(ctx, transport.Subscription{Topic: f.topic, ConsumerGroup: "local"}))
	group := "g" + randomID()
	b := f.bridgeOn(tr, broker.Config{Broker: br, Receive: []string{f.topic}, Group: group, Consumers: 1})
	const n = 10
	for range n {
		require.NoError(t, br.Publish(ctx, f.topic, message.NewMessage(uuid.NewString(), []byte(`{}`))))
	}
	cons, err := f.js.Consumer(ctx, natsjs.StreamName(f.topic), natsjs.ConsumerName(group, f.topic))
	require.NoError(t, err)
	bound, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	for {
		info, err := cons.Info(bound)
		require.NoError(t, err)
		if info.NumPending == 0 && info.NumAckPending == 0 {
			break
		}
		select {
		case <-bound.Done():
			t.Fatalf("the broker still has %d messages to deliver and %d unacknowledged", info.NumPending, info.NumAckPending)
		case <-time.After(50 * time.Millisecond): // polls the broker's state
		}
	}
	assert.Equal(t, int64(n), b.Stats().Received, "each queued once")
	assert.Equal(t, n, f.queued(f.topic, "local"))
}

// A bridge that would receive a topic no consumer group of its database
// reads refuses to start, naming the topic: what it took from the broker
// would be a dead letter here, acknowledged at the broker. Once a group
// reads it, the bridge starts and receives.
func TestBridgeRefusesToReceiveWhatNoGroupReads(t *testing.T) {
	t.Parallel()
	f := newFixture(t, testnats.URL(t), testdb.Fresh(t))
	ctx := context.Background()
	// The relay's own group does not count.
	require.NoError(t, f.tr.Subscribe(ctx, transport.Subscription{Topic: f.topic, ConsumerGroup: transport.RelayGroup}))
	b, err := bridge.New(f.tr, broker.Config{Broker: f.br, Receive: []string{f.topic}, Group: "g" + randomID(), Logger: testLogger()})
	require.NoError(t, err)
	err = b.Start(ctx)
	require.ErrorIs(t, err, broker.ErrNoLocalGroup)
	assert.Contains(t, err.Error(), f.topic)
	sent := message.NewMessage(uuid.NewString(), []byte(`{}`))
	require.NoError(t, f.br.Publish(ctx, f.topic, sent))

	c := newCollector()
	f.consume(f.topic, "local", c)
	require.NoError(t, b.Start(ctx))
	t.Cleanup(func() { _ = b.Stop() })
	assert.Equal(t, sent.UUID, c.wait(t, 1)[0].UUID, "the message waited at the broker")
	dl, err := f.tr.DeadLetters(ctx, transport.DeadLetterFilter{Topic: f.topic})
	require.NoError(t, err)
	assert.Empty(t, dl)
}
