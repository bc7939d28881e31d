package transport_test

import (
	"context"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/steps/transport"
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
