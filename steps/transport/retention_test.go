package transport_test

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/internal/testdb"
	"github.com/pgsaga/pgsaga/steps/transport"
)

// positions lists the positions of topic's messages, in order.
func (e *env) positions(topic string) [][2]int64 {
	e.t.Helper()
	rows, err := e.db.SQL.Query(`SELECT transaction_id::text::bigint, "offset" FROM ` + e.tr.MessagesTable(topic) + ` ORDER BY transaction_id, "offset"`)
	require.NoError(e.t, err)
	defer rows.Close()
	var out [][2]int64
	for rows.Next() {
		var p [2]int64
		require.NoError(e.t, rows.Scan(&p[0], &p[1]))
		out = append(out, p)
	}
	return out
}

// setPosition puts group's offset on topic at position p, as a subscriber
// that handled everything up to it would.
func (e *env) setPosition(topic, group string, p [2]int64) {
	e.t.Helper()
	_, err := e.db.SQL.Exec(`INSERT INTO `+e.tr.OffsetsTable(topic)+` (consumer_group, offset_acked, last_processed_transaction_id)
		VALUES ($1, $2, $3::bigint::text::xid8)
		ON CONFLICT (consumer_group) DO UPDATE SET offset_acked = excluded.offset_acked,
			last_processed_transaction_id = excluded.last_processed_transaction_id`, group, p[1], p[0])
	require.NoError(e.t, err)
}

// Retention deletes exactly the messages every consumer group has passed,
// in batches, and nothing from a topic nobody consumes.
func TestRetentionDeletesWhatEveryGroupPassed(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	for range 10 {
		e.publish(1) // ten transactions
	}
	e.publish(5) // and one with five
	pos := e.positions(e.in)
	require.Len(t, pos, 15)
	e.setPosition(e.in, "fast", pos[14])
	e.setPosition(e.in, "slow", pos[3])
	r, err := e.tr.NewRetention(transport.RetentionConfig{Topics: []string{e.in, e.out}, BatchSize: 3})
	require.NoError(t, err)
	res, err := r.RunOnce(context.Background())
	require.NoError(t, err)
	assert.Equal(t, 4, res.Deleted, "what the slow group passed")
	assert.Equal(t, 11, e.messagesIn(e.in))
	assert.Equal(t, pos[4:], e.positions(e.in), "the oldest went")

	e.setPosition(e.in, "slow", pos[11]) // inside the five-message transaction
	res, err = r.RunOnce(context.Background())
	require.NoError(t, err)
	assert.Equal(t, 8, res.Deleted)
	assert.GreaterOrEqual(t, res.Batches, 3, "in batches of three")
	assert.Equal(t, 3, e.messagesIn(e.in), "the rest of that transaction stays")

	// A group that stopped for good holds the topic back until dropped.
	require.NoError(t, e.tr.DropConsumerGroup(context.Background(), e.in, "slow"))
	res, err = r.RunOnce(context.Background())
	require.NoError(t, err)
	assert.Equal(t, 3, res.Deleted)
	assert.Zero(t, e.messagesIn(e.in))

	// Nobody consumes out: nothing is deleted.
	require.NoError(t, e.tr.Publisher(e.db.SQL).Publish(e.out, message.NewMessage("kept", nil)))
	res, err = r.RunOnce(context.Background())
	require.NoError(t, err)
	assert.Zero(t, res.Deleted)
	assert.Equal(t, 1, e.messagesIn(e.out))
}

// MinAge keeps consumed messages for a while.
func TestRetentionMinAge(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	e.publish(3)
	e.setPosition(e.in, "g", e.positions(e.in)[2])
	r, err := e.tr.NewRetention(transport.RetentionConfig{Topics: []string{e.in}, MinAge: time.Hour})
	require.NoError(t, err)
	res, err := r.RunOnce(context.Background())
	require.NoError(t, err)
	assert.Zero(t, res.Deleted)
	_, err = e.db.SQL.Exec(`UPDATE ` + e.tr.MessagesTable(e.in) + ` SET created_at = created_at - interval '2 hours'`)
	require.NoError(t, err)
	res, err = r.RunOnce(context.Background())
	require.NoError(t, err)
	assert.Equal(t, 3, res.Deleted)
}

// While a router consumes a laned topic and several retentions run at
// once, every message is still handled exactly once and the consumed ones
// go; by default a retention covers every recorded topic and lane (so this
// test has a database of its own).
func TestRetentionUnderTrafficFromSeveralProcesses(t *testing.T) {
	t.Parallel()
	e := newEnvOn(t, testdb.Fresh(t), func(c *transport.Config) { c.Lanes = 3 })
	var handled atomic.Int32
	seen := sync.Map{}
	r, err := e.tr.NewRouter()
	require.NoError(t, err)
	require.NoError(t, r.AddHandler("h", e.in, "g", func(msg *message.Message) error {
		if _, dup := seen.LoadOrStore(msg.UUID, true); dup {
			t.Errorf("message %s handled twice", msg.UUID)
		}
		handled.Add(1)
		return nil
	}))
	startRouter(t, r)
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	for range 3 {
		ret, err := e.tr.NewRetention(transport.RetentionConfig{BatchSize: 7, Interval: 5 * time.Millisecond})
		require.NoError(t, err)
		wg.Go(func() { _ = ret.Run(ctx) })
	}
	const total = 600
	for range total / 50 {
		e.publish(50)
	}
	waitFor(t, 30*time.Second, "every message handled", func() bool { return handled.Load() == total })
	waitFor(t, 30*time.Second, "every consumed message deleted", func() bool {
		return e.count(`SELECT count(*) FROM `+e.tr.MessagesFrom(e.in, "m")) == 0
	})
	cancel()
	wg.Wait()
	assert.Equal(t, int32(total), handled.Load())
}

func TestRetentionConfig(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	for _, cfg := range []transport.RetentionConfig{
		{BatchSize: -1},
		{MinAge: -time.Second},
		{Topics: []string{"bad topic"}},
	} {
		_, err := e.tr.NewRetention(cfg)
		require.Error(t, err, "%+v", cfg)
	}
}
