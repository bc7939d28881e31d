package testnats_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/internal/testnats"
)

// What the relay to JetStream relies on (issue 17): a publish carrying a
// Nats-Msg-Id already seen within the stream's duplicate window is
// acknowledged as a duplicate and stored once; past the window it is
// stored again.
func TestJetStreamDeduplicatesByMessageID(t *testing.T) {
	t.Parallel()
	_, js := testnats.Connect(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	name := fmt.Sprintf("PGSAGA_FACTS_%d", time.Now().UnixNano())
	const window = 500 * time.Millisecond
	stream, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: name, Subjects: []string{name + ".>"}, Duplicates: window, Storage: jetstream.MemoryStorage})
	require.NoError(t, err)
	t.Cleanup(func() { _ = js.DeleteStream(context.Background(), name) })

	publish := func(id string) *jetstream.PubAck {
		msg := nats.NewMsg(name + ".events")
		msg.Data = []byte("payload")
		msg.Header.Set(jetstream.MsgIDHeader, id)
		ack, err := js.PublishMsg(ctx, msg)
		require.NoError(t, err)
		return ack
	}
	first := publish("uuid-1")
	again := publish("uuid-1")
	assert.False(t, first.Duplicate)
	assert.True(t, again.Duplicate, "the same id within the window is a duplicate")
	assert.Equal(t, first.Sequence, again.Sequence, "acknowledged with the stored message's sequence")
	info, err := stream.Info(ctx)
	require.NoError(t, err)
	assert.Equal(t, uint64(1), info.State.Msgs, "stored once")

	// Past the window the id is forgotten: a late copy is stored again.
	deadline := time.Now().Add(20 * time.Second)
	for {
		if late := publish("uuid-1"); !late.Duplicate {
			break
		}
		require.True(t, time.Now().Before(deadline), "the duplicate window never ended")
		time.Sleep(window / 4) // the window is time itself: this waits for it to pass
	}
	info, err = stream.Info(ctx)
	require.NoError(t, err)
	assert.Equal(t, uint64(2), info.State.Msgs, "a copy past the window is a second message")
}
