package steps_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v3/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/idempotency"
	"github.com/pgsaga/pgsaga/internal/stepsrt"
	"github.com/pgsaga/pgsaga/internal/testdb"
	"github.com/pgsaga/pgsaga/internal/transport"
	"github.com/pgsaga/pgsaga/steps"
)

// BenchmarkStep drains b.N commands with one consumer. Every variant does
// the same business work per command: one insert and one reply message.
//
//   - bare: watermill-sql v3's offset log as documented, handler on the
//     subscriber's transaction, its publisher on that transaction; no
//     protections, no wake-ups, no idempotency;
//   - transport: pgsaga's Router (queue claim, savepoint and deadline per
//     attempt, commit guard, queued writes);
//   - runtime: the full step runtime (decode, idempotency claim, handler,
//     reply, completion) on the Router.
//
// Run: go test -run '^$' -bench Step -benchtime 5000x ./steps/
func BenchmarkStep(b *testing.B) {
	for _, variant := range []string{"bare", "transport", "runtime"} {
		b.Run(variant, func(b *testing.B) { benchStepLane(b, variant) })
	}
}

func benchStepLane(b *testing.B, variant string) {
	db := testdb.Fresh(b)
	ctx := context.Background()
	tr, err := transport.New(transport.Config{DB: db.SQL, Logger: logger(), PollInterval: 10 * time.Millisecond})
	require.NoError(b, err)
	store, err := idempotency.NewStore(idempotency.Config{DB: db.SQL})
	require.NoError(b, err)
	rt, err := stepsrt.New(stepsrt.Config{Transport: tr, Store: store, Logger: logger()})
	require.NoError(b, err)
	cmds, replies := "bench_cmds", "bench_replies"
	_, err = db.SQL.Exec(`CREATE TABLE bench_ledger (account text, amount int)`)
	require.NoError(b, err)
	pubIn := tr.Publisher(db.SQL)
	if variant == "bare" {
		pubIn = barePublisher(b, db.SQL, true)
		require.NoError(b, pubIn.Publish(replies, message.NewMessage("init", nil)))
	} else {
		require.NoError(b, tr.Subscribe(ctx, transport.Subscription{Topic: cmds, ConsumerGroup: "h"},
			transport.Subscription{Topic: replies, ConsumerGroup: "sink"}))
	}

	for start := 0; start < b.N; start += 1000 {
		var msgs []*message.Message
		for i := start; i < min(start+1000, b.N); i++ {
			m, err := steps.NewMessage(addCmd{Account: fmt.Sprint("a", i), Amount: i}, steps.Envelope{Key: fmt.Sprint("k", i), ReplyTo: replies})
			require.NoError(b, err)
			msgs = append(msgs, m)
		}
		require.NoError(b, pubIn.Publish(cmds, msgs...))
	}

	// The business work, the same in every variant.
	work := func(ctx context.Context, tx transport.Tx, cmd addCmd) (steps.Message, error) {
		_, err := tx.ExecContext(ctx, `INSERT INTO bench_ledger VALUES ($1, $2)`, cmd.Account, cmd.Amount)
		return added{Account: cmd.Account, Total: cmd.Amount}, err
	}
	plain := func(tx transport.Tx, pub message.Publisher, msg *message.Message) error {
		cmd, err := steps.Decode[addCmd](msg)
		if err != nil {
			return err
		}
		reply, err := work(msg.Context(), tx, cmd)
		if err != nil {
			return err
		}
		out, err := steps.NewMessage(reply, steps.Envelope{})
		if err != nil {
			return err
		}
		return pub.Publish(replies, out)
	}

	b.ResetTimer()
	start := time.Now()
	var stop func() error
	switch variant {
	case "bare":
		sub, err := wsql.NewSubscriber(db.SQL, wsql.SubscriberConfig{
			ConsumerGroup: "g", PollInterval: 10 * time.Millisecond, InitializeSchema: true,
			SchemaAdapter:  wsql.DefaultPostgreSQLSchema{GeneratePayloadType: func(string) string { return "BYTEA" }, SubscribeBatchSize: tr.Config().BatchSize},
			OffsetsAdapter: wsql.DefaultPostgreSQLOffsetsAdapter{},
		}, nil)
		require.NoError(b, err)
		wr, err := message.NewRouter(message.RouterConfig{}, nil)
		require.NoError(b, err)
		wr.AddConsumerHandler("h", cmds, sub, func(msg *message.Message) error {
			tx, _ := wsql.TxFromContext(msg.Context())
			return plain(tx, barePublisher(b, tx, false), msg)
		})
		go func() { _ = wr.Run(ctx) }()
		<-wr.Running()
		stop = wr.Close
	default:
		r, err := tr.NewRouter()
		require.NoError(b, err)
		if variant == "transport" {
			require.NoError(b, r.AddHandler("h", cmds, "h", func(msg *message.Message) error {
				tx, _ := transport.TxFromContext(msg.Context())
				return plain(tx, tr.Publisher(tx), msg)
			}))
		} else {
			require.NoError(b, rt.Register(r, steps.Define("h", cmds, func(ctx context.Context, tx *steps.Tx, cmd addCmd) (steps.Message, error) {
				return work(ctx, tx, cmd)
			})))
		}
		go func() { _ = r.Run(ctx) }()
		<-r.Running()
		stop = r.Close
	}
	deadline := time.Now().Add(10 * time.Minute)
	for {
		var n int
		require.NoError(b, db.SQL.QueryRow(`SELECT count(*) FROM bench_ledger`).Scan(&n))
		if n >= b.N {
			break
		}
		require.True(b, time.Now().Before(deadline), "not drained")
		time.Sleep(5 * time.Millisecond)
	}
	elapsed := time.Since(start)
	b.StopTimer()
	require.NoError(b, stop())
	b.ReportMetric(float64(b.N)/elapsed.Seconds(), "msgs/s")
}

// barePublisher is watermill-sql's own publisher on tx, with BYTEA payloads.
func barePublisher(tb testing.TB, tx wsql.ContextExecutor, initialize bool) message.Publisher {
	pub, err := wsql.NewPublisher(tx, wsql.PublisherConfig{AutoInitializeSchema: initialize, SchemaAdapter: wsql.DefaultPostgreSQLSchema{
		GeneratePayloadType: func(string) string { return "BYTEA" },
	}}, nil)
	require.NoError(tb, err)
	return pub
}
