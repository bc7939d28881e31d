package testnats_test

import (
	"context"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/internal/testnats"
)

// With no NATS_URL, each test has a JetStream of its own, started in the
// test's process: the same stream name in two tests is two streams, and a
// test sees one server however often it asks. (A machine's shared server
// used to be every test's, and a test without one skipped.)
func TestEachTestHasAJetStreamOfItsOwn(t *testing.T) {
	t.Setenv("NATS_URL", "")
	seen := map[string]bool{}
	for _, name := range []string{"first", "second"} {
		t.Run(name, func(t *testing.T) {
			url := testnats.URL(t)
			assert.Equal(t, url, testnats.URL(t), "one server a test")
			assert.False(t, seen[url], "a server of the test's own")
			seen[url] = true
			_, js := testnats.Connect(t)
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			stream, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "OWN", Subjects: []string{"own.>"}})
			require.NoError(t, err)
			_, err = js.Publish(ctx, "own.x", []byte("x"))
			require.NoError(t, err)
			info, err := stream.Info(ctx)
			require.NoError(t, err)
			assert.Equal(t, uint64(1), info.State.Msgs, "the stream is this test's alone")
		})
	}
}

// A private server is a process of its own, from the test binary itself
// (no nats-server binary needed): killed, it loses its connections; started
// again on its port and storage, it has the streams it stored.
func TestAPrivateServerIsKilledAndRestarted(t *testing.T) {
	t.Parallel()
	srv := testnats.Private(t)
	nc, js := testnats.ConnectTo(t, srv.URL())
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	_, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "KEPT", Subjects: []string{"kept.>"}, Storage: jetstream.FileStorage})
	require.NoError(t, err)
	_, err = js.Publish(ctx, "kept.x", []byte("x"))
	require.NoError(t, err)
	srv.Stop()
	srv.Start()
	srv.Kill()
	assert.Eventually(t, func() bool { return nc.Status() != nats.CONNECTED }, 10*time.Second, 10*time.Millisecond, "the kill cut the connection")
	srv.Start()
	stream, err := js.Stream(ctx, "KEPT")
	require.NoError(t, err)
	info, err := stream.Info(ctx)
	require.NoError(t, err)
	assert.Equal(t, uint64(1), info.State.Msgs, "stored before the stop, kept across it")
}
