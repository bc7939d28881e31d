package main

import (
	"context"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/internal/testdb"
	"github.com/pgsaga/pgsaga/internal/transport"
)

// consumers drop refuses a group a worker showed alive within --stale
// (exit 1, saying which group, its topics and how long ago), with --yes
// too, and deletes nothing; --force drops it, saying first how many
// messages it would delete (exit 2 without --yes) and then how many it
// deleted. A group no worker showed alive for longer than --stale is
// dropped without --force.
func TestConsumersDropRefusesARunningGroup(t *testing.T) {
	db := testdb.Fresh(t)
	t.Setenv("DATABASE_URL", db.URL)
	ctx := context.Background()
	tr, err := transport.New(transport.Config{DB: db.SQL})
	require.NoError(t, err)
	busy := transport.Subscription{Topic: "busy.topic", ConsumerGroup: "busy-group"}
	idle := transport.Subscription{Topic: "idle.topic", ConsumerGroup: "idle-group"}
	require.NoError(t, tr.Subscribe(ctx, busy, idle))
	for _, topic := range []string{busy.Topic, busy.Topic, busy.Topic, idle.Topic} {
		require.NoError(t, tr.Publisher(db.SQL).Publish(topic, message.NewMessage(uuid.NewString(), []byte("work"))))
	}
	require.NoError(t, tr.Alive(ctx, busy, idle))
	_, err = db.SQL.Exec(`UPDATE pgsaga_subscriptions SET last_seen_at = now() - interval '10 minutes' WHERE consumer_group = 'idle-group'`)
	require.NoError(t, err)
	waiting := func(group string) int {
		var n int
		require.NoError(t, db.SQL.QueryRow(`SELECT count(*) FROM pgsaga_queue WHERE consumer_group = $1`, group).Scan(&n))
		return n
	}

	for _, args := range [][]string{{"consumers", "drop", "busy-group"}, {"consumers", "drop", "busy-group", "--yes"}} {
		code, _, errOut := pgsaga(t, args...)
		assert.Equal(t, exitFailed, code, "%v: %s", args, errOut)
		for _, want := range []string{"busy-group", "busy.topic", "a worker showed it alive", "ago", "--force"} {
			assert.Contains(t, errOut, want, "%v", args)
		}
	}
	assert.Equal(t, 3, waiting("busy-group"), "nothing of a running group is deleted")
	code, out, _ := pgsaga(t, "consumers", "--json")
	require.Equal(t, exitOK, code)
	assert.Contains(t, out, "busy-group")

	code, _, errOut := pgsaga(t, "consumers", "drop", "busy-group", "--force")
	assert.Equal(t, exitUsage, code, errOut)
	assert.Contains(t, errOut, "deletes the 3 messages")
	assert.Equal(t, 3, waiting("busy-group"))
	code, out, errOut = pgsaga(t, "consumers", "drop", "busy-group", "--force", "--yes")
	require.Equal(t, exitOK, code, errOut)
	assert.Contains(t, out, "3 messages deleted")
	assert.Zero(t, waiting("busy-group"))

	code, _, errOut = pgsaga(t, "consumers", "drop", "idle-group", "--stale", "15m", "--yes")
	assert.Equal(t, exitFailed, code, "seen 10m ago, within --stale 15m: %s", errOut)
	assert.Equal(t, 1, waiting("idle-group"))
	code, out, errOut = pgsaga(t, "consumers", "drop", "idle-group", "--yes")
	require.Equal(t, exitOK, code, "not seen for 10m, more than --stale (2m): %s", errOut)
	assert.Contains(t, out, "1 messages deleted")
	code, out, _ = pgsaga(t, "consumers", "--json")
	require.Equal(t, exitOK, code)
	assert.NotContains(t, out, "busy-group")
	assert.NotContains(t, out, "idle-group")
}
