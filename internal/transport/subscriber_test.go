package transport_test

import (
	"context"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/internal/testdb"
	"github.com/pgsaga/pgsaga/internal/transport"
)

// receive waits for the next message on ch.
func receive(t *testing.T, ch <-chan *message.Message) *message.Message {
	t.Helper()
	select {
	case msg, ok := <-ch:
		require.True(t, ok, "channel closed")
		return msg
	case <-time.After(20 * time.Second):
		t.Fatal("no message")
		return nil
	}
}

func TestSubscriberRefusesBadInputAndUseAfterClose(t *testing.T) {
	t.Parallel()
	tr, err := transport.New(fastConfig(testdb.Shared(t)))
	require.NoError(t, err)

	_, err = tr.NewSubscriber("")
	require.ErrorIs(t, err, transport.ErrInvalidConsumerGroup)
	_, err = tr.NewSubscriber("g", transport.WithConsumers(0))
	require.ErrorContains(t, err, "consumers must be between 1 and 64")

	sub, err := tr.NewSubscriber("g_" + randomID())
	require.NoError(t, err)
	_, err = sub.Subscribe(context.Background(), "no spaces")
	require.ErrorIs(t, err, transport.ErrInvalidTopic)
	require.ErrorIs(t, sub.SubscribeInitialize(""), transport.ErrInvalidTopic)

	ch, err := sub.Subscribe(context.Background(), "t_"+randomID())
	require.NoError(t, err)
	require.NoError(t, sub.Close())
	_, open := <-ch
	require.False(t, open, "channel open after Close")
	require.NoError(t, sub.Close(), "closing again")
	_, err = sub.Subscribe(context.Background(), "t_"+randomID())
	require.ErrorIs(t, err, transport.ErrSubscriberClosed)
	require.ErrorIs(t, sub.SubscribeInitialize("t_"+randomID()), transport.ErrSubscriberClosed)
}

// A message published before a group's subscription is recorded is not
// queued for it; one published afterwards is, whether or not it consumes.
func TestSubscriberGetsWhatIsPublishedOnceSubscribed(t *testing.T) {
	t.Parallel()
	db := testdb.Shared(t)
	tr, err := transport.New(fastConfig(db))
	require.NoError(t, err)
	ctx := context.Background()
	topic, other, group := "t_"+randomID(), "other", "late_"+randomID()
	require.NoError(t, tr.Subscribe(ctx, transport.Subscription{Topic: topic, ConsumerGroup: other}))
	pub := tr.Publisher(db.SQL)
	before := message.NewMessage(uuid.NewString(), []byte("before"))
	require.NoError(t, pub.Publish(topic, before))

	sub, err := tr.NewSubscriber(group)
	require.NoError(t, err)
	defer func() { require.NoError(t, sub.Close()) }()
	require.NoError(t, sub.SubscribeInitialize(topic))
	after := message.NewMessage(uuid.NewString(), []byte("after"))
	require.NoError(t, pub.Publish(topic, after))

	queued := func(group string) []string {
		rows, err := db.SQL.Query(`SELECT uuid FROM pgsaga_queue WHERE topic = $1 AND consumer_group = $2 ORDER BY id`, topic, group)
		require.NoError(t, err)
		defer rows.Close()
		var ids []string
		for rows.Next() {
			var id string
			require.NoError(t, rows.Scan(&id))
			ids = append(ids, id)
		}
		require.NoError(t, rows.Err())
		return ids
	}
	require.Equal(t, []string{before.UUID, after.UUID}, queued(other))
	require.Equal(t, []string{after.UUID}, queued(group))

	ch, err := sub.Subscribe(ctx, topic)
	require.NoError(t, err)
	msg := receive(t, ch)
	require.Equal(t, after.UUID, msg.UUID)
	msg.Ack()
}

// Each Nack is a failed attempt: the message comes back after its backoff,
// and is dead-lettered after the RetryPolicy's last attempt. The message's
// context carries Subscribe's values and no transaction, and is done once
// the message is answered.
func TestSubscriberNackIsAFailedAttempt(t *testing.T) {
	t.Parallel()
	db := testdb.Shared(t)
	tr, err := transport.New(fastConfig(db))
	require.NoError(t, err)
	topic, group := "t_"+randomID(), "nacker_"+randomID()
	sub, err := tr.NewSubscriber(group, transport.WithRetry(transport.RetryPolicy{MaxAttempts: 2, InitialBackoff: time.Millisecond, MaxBackoff: time.Millisecond}))
	require.NoError(t, err)
	defer func() { require.NoError(t, sub.Close()) }()
	type key struct{}
	ch, err := sub.Subscribe(context.WithValue(context.Background(), key{}, "v"), topic)
	require.NoError(t, err)
	sent := message.NewMessage(uuid.NewString(), []byte("p"))
	sent.Metadata.Set("k", "m")
	require.NoError(t, tr.Publisher(db.SQL).Publish(topic, sent))

	for range 2 {
		msg := receive(t, ch)
		require.Equal(t, sent.UUID, msg.UUID)
		assert.Equal(t, "p", string(msg.Payload))
		assert.Equal(t, message.Metadata{"k": "m"}, msg.Metadata)
		assert.Equal(t, "v", msg.Context().Value(key{}))
		_, hasTx := transport.TxFromContext(msg.Context())
		assert.False(t, hasTx, "a subscriber's message carries no transaction")
		require.NoError(t, msg.Context().Err())
		msg.Nack()
		select {
		case <-msg.Context().Done():
		case <-time.After(20 * time.Second):
			t.Fatal("message context not done after Nack")
		}
	}
	var dead []transport.DeadLetter
	waitFor(t, 20*time.Second, "the dead letter", func() bool {
		dead, err = tr.DeadLetters(context.Background(), transport.DeadLetterFilter{Topic: topic})
		require.NoError(t, err)
		return len(dead) > 0
	})
	require.Len(t, dead, 1)
	assert.Equal(t, sent.UUID, dead[0].UUID)
	assert.Equal(t, group, dead[0].ConsumerGroup)
	assert.Equal(t, 2, dead[0].Attempts)
	assert.Contains(t, dead[0].Reason, "nacked")
}

// Cancelling Subscribe's context stops that subscription only: its
// channel is closed, and the message it had out comes back, to the
// group's next subscription.
func TestSubscriberContextStopsOneSubscription(t *testing.T) {
	t.Parallel()
	db := testdb.Shared(t)
	tr, err := transport.New(fastConfig(db))
	require.NoError(t, err)
	topic, group := "t_"+randomID(), "g_"+randomID()
	sub, err := tr.NewSubscriber(group)
	require.NoError(t, err)
	defer func() { require.NoError(t, sub.Close()) }()
	other, err := sub.Subscribe(context.Background(), "t_"+randomID())
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	ch, err := sub.Subscribe(ctx, topic)
	require.NoError(t, err)
	sent := message.NewMessage(uuid.NewString(), nil)
	require.NoError(t, tr.Publisher(db.SQL).Publish(topic, sent))

	msg := receive(t, ch)
	cancel()
	select {
	case <-msg.Context().Done():
	case <-time.After(20 * time.Second):
		t.Fatal("message context not done after its subscription stopped")
	}
	for range ch {
		t.Fatal("a message after the subscription's context was cancelled")
	}
	msg.Ack() // too late: its attempt has failed

	ch, err = sub.Subscribe(context.Background(), topic)
	require.NoError(t, err)
	again := receive(t, ch)
	require.Equal(t, sent.UUID, again.UUID)
	again.Ack()
	select {
	case _, open := <-other:
		t.Fatalf("the other subscription was disturbed (open=%v)", open)
	default:
	}
}
