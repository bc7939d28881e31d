package transport_test

import (
	"context"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/internal/testdb"
	"github.com/pgsaga/pgsaga/internal/transport"
)

// groupOf finds a group's figures.
func groupOf(t *testing.T, e *env, topic, group string) transport.GroupStats {
	t.Helper()
	all, err := e.tr.ConsumerGroups(context.Background())
	require.NoError(t, err)
	for _, g := range all {
		if g.Topic == topic && g.ConsumerGroup == group {
			return g
		}
	}
	t.Fatalf("group %s of %s not listed", group, topic)
	return transport.GroupStats{}
}

// ConsumerGroups tells each group's depth (waiting, of which retrying or
// parked), the age of its oldest message, and when a running router last
// showed it alive: a group that was only set up (Subscribe) was never
// seen running, and a running router's heartbeat moves its time on.
func TestConsumerGroupsTellDepthAgeAndLiveness(t *testing.T) {
	t.Parallel()
	e := newEnv(t, func(c *transport.Config) { c.HeartbeatInterval = 20 * time.Millisecond })
	e.publish(3)
	_, err := e.db.SQL.Exec(`UPDATE pgsaga_queue SET attempts = 1, available_at = now() + interval '1 hour'
		WHERE id = (SELECT min(id) FROM pgsaga_queue WHERE topic = $1)`, e.in)
	require.NoError(t, err)

	g := groupOf(t, e, e.in, "g")
	assert.Equal(t, 3, g.Waiting)
	assert.Equal(t, 1, g.Retrying)
	assert.Equal(t, 1, g.NotYetAvailable)
	assert.NotNil(t, g.Oldest)
	assert.Nil(t, g.LastSeen, "set up, never seen running")
	archive := groupOf(t, e, e.out, "archive")
	assert.Zero(t, archive.Waiting)
	assert.Nil(t, archive.Oldest)

	r, err := e.tr.NewRouter()
	require.NoError(t, err)
	require.NoError(t, r.AddHandler("h", e.in, "g", func(*message.Message) error { return nil }))
	startRouter(t, r)
	first := groupOf(t, e, e.in, "g").LastSeen
	require.NotNil(t, first, "a running router shows its group alive")
	waitFor(t, 10*time.Second, "a heartbeat", func() bool {
		seen := groupOf(t, e, e.in, "g").LastSeen
		return seen != nil && seen.After(*first)
	})
}

// DropConsumerGroups refuses a group a router showed alive within the
// window on any of the topics it drops (nothing is dropped then, the error
// says which topics and when), and drops the others with their queues: of
// one topic, of every topic, or, with no window, even a running one.
func TestDropConsumerGroupsRefusesAGroupSeenAlive(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	ctx := context.Background()
	other := "other_" + e.id
	group := "drop_" + e.id
	in, out := transport.Subscription{Topic: e.in, ConsumerGroup: group}, transport.Subscription{Topic: other, ConsumerGroup: group}
	require.NoError(t, e.tr.Subscribe(ctx, in, out))
	e.publish(3)
	require.NoError(t, e.tr.Publisher(e.db.SQL).Publish(other, message.NewMessage("o-"+e.id, nil)))
	require.NoError(t, e.tr.Alive(ctx, in))

	_, err := e.tr.DropConsumerGroups(ctx, transport.GroupDrop{ConsumerGroup: group, UnlessSeenWithin: time.Minute})
	require.ErrorIs(t, err, transport.ErrConsumerGroupAlive)
	var alive *transport.ConsumerGroupAliveError
	require.ErrorAs(t, err, &alive)
	assert.Equal(t, group, alive.ConsumerGroup)
	assert.Equal(t, []string{e.in}, alive.Topics)
	assert.WithinDuration(t, time.Now(), alive.LastSeen, 30*time.Second)
	assert.GreaterOrEqual(t, alive.Ago, time.Duration(0))
	assert.Less(t, alive.Ago, time.Minute)
	assert.Contains(t, err.Error(), "ago")
	assert.Equal(t, 3, e.waiting(e.in, group), "nothing dropped")
	assert.Equal(t, 1, e.waiting(other, group), "nothing dropped, of no topic")

	dropped, err := e.tr.DropConsumerGroups(ctx, transport.GroupDrop{ConsumerGroup: group, Topic: other, UnlessSeenWithin: time.Minute})
	require.NoError(t, err, "never seen running on that topic")
	assert.Equal(t, []transport.DroppedGroup{{Topic: other, Messages: 1}}, dropped)
	assert.Equal(t, 3, e.waiting(e.in, group))

	_, err = e.db.SQL.Exec(`UPDATE pgsaga_subscriptions SET last_seen_at = now() - interval '2 minutes' WHERE topic = $1 AND consumer_group = $2`, e.in, group)
	require.NoError(t, err)
	_, err = e.tr.DropConsumerGroups(ctx, transport.GroupDrop{ConsumerGroup: group, UnlessSeenWithin: 3 * time.Minute})
	require.ErrorIs(t, err, transport.ErrConsumerGroupAlive, "seen 2 minutes ago, within 3")
	dropped, err = e.tr.DropConsumerGroups(ctx, transport.GroupDrop{ConsumerGroup: group, UnlessSeenWithin: time.Minute})
	require.NoError(t, err, "seen 2 minutes ago, not within 1")
	assert.Equal(t, []transport.DroppedGroup{{Topic: e.in, Messages: 3}}, dropped)
	assert.Zero(t, e.waiting(e.in, group))

	require.NoError(t, e.tr.Alive(ctx, transport.Subscription{Topic: e.out, ConsumerGroup: "archive"}))
	require.NoError(t, e.tr.Publisher(e.db.SQL).Publish(e.out, message.NewMessage("a-"+e.id, nil)))
	dropped, err = e.tr.DropConsumerGroups(ctx, transport.GroupDrop{ConsumerGroup: "archive", Topic: e.out})
	require.NoError(t, err, "no window: dropped though it runs")
	assert.Equal(t, []transport.DroppedGroup{{Topic: e.out, Messages: 1}}, dropped)

	_, err = e.tr.DropConsumerGroups(ctx, transport.GroupDrop{ConsumerGroup: group, UnlessSeenWithin: time.Minute})
	require.ErrorIs(t, err, transport.ErrNoSuchConsumerGroup)
	_, err = e.tr.DropConsumerGroups(ctx, transport.GroupDrop{ConsumerGroup: "bad group"})
	require.ErrorIs(t, err, transport.ErrInvalidConsumerGroup)
}

// A heartbeat in flight when DropConsumerGroups looks at the group (its
// transaction has shown the group alive, not yet committed) is waited for,
// and counts: the group is not dropped. Read without the lock, the group's
// last heartbeat would look an hour old, and the drop would go ahead.
func TestDropConsumerGroupsWaitsForAHeartbeatInFlight(t *testing.T) {
	t.Parallel()
	e := newEnvOn(t, testdb.Fresh(t), nil)
	ctx := context.Background()
	e.publish(2)
	_, err := e.db.SQL.Exec(`UPDATE pgsaga_subscriptions SET last_seen_at = now() - interval '1 hour' WHERE topic = $1 AND consumer_group = 'g'`, e.in)
	require.NoError(t, err)
	heartbeat, err := e.db.SQL.BeginTx(ctx, nil)
	require.NoError(t, err)
	defer heartbeat.Rollback() //nolint:errcheck // committed below
	_, err = heartbeat.Exec(`UPDATE pgsaga_subscriptions SET last_seen_at = clock_timestamp() WHERE topic = $1 AND consumer_group = 'g'`, e.in)
	require.NoError(t, err)

	done := make(chan error, 1)
	go func() {
		_, err := e.tr.DropConsumerGroups(ctx, transport.GroupDrop{ConsumerGroup: "g", Topic: e.in, UnlessSeenWithin: time.Minute})
		done <- err
	}()
	waitFor(t, 30*time.Second, "the drop to wait for the heartbeat", func() bool {
		return e.count(`SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'`) > 0
	})
	require.NoError(t, heartbeat.Commit())
	err = <-done
	require.ErrorIs(t, err, transport.ErrConsumerGroupAlive)
	assert.Equal(t, 2, e.waiting(e.in, "g"))
}
