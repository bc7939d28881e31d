package transport_test

import (
	"context"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/internal/transport"
)

// Departed tells a message that still waits in this database (for the
// relay to a broker, or untouched by every local group of its topic) from
// one that has left: what a saga's reply deadline counts from.
func TestDepartedTellsWaitingFromTaken(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	ctx := context.Background()
	db := e.db.SQL
	departed := func(topic, id string) bool {
		t.Helper()
		ok, err := e.tr.Departed(ctx, db, topic, id)
		require.NoError(t, err)
		return ok
	}
	publish := func(topic string) string {
		t.Helper()
		m := message.NewMessage(uuid.NewString(), []byte(`{}`))
		require.NoError(t, e.tr.Publisher(db).Publish(topic, m))
		return m.UUID
	}
	exec := func(q string, args ...any) {
		t.Helper()
		_, err := db.ExecContext(ctx, q, args...)
		require.NoError(t, err)
	}

	// Two local groups: it waits until one of them takes it.
	local := "local_" + e.id
	require.NoError(t, e.tr.Subscribe(ctx, transport.Subscription{Topic: local, ConsumerGroup: "g1"},
		transport.Subscription{Topic: local, ConsumerGroup: "g2"}))
	for name, take := range map[string]string{
		"handled":          `DELETE FROM pgsaga_queue WHERE topic = $1 AND uuid = $2 AND consumer_group = 'g1'`,
		"attempted":        `UPDATE pgsaga_queue SET attempts = 1 WHERE topic = $1 AND uuid = $2 AND consumer_group = 'g2'`,
		"parked in a call": `UPDATE pgsaga_queue SET metadata = metadata || '{"_pgsaga_awaited": "1"}' WHERE topic = $1 AND uuid = $2 AND consumer_group = 'g1'`,
	} {
		id := publish(local)
		assert.False(t, departed(local, id), "%s: queued for both groups, untouched", name)
		exec(take, local, id)
		assert.True(t, departed(local, id), "%s: one group took it", name)
	}
	// Another message of the topic taken says nothing of this one.
	waiting, other := publish(local), publish(local)
	exec(`DELETE FROM pgsaga_queue WHERE topic = $1 AND uuid = $2`, local, other)
	assert.False(t, departed(local, waiting))

	// Queued for the relay to a broker: it waits until the relay publishes
	// it, whatever the local groups did.
	relayed := "relayed_" + e.id
	require.NoError(t, e.tr.Subscribe(ctx, transport.Subscription{Topic: relayed, ConsumerGroup: transport.RelayGroup},
		transport.Subscription{Topic: relayed, ConsumerGroup: "g1"}))
	id := publish(relayed)
	exec(`DELETE FROM pgsaga_queue WHERE topic = $1 AND uuid = $2 AND consumer_group = 'g1'`, relayed, id)
	assert.False(t, departed(relayed, id), "the relay has not published it")
	batch, err := e.tr.ClaimRelay(ctx, relayed, 10)
	require.NoError(t, err)
	require.Len(t, batch.Messages, 1)
	batch.Relayed(0)
	require.NoError(t, batch.Commit())
	assert.True(t, departed(relayed, id), "published to the broker")

	// A message nothing was queued for (no group: dead-lettered at once;
	// or an unknown id) waits nowhere here.
	assert.True(t, departed("nobody_"+e.id, publish("nobody_"+e.id)))
	assert.True(t, departed(local, uuid.NewString()))
}

// A message of a relayed topic has left once the relay published it, even
// if a local group of the topic (an archive, a projection nobody runs)
// has not taken its copy: the participant is beyond the broker. (It was
// still waiting: a saga whose participant took the command and never
// answered waited for its own deadline, 24 hours, not for its step's.)
func TestDepartedOnceRelayedWhateverTheLocalGroups(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	ctx := context.Background()
	topic := "relayed_" + e.id
	require.NoError(t, e.tr.Subscribe(ctx, transport.Subscription{Topic: topic, ConsumerGroup: transport.RelayGroup},
		transport.Subscription{Topic: topic, ConsumerGroup: "archive"}))
	m := message.NewMessage(uuid.NewString(), []byte(`{}`))
	require.NoError(t, e.tr.Publisher(e.db.SQL).Publish(topic, m))
	departed, err := e.tr.Departed(ctx, e.db.SQL, topic, m.UUID)
	require.NoError(t, err)
	assert.False(t, departed, "the relay has not published it")

	batch, err := e.tr.ClaimRelay(ctx, topic, 10)
	require.NoError(t, err)
	require.Len(t, batch.Messages, 1)
	batch.Relayed(0)
	require.NoError(t, batch.Commit())
	departed, err = e.tr.Departed(ctx, e.db.SQL, topic, m.UUID)
	require.NoError(t, err)
	assert.True(t, departed, "published to the broker; the archive's copy says nothing of the participant")
}
