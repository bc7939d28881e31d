package orderpayment_test

import (
	"context"
	"fmt"
	"sort"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/internal/testdb"
	"github.com/pgsaga/pgsaga/saga"
	"github.com/pgsaga/pgsaga/saga/orderpayment"
	"github.com/pgsaga/pgsaga/steps"
)

// placeAndWait places n orders of customer and waits for their sagas; it
// returns their ids and how long each took.
func (e *env) placeAndWait(customer string, n int) ([]uuid.UUID, []time.Duration) {
	e.t.Helper()
	var ids []uuid.UUID
	for range n {
		_, id := e.place(customer, 1_000)
		ids = append(ids, id)
	}
	var took []time.Duration
	for _, id := range ids {
		inst := e.terminal(id)
		took = append(took, inst.UpdatedAt.Sub(inst.CreatedAt))
	}
	sort.Slice(took, func(i, j int) bool { return took[i] < took[j] })
	return ids, took
}

// onlyDelivery sets step deadlines far beyond the tests' waits (60 s per
// saga), so that no re-sent command can finish a saga a stalled delivery
// held up: a stall fails the test instead of costing a deadline. (Checking
// instead that no deadline fired would fail on a machine slow enough to
// take a deadline's time for a hop.)
func onlyDelivery(c *orderpayment.Config) {
	c.Timeouts = orderpayment.StepTimeouts{Deadline: 10 * time.Minute, CompensationDeadline: 10 * time.Minute}
}

// A malformed message on every topic the sample consumes (the projection's
// included: it runs asynchronously here) is dead-lettered in one attempt,
// with the reason, while the sagas around it run as usual: all complete,
// with no step deadline to re-send what a stalled delivery held up.
// Malformed: bytes that are not JSON, JSON of another type, no type at
// all, metadata that is not an object of strings.
func TestMalformedMessagesOnEveryTopicAreDeadLettered(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 1, func(c *orderpayment.Config) {
		onlyDelivery(c)
		c.AsyncProjection = true
	})
	customer := e.customer(1_000_000)
	_, before := e.placeAndWait(customer, 10)

	var topics []string
	for _, s := range e.app.Client.Subscriptions() {
		topics = append(topics, s.Topic)
	}
	require.Len(t, topics, 8, "trigger, charge, refund, confirm, cancel, replies, order events, operator requests")
	var malformed []string
	ctx := context.Background()
	// Rows another writer stored with metadata nobody can read (they wake
	// nobody; the publishes below do).
	for _, s := range e.app.Client.Subscriptions() {
		id := "unreadable-" + s.Topic + "-" + uuid.NewString()[:6]
		_, err := e.db.SQL.ExecContext(ctx, `INSERT INTO pgsaga_queue (topic, consumer_group, uuid, payload, metadata) VALUES ($1, $2, $3, '\x00', '{"type": 1}')`,
			s.Topic, s.ConsumerGroup, id)
		require.NoError(t, err)
		malformed = append(malformed, id)
	}

	for _, topic := range topics {
		for i, m := range []struct {
			payload []byte
			meta    map[string]string
		}{
			{[]byte{0, 0xff, 0xfe, '{'}, map[string]string{steps.MetaType: "orders.OrderCreated", steps.MetaSagaID: uuid.NewString(), "stream_id": "order-x", "stream_version": "1"}},
			{[]byte(`{"hello": "world"}`), map[string]string{steps.MetaType: "nonsense.Type", steps.MetaKey: "k"}},
			{[]byte(`{}`), nil},
		} {
			msg := message.NewMessage(fmt.Sprintf("malformed-%d-%s-%s", i, topic, uuid.NewString()[:6]), m.payload)
			for k, v := range m.meta {
				msg.Metadata.Set(k, v)
			}
			require.NoError(t, e.app.Client.PublishTx(ctx, e.db.SQL, topic, msg))
			malformed = append(malformed, msg.UUID)
		}
	}
	ids, during := e.placeAndWait(customer, 20)
	t.Logf("saga latency before: p50 %s, max %s; alongside the malformed messages: p50 %s, max %s",
		before[len(before)/2], before[len(before)-1], during[len(during)/2], during[len(during)-1])

	waitFor := time.Now().Add(30 * time.Second)
	for {
		var dead int
		require.NoError(t, e.db.SQL.QueryRow(`SELECT count(*) FROM pgsaga_dead_letters WHERE uuid = ANY ($1)`, malformed).Scan(&dead))
		if dead == len(malformed) {
			break
		}
		require.True(t, time.Now().Before(waitFor), "%d of %d malformed messages dead-lettered", dead, len(malformed))
		time.Sleep(20 * time.Millisecond)
	}
	rows, err := e.db.SQL.Query(`SELECT uuid, attempts, reason FROM pgsaga_dead_letters WHERE uuid = ANY ($1)`, malformed)
	require.NoError(t, err)
	defer rows.Close()
	for rows.Next() {
		var id, reason string
		var attempts int
		require.NoError(t, rows.Scan(&id, &attempts, &reason))
		assert.Equal(t, 1, attempts, "%s dead-lettered in one attempt (%s)", id, reason)
		assert.NotEmpty(t, reason)
	}
	require.NoError(t, rows.Err())
	var left int
	require.NoError(t, e.db.SQL.QueryRow(`SELECT count(*) FROM pgsaga_queue WHERE uuid = ANY ($1)`, malformed).Scan(&left))
	assert.Zero(t, left)
	r := e.checkInvariants(ids)
	assert.Equal(t, 20, r.Sagas[saga.StatusCompleted])
}

// A write transaction held open in another database on the same server, for
// as long as the sagas run, does not delay them: they all complete while it
// is still open, with no step deadline to re-send what it held up. (On the
// offset log, none completed until it ended.)
func TestLongTransactionElsewhereDoesNotDelaySagas(t *testing.T) {
	t.Parallel()
	stillOpen := testdb.LongWriteElsewhere(t)

	e := newEnv(t, 1, onlyDelivery)
	ids, took := e.placeAndWait(e.customer(1_000_000), 20)
	t.Logf("saga latency with a write transaction open in another database: p50 %s, max %s", took[len(took)/2], took[len(took)-1])
	assert.True(t, stillOpen(), "the long transaction was open throughout")
	r := e.checkInvariants(ids)
	assert.Equal(t, 20, r.Sagas[saga.StatusCompleted])
}
