package transport_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/internal/testdb"
	"github.com/pgsaga/pgsaga/steps/transport"
)

func sagaMessage(sagaID string, seq int) *message.Message {
	m := message.NewMessage(uuid.NewString(), []byte(fmt.Sprintf(`{"seq":%d}`, seq)))
	m.Metadata.Set("saga_id", sagaID)
	m.Metadata.Set("seq", fmt.Sprint(seq))
	return m
}

// Every message of one saga goes to one lane and is handled in the order
// it was published, while the sagas spread over all the lanes.
func TestLanesKeepEachSagaInOneLaneInOrder(t *testing.T) {
	t.Parallel()
	e := newEnv(t, func(c *transport.Config) { c.Lanes = 4 })
	assert.Equal(t, []string{e.in + ".0", e.in + ".1", e.in + ".2", e.in + ".3"}, e.tr.LaneTopics(e.in))
	const sagas, perSaga = 24, 10
	ids := make([]string, sagas)
	for i := range ids {
		ids[i] = uuid.NewString()
	}
	// Published interleaved, in several transactions.
	for seq := range perSaga {
		tx, err := e.db.SQL.Begin()
		require.NoError(t, err)
		msgs := make([]*message.Message, sagas)
		for i, id := range ids {
			msgs[i] = sagaMessage(id, seq)
		}
		require.NoError(t, e.tr.Publisher(tx).Publish(e.in, msgs...))
		require.NoError(t, tx.Commit())
	}
	lanesUsed := 0
	for _, lane := range e.tr.LaneTopics(e.in) {
		var n, spread int
		require.NoError(t, e.db.SQL.QueryRow(`SELECT count(*), count(DISTINCT metadata->>'saga_id') FROM `+e.tr.MessagesTable(lane)).Scan(&n, &spread))
		if n > 0 {
			lanesUsed++
		}
	}
	assert.Equal(t, 4, lanesUsed, "24 sagas spread over every lane")
	assert.Equal(t, sagas*perSaga, e.count(`SELECT count(*) FROM `+e.tr.MessagesFrom(e.in, "m")), "MessagesFrom reads every lane")
	for _, id := range ids {
		var lanes int
		q := `SELECT count(*) FROM (`
		for i, lane := range e.tr.LaneTopics(e.in) {
			if i > 0 {
				q += ` UNION ALL `
			}
			q += fmt.Sprintf(`SELECT %d AS lane FROM %s WHERE metadata->>'saga_id' = $1`, i, e.tr.MessagesTable(lane))
		}
		q += `) x GROUP BY lane`
		rows, err := e.db.SQL.Query(q, id)
		require.NoError(t, err)
		for rows.Next() {
			lanes++
		}
		require.NoError(t, rows.Close())
		assert.Equal(t, 1, lanes, "saga %s is in one lane", id)
	}

	var mu sync.Mutex
	seen := map[string][]string{}
	r, err := e.tr.NewRouter()
	require.NoError(t, err)
	require.NoError(t, r.AddHandler("h", e.in, "g", func(msg *message.Message) error {
		mu.Lock()
		defer mu.Unlock()
		id := msg.Metadata.Get("saga_id")
		seen[id] = append(seen[id], msg.Metadata.Get("seq"))
		return nil
	}))
	startRouter(t, r)
	waitFor(t, 20*time.Second, "every message", func() bool {
		mu.Lock()
		defer mu.Unlock()
		n := 0
		for _, s := range seen {
			n += len(s)
		}
		return n == sagas*perSaga
	})
	mu.Lock()
	defer mu.Unlock()
	want := make([]string, perSaga)
	for i := range want {
		want[i] = fmt.Sprint(i)
	}
	for _, id := range ids {
		assert.Equal(t, want, seen[id], "saga %s in order", id)
	}
}

// The lanes of one handler run in parallel: a message stuck in one lane
// does not hold up the others. (It does hold up messages published after
// its transaction began, in every lane and topic: watermill-sql's
// visibility fence. So both are published before the router starts.)
func TestLanesRunInParallel(t *testing.T) {
	t.Parallel()
	e := newEnv(t, func(c *transport.Config) { c.Lanes = 2 })
	// Two keys in different lanes.
	var keys [2]string
	for i := 0; keys[0] == "" || keys[1] == ""; i++ {
		k := fmt.Sprint("key-", i)
		m := sagaMessage(k, 0)
		if lane := e.tr.LaneOf(e.in, m); lane == e.in+".0" && keys[0] == "" {
			keys[0] = k
		} else if lane == e.in+".1" && keys[1] == "" {
			keys[1] = k
		}
	}
	require.NoError(t, e.tr.Publisher(e.db.SQL).Publish(e.in, sagaMessage(keys[0], 0)))
	require.NoError(t, e.tr.Publisher(e.db.SQL).Publish(e.in, sagaMessage(keys[1], 0)))
	release := make(chan struct{})
	handled := make(chan string, 10)
	r, err := e.tr.NewRouter()
	require.NoError(t, err)
	require.NoError(t, r.AddHandler("h", e.in, "g", func(msg *message.Message) error {
		if msg.Metadata.Get("saga_id") == keys[0] {
			handled <- "stuck"
			<-release
		}
		handled <- msg.Metadata.Get("saga_id")
		return nil
	}))
	startRouter(t, r)
	defer close(release)
	// A serial consumer would take the first message, get stuck, and never
	// see the second.
	got := map[string]bool{}
	for !got[keys[1]] || !got["stuck"] {
		select {
		case k := <-handled:
			got[k] = true
		case <-time.After(10 * time.Second):
			t.Fatalf("the second lane waited for the first (got %v)", got)
		}
	}
	assert.False(t, got[keys[0]], "the first lane is still stuck")
}

// The lane key: partition_key, else saga_id, else the UUID; a custom
// LaneKey replaces it. Dead-letter topics keep one lane; TopicLanes
// overrides.
func TestLaneKeysAndCounts(t *testing.T) {
	t.Parallel()
	db := testdb.Shared(t)
	tr, err := transport.New(transport.Config{DB: db.SQL, Lanes: 8, TopicLanes: map[string]int{"narrow": 2, "flat": 1},
		Retry: transport.RetryPolicy{DeadLetterTopic: "my_dlq"}})
	require.NoError(t, err)
	assert.Equal(t, 8, tr.LanesOf("orders"))
	assert.Equal(t, 2, tr.LanesOf("narrow"))
	assert.Equal(t, 1, tr.LanesOf("flat"))
	assert.Equal(t, 1, tr.LanesOf(transport.DefaultDeadLetterTopic))
	assert.Equal(t, 1, tr.LanesOf("my_dlq"))
	assert.Equal(t, []string{"flat"}, tr.LaneTopics("flat"))

	withSaga := sagaMessage("saga-1", 0)
	alsoSaga := sagaMessage("saga-1", 1)
	assert.Equal(t, tr.LaneOf("orders", withSaga), tr.LaneOf("orders", alsoSaga))
	partitioned := sagaMessage("saga-1", 2)
	partitioned.Metadata.Set(transport.MetaPartitionKey, "stream-9")
	plain := message.NewMessage("stream-9", nil) // the UUID is the key
	assert.Equal(t, tr.LaneOf("orders", plain), tr.LaneOf("orders", partitioned), "partition_key wins over saga_id")
	// Stable: the same key lands in the same lane, in every process.
	assert.Equal(t, "orders.3", tr.LaneOf("orders", message.NewMessage("fixed-key", nil)), "the hash must never change")

	custom, err := transport.New(transport.Config{DB: db.SQL, Lanes: 4, LaneKey: func(string, *message.Message) string { return "same" }})
	require.NoError(t, err)
	lane := custom.LaneOf("t", message.NewMessage(uuid.NewString(), nil))
	for range 20 {
		assert.Equal(t, lane, custom.LaneOf("t", message.NewMessage(uuid.NewString(), nil)))
	}

	// Lane names must fit PostgreSQL's identifiers too.
	long := fmt.Sprintf("%0*d", transport.MaxTopicLen-1, 0)
	require.NoError(t, transport.ValidateTopic(long))
	assert.ErrorIs(t, tr.CreateTopics(context.Background(), long), transport.ErrInvalidTopic)
}

// A topic's lane count is recorded; changing it is refused while the old
// lanes hold unconsumed messages, and allowed once they are drained.
func TestLaneCountChangeWaitsForDrainedLanes(t *testing.T) {
	t.Parallel()
	e := newEnv(t, func(c *transport.Config) { c.Lanes = 2 })
	e.publish(10)
	wider, err := transport.New(transport.Config{DB: e.db.SQL, Logger: testLogger(), Lanes: 4, PollInterval: 20 * time.Millisecond})
	require.NoError(t, err)
	err = wider.CreateTopics(context.Background(), e.in)
	require.ErrorIs(t, err, transport.ErrLanesChanged)
	assert.Contains(t, err.Error(), "10 unconsumed messages")

	// Drain with the old count.
	var handled sync.WaitGroup
	handled.Add(10)
	r, err := e.tr.NewRouter()
	require.NoError(t, err)
	require.NoError(t, r.AddHandler("h", e.in, "g", func(*message.Message) error { handled.Done(); return nil }))
	stop := startRouter(t, r)
	handled.Wait()
	waitFor(t, 10*time.Second, "the offsets", func() bool {
		return e.consumed(e.in+".0", "g")+e.consumed(e.in+".1", "g") == 10
	})
	stop()
	require.NoError(t, wider.CreateTopics(context.Background(), e.in))
	var lanes int
	require.NoError(t, e.db.SQL.QueryRow(`SELECT lanes FROM pgsaga_topic_lanes WHERE topic = $1`, e.in).Scan(&lanes))
	assert.Equal(t, 4, lanes)
	assert.Equal(t, 1, e.count(`SELECT count(*) FROM pg_tables WHERE tablename = $1`, "watermill_"+e.in+".3"))
}

// Subscribing to a topic spread over lanes says what to do instead.
func TestSubscribingToALanedTopicNeedsItsLanes(t *testing.T) {
	t.Parallel()
	e := newEnv(t, func(c *transport.Config) { c.Lanes = 3 })
	sub, err := e.tr.Subscriber("g")
	require.NoError(t, err)
	defer sub.Close()
	_, err = sub.Subscribe(context.Background(), e.in)
	require.True(t, errors.Is(err, transport.ErrUnknownTopic), "%v", err)
	assert.Contains(t, err.Error(), "3 lanes")
	ch, err := sub.Subscribe(context.Background(), e.in+".1")
	require.NoError(t, err)
	m := sagaMessage("x", 0)
	for e.tr.LaneOf(e.in, m) != e.in+".1" {
		m = sagaMessage(uuid.NewString(), 0)
	}
	require.NoError(t, e.tr.Publisher(e.db.SQL).Publish(e.in, m))
	select {
	case got := <-ch:
		assert.Equal(t, m.UUID, got.UUID)
		got.Ack()
	case <-time.After(10 * time.Second):
		t.Fatal("nothing on the lane")
	}
}
