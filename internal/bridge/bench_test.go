package bridge_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/internal/testdb"
	"github.com/pgsaga/pgsaga/internal/testnats"
	"github.com/pgsaga/pgsaga/steps/broker"
	"github.com/pgsaga/pgsaga/steps/broker/natsjs"
)

// One message at a time through the relay: committed in the database to
// stored by the stream (the relay woken by the commit's notification).
// ns/op is the hop's latency.
func BenchmarkRelayHop(b *testing.B) {
	f := newFixture(b, testnats.URL(b), testdb.Shared(b))
	f.bridge(broker.Config{Relay: []string{f.topic}})
	ctx := context.Background()
	stream, err := f.js.Stream(ctx, natsjs.StreamName(f.topic))
	require.NoError(b, err)
	b.ResetTimer()
	for i := range b.N {
		msg := message.NewMessage(uuid.NewString(), fmt.Appendf(nil, `{"i":%d}`, i))
		tx, err := f.db.SQL.Begin()
		require.NoError(b, err)
		require.NoError(b, f.tr.Publisher(tx).Publish(f.topic, msg))
		require.NoError(b, tx.Commit())
		for {
			info, err := stream.Info(ctx)
			require.NoError(b, err)
			if int(info.State.Msgs) == i+1 {
				break
			}
			time.Sleep(100 * time.Microsecond)
		}
	}
}

// One message at a time from the broker to a handler here: published to
// the stream to handled by a router handler of this database (the
// bridge's queue insert and the consumer's wake-up between).
func BenchmarkReceiveHop(b *testing.B) {
	f := newFixture(b, testnats.URL(b), testdb.Shared(b))
	c := newCollector()
	f.consume(f.topic, "local", c)
	f.bridge(broker.Config{Receive: []string{f.topic}, Group: "g" + randomID()})
	ctx := context.Background()
	b.ResetTimer()
	for i := range b.N {
		msg := message.NewMessage(uuid.NewString(), fmt.Appendf(nil, `{"i":%d}`, i))
		require.NoError(b, f.br.Publish(ctx, f.topic, msg))
		c.wait(b, i+1)
	}
}

// One publish to the stream, acknowledged: the broker's share of a hop.
func BenchmarkPublish(b *testing.B) {
	f := newFixture(b, testnats.URL(b), testdb.Shared(b))
	ctx := context.Background()
	require.NoError(b, f.br.Provision(ctx, f.topic))
	b.ResetTimer()
	for i := range b.N {
		require.NoError(b, f.br.Publish(ctx, f.topic, message.NewMessage(uuid.NewString(), fmt.Appendf(nil, `{"i":%d}`, i))))
	}
}

// One message at a time through a queue of this database, no broker:
// the baseline of the hops above.
func BenchmarkLocalHop(b *testing.B) {
	f := newFixture(b, testnats.URL(b), testdb.Shared(b))
	c := newCollector()
	f.consume(f.topic, "local", c)
	b.ResetTimer()
	for i := range b.N {
		msg := message.NewMessage(uuid.NewString(), fmt.Appendf(nil, `{"i":%d}`, i))
		tx, err := f.db.SQL.Begin()
		require.NoError(b, err)
		require.NoError(b, f.tr.Publisher(tx).Publish(f.topic, msg))
		require.NoError(b, tx.Commit())
		c.wait(b, i+1)
	}
}
