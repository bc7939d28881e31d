package transport_test

import (
	"context"
	"encoding/json"
	"fmt"
	"testing"
	"time"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v3/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/internal/testdb"
	"github.com/pgsaga/pgsaga/internal/transport"
)

// BenchmarkConsumer measures one consumer group draining b.N messages. Each
// handler does the same work in every variant: one business insert and one
// outgoing message in the delivery transaction.
//
//   - queue: pgsaga's Router, one consumer (claim with SKIP LOCKED, a
//     savepoint and a deadline per attempt, the commit guard, queued writes
//     sent in one round trip, the message deleted with its batch);
//   - queue-2: the same with two consumers;
//   - bare: watermill-sql v3's offset log as documented, handler on the
//     subscriber's transaction, its publisher on that transaction; no
//     protections, no wake-ups.
//
// Run: go test -run '^$' -bench Consumer -benchtime 5000x ./internal/transport/
func BenchmarkConsumer(b *testing.B) {
	b.Run("queue", func(b *testing.B) { benchConsumer(b, 1) })
	b.Run("queue-2", func(b *testing.B) { benchConsumer(b, 2) })
	b.Run("bare", func(b *testing.B) { benchConsumer(b, 0) })
}

func benchConsumer(b *testing.B, consumers int) {
	db := testdb.Fresh(b)
	ctx := context.Background()
	tr, err := transport.New(transport.Config{DB: db.SQL, Logger: testLogger(), PollInterval: 10 * time.Millisecond, Consumers: max(consumers, 1)})
	require.NoError(b, err)
	batch := tr.Config().BatchSize
	in, out := "bench_in", "bench_out"
	_, err = db.SQL.Exec(`CREATE TABLE bench_effects (msg text NOT NULL, n int NOT NULL)`)
	require.NoError(b, err)

	var pub message.Publisher
	if consumers > 0 {
		require.NoError(b, tr.Subscribe(ctx, transport.Subscription{Topic: in, ConsumerGroup: "g"},
			transport.Subscription{Topic: out, ConsumerGroup: "sink"}))
		pub = tr.Publisher(db.SQL)
	} else {
		pub = barePublisher(b, db.SQL, true)
	}
	for start := 0; start < b.N; start += 1000 {
		msgs := make([]*message.Message, 0, 1000)
		for i := start; i < min(start+1000, b.N); i++ {
			payload, _ := json.Marshal(map[string]int{"n": i})
			msgs = append(msgs, message.NewMessage(fmt.Sprintf("m-%d", i), payload))
		}
		require.NoError(b, pub.Publish(in, msgs...))
	}
	if consumers == 0 {
		require.NoError(b, barePublisher(b, db.SQL, true).Publish(out, message.NewMessage("init", nil)))
	}

	work := func(ctx context.Context, tx transport.Tx, pub message.Publisher, msg *message.Message) error {
		if _, err := tx.ExecContext(ctx, `INSERT INTO bench_effects (msg, n) VALUES ($1, 1)`, msg.UUID); err != nil {
			return err
		}
		return pub.Publish(out, message.NewMessage(replyID(msg), msg.Payload))
	}

	var stop func()
	b.ResetTimer()
	start := time.Now()
	if consumers > 0 {
		r, err := tr.NewRouter()
		require.NoError(b, err)
		require.NoError(b, r.AddHandler("h", in, "g", func(msg *message.Message) error {
			tx, _ := transport.TxFromContext(msg.Context())
			return work(msg.Context(), tx, tr.Publisher(tx), msg)
		}))
		stop = startRouter(b, r)
	} else {
		sub, err := wsql.NewSubscriber(db.SQL, wsql.SubscriberConfig{
			ConsumerGroup:    "g",
			PollInterval:     10 * time.Millisecond,
			InitializeSchema: true,
			SchemaAdapter: wsql.DefaultPostgreSQLSchema{
				GeneratePayloadType: func(string) string { return "BYTEA" },
				SubscribeBatchSize:  batch,
			},
			OffsetsAdapter: wsql.DefaultPostgreSQLOffsetsAdapter{},
		}, nil)
		require.NoError(b, err)
		wr, err := message.NewRouter(message.RouterConfig{}, nil)
		require.NoError(b, err)
		wr.AddConsumerHandler("h", in, sub, func(msg *message.Message) error {
			tx, _ := wsql.TxFromContext(msg.Context())
			return work(msg.Context(), tx, barePublisher(b, tx, false), msg)
		})
		go func() { _ = wr.Run(context.Background()) }()
		<-wr.Running()
		stop = func() { _ = wr.Close() }
	}
	waitFor(b, 10*time.Minute, "all messages consumed", func() bool {
		var n int
		require.NoError(b, db.SQL.QueryRow(`SELECT count(*) FROM bench_effects`).Scan(&n))
		return n >= b.N
	})
	elapsed := time.Since(start)
	b.StopTimer()
	stop()
	b.ReportMetric(float64(b.N)/elapsed.Seconds(), "msgs/s")
	b.ReportMetric(float64(batch), "batch")
}

// barePublisher is watermill-sql's own publisher on tx, with BYTEA payloads.
func barePublisher(tb testing.TB, tx wsql.ContextExecutor, initialize bool) message.Publisher {
	pub, err := wsql.NewPublisher(tx, wsql.PublisherConfig{AutoInitializeSchema: initialize, SchemaAdapter: wsql.DefaultPostgreSQLSchema{
		GeneratePayloadType: func(string) string { return "BYTEA" },
	}}, nil)
	require.NoError(tb, err)
	return pub
}
