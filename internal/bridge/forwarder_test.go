package bridge_test

import (
	"context"
	"errors"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/components/forwarder"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/internal/testdb"
	"github.com/pgsaga/pgsaga/internal/testnats"
	"github.com/pgsaga/pgsaga/internal/transport"
)

// Why the relay is not Watermill's forwarder (docs/DESIGN.md, 8a): run on
// pgsaga's queue, the forwarder's failed publish is a failed delivery
// attempt, retried after a backoff while the messages after it go on, so
// one publish the broker misses reorders the stream. The relay's test of
// the same failure keeps the order (TestRelayStopsAtAFailedPublish).
func TestForwarderOnTheQueueReorders(t *testing.T) {
	t.Parallel()
	f := newFixture(t, testnats.URL(t), testdb.Shared(t))
	ctx := context.Background()
	require.NoError(t, f.br.Provision(ctx, f.topic))
	fwdTopic := "pgsagatest." + randomID() + ".forwarder"
	require.NoError(t, f.tr.Subscribe(ctx, transport.Subscription{Topic: fwdTopic, ConsumerGroup: "forwarder"}))

	msgs := make([]*message.Message, 10)
	ids := make([]string, len(msgs))
	tx, err := f.db.SQL.Begin()
	require.NoError(t, err)
	out := forwarder.NewPublisher(f.tr.Publisher(tx), forwarder.PublisherConfig{ForwarderTopic: fwdTopic})
	for i := range msgs {
		msgs[i] = message.NewMessage(uuid.NewString(), []byte("{}"))
		ids[i] = msgs[i].UUID
		require.NoError(t, out.Publish(f.topic, msgs[i]))
	}
	require.NoError(t, tx.Commit())

	sub, err := f.tr.NewSubscriber("forwarder")
	require.NoError(t, err)
	var once sync.Once
	pub := publishFunc(func(topic string, m *message.Message) error {
		var fail bool
		if m.UUID == ids[1] {
			once.Do(func() { fail = true })
		}
		if fail {
			return errors.New("injected: the broker did not answer")
		}
		return f.br.Publish(ctx, topic, m)
	})
	fwd, err := forwarder.NewForwarder(sub, pub, watermill.NopLogger{}, forwarder.Config{ForwarderTopic: fwdTopic, CloseTimeout: 10 * time.Second})
	require.NoError(t, err)
	go func() { _ = fwd.Run(ctx) }()
	t.Cleanup(func() { _ = fwd.Close(); _ = sub.Close() })

	got := f.stored(f.topic, len(ids))
	assert.ElementsMatch(t, ids, got, "every message arrives")
	assert.Greater(t, slices.Index(got, ids[1]), slices.Index(got, ids[2]), "the message whose publish failed arrives after the one queued behind it: %v", got)
}

type publishFunc func(topic string, msg *message.Message) error

func (p publishFunc) Publish(topic string, msgs ...*message.Message) error {
	for _, m := range msgs {
		if err := p(topic, m); err != nil {
			return err
		}
	}
	return nil
}

func (publishFunc) Close() error { return nil }
