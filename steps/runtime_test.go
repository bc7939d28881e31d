package steps_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/idempotency"
	"github.com/pgsaga/pgsaga/internal/stepsrt"
	"github.com/pgsaga/pgsaga/internal/testdb"
	"github.com/pgsaga/pgsaga/internal/testout"
	"github.com/pgsaga/pgsaga/internal/testpg"
	"github.com/pgsaga/pgsaga/internal/transport"
	"github.com/pgsaga/pgsaga/steps"
	"github.com/pgsaga/pgsaga/steps/events"
)

func TestMain(m *testing.M) { testpg.Main(m) }

// The test step: add an amount to an account's ledger.
type addCmd struct {
	Account string `json:"account"`
	Amount  int    `json:"amount"`
}

func (addCmd) MessageType() string { return "test.Add" }

type added struct {
	Account string `json:"account"`
	Total   int    `json:"total"`
}

func (added) MessageType() string { return "test.Added" }

type refused struct {
	Why string `json:"why"`
}

func (refused) MessageType() string { return "test.Refused" }

type noted struct {
	Amount int `json:"amount"`
}

func (noted) MessageType() string { return "test.Noted" }

// logger is the tests' logger (PGSAGA_TEST_LOG shows it).
var logger = testout.Logger

// env is one test's world: its topics, its ledger table, a runtime, and the
// test step.
type env struct {
	t       *testing.T
	db      *testdb.DB
	tr      *transport.Transport
	rt      stepsrt.Runtime
	es      *events.Store
	step    steps.AnyStep
	id      string
	cmds    string
	replies string
	events  string
	ledger  string

	mu       sync.Mutex
	attempts map[string]int // per account
	failN    int            // amount 0 fails transiently this many attempts
}

func newEnv(t *testing.T) *env {
	t.Helper()
	db := testdb.Shared(t)
	id := uuid.NewString()[:8]
	e := &env{t: t, db: db, id: id, cmds: "cmds_" + id, replies: "replies_" + id, events: "events_" + id,
		ledger: "ledger_" + id, attempts: map[string]int{}, failN: 2}
	tr, err := transport.New(transport.Config{
		DB: db.SQL, Logger: logger(), PollInterval: 20 * time.Millisecond, IdlePollInterval: testdb.NoSafetyPoll, RetryInterval: 20 * time.Millisecond,
		Retry: transport.RetryPolicy{MaxAttempts: 4, InitialBackoff: 10 * time.Millisecond},
	})
	require.NoError(t, err)
	store, err := idempotency.NewStore(idempotency.Config{DB: db.SQL})
	require.NoError(t, err)
	reg := events.NewRegistry()
	events.MustRegister[deposit](reg)
	es, err := events.NewStore(events.Config{Registry: reg})
	require.NoError(t, err)
	rt, err := stepsrt.New(stepsrt.Config{Transport: tr, Store: store, Events: es, Logger: logger()})
	require.NoError(t, err)
	e.tr, e.rt, e.es = tr, rt, es
	e.step = steps.Define("add-"+id, e.cmds, e.handle)
	// "reader" keeps what the tests read queued.
	require.NoError(t, tr.Subscribe(context.Background(), append(rt.Subscriptions(e.step),
		transport.Subscription{Topic: e.replies, ConsumerGroup: "reader"},
		transport.Subscription{Topic: e.events, ConsumerGroup: "reader"})...))
	_, err = db.SQL.Exec(`CREATE TABLE ` + e.ledger + ` (account text, amount int)`)
	require.NoError(t, err)
	return e
}

func (e *env) handle(ctx context.Context, tx *steps.Tx, cmd addCmd) (steps.Message, error) {
	e.mu.Lock()
	e.attempts[cmd.Account]++
	n := e.attempts[cmd.Account]
	e.mu.Unlock()
	if _, err := tx.ExecContext(ctx, `INSERT INTO `+e.ledger+` VALUES ($1, $2)`, cmd.Account, cmd.Amount); err != nil {
		return nil, err
	}
	if err := tx.Publish(e.events, noted{Amount: cmd.Amount}); err != nil {
		return nil, err
	}
	switch {
	case cmd.Amount < 0:
		return nil, steps.Fail(refused{Why: "negative amount"}, "negative amount")
	case cmd.Amount == 0 && n <= e.failN:
		return nil, fmt.Errorf("transient failure %d", n)
	}
	var total int
	if err := tx.QueryRowContext(ctx, `SELECT sum(amount) FROM `+e.ledger+` WHERE account = $1`, cmd.Account).Scan(&total); err != nil {
		return nil, err
	}
	return added{Account: cmd.Account, Total: total}, nil
}

// command builds a command message with a key and a reply topic.
func (e *env) command(account string, amount int) *message.Message {
	e.t.Helper()
	msg, err := steps.NewMessage(addCmd{Account: account, Amount: amount}, steps.Envelope{
		Key: "key-" + account, ReplyTo: e.replies, CorrelationID: "corr-" + account, SagaID: "saga-" + account, Step: "add",
	})
	require.NoError(e.t, err)
	return msg
}

// mode delivers a command message k times: through a router, or by
// Runtime.Execute in transactions of its own.
type mode struct {
	name    string
	deliver func(e *env, msg *message.Message, times int)
}

var modes = []mode{
	{"subscriber transaction", func(e *env, msg *message.Message, times int) {
		r, err := e.tr.NewRouter()
		require.NoError(e.t, err)
		require.NoError(e.t, e.rt.Register(r, e.step))
		require.NoError(e.t, r.Start(context.Background()))
		defer func() { require.NoError(e.t, r.Stop()) }()
		for range times {
			require.NoError(e.t, e.tr.Publisher(e.db.SQL).Publish(e.cmds, msg))
		}
		deadline := time.Now().Add(15 * time.Second)
		for e.waiting() > 0 {
			require.True(e.t, time.Now().Before(deadline), "commands not consumed")
			time.Sleep(10 * time.Millisecond)
		}
	}},
	{"own transaction", func(e *env, msg *message.Message, times int) {
		for range times {
			err := e.rt.Execute(context.Background(), e.step, msg)
			if err != nil && !errors.Is(err, transport.ErrDeadLettered) {
				require.NoError(e.t, err)
			}
		}
	}},
}

// waiting counts the commands still queued for the step (retries included).
func (e *env) waiting() int {
	return e.count(`SELECT count(*) FROM pgsaga_queue WHERE topic = $1 AND consumer_group = $2`, e.cmds, e.step.Name())
}

func (e *env) count(query string, args ...any) int {
	e.t.Helper()
	var n int
	require.NoError(e.t, e.db.SQL.QueryRow(query, args...).Scan(&n))
	return n
}

type storedMsg struct {
	UUID     string
	Metadata map[string]string
	Payload  string
}

// messages lists what was published to topic (kept queued for "reader").
func (e *env) messages(topic string) []storedMsg {
	e.t.Helper()
	return e.query(`SELECT uuid, metadata::text, convert_from(payload, 'UTF8') FROM pgsaga_queue
		WHERE topic = $1 AND consumer_group = 'reader' ORDER BY id`, topic)
}

// deadLetters lists the commands dead-lettered.
func (e *env) deadLetters() []storedMsg {
	e.t.Helper()
	return e.query(`SELECT uuid, metadata::text, convert_from(payload, 'UTF8') FROM pgsaga_dead_letters
		WHERE topic = $1 ORDER BY id`, e.cmds)
}

func (e *env) query(q string, args ...any) []storedMsg {
	e.t.Helper()
	rows, err := e.db.SQL.Query(q, args...)
	require.NoError(e.t, err)
	defer rows.Close()
	var out []storedMsg
	for rows.Next() {
		var m storedMsg
		var meta string
		require.NoError(e.t, rows.Scan(&m.UUID, &meta, &m.Payload))
		require.NoError(e.t, json.Unmarshal([]byte(meta), &m.Metadata))
		out = append(out, m)
	}
	require.NoError(e.t, rows.Err())
	return out
}

// One, two and ten deliveries of the same command: one effect, one reply per
// delivery, every reply with the same id and content.
func TestDuplicateDeliveries(t *testing.T) {
	t.Parallel()
	for _, m := range modes {
		t.Run(m.name, func(t *testing.T) {
			t.Parallel()
			for _, times := range []int{1, 2, 10} {
				e := newEnv(t)
				m.deliver(e, e.command("acct", 100), times)

				assert.Equal(t, 1, e.count(`SELECT count(*) FROM `+e.ledger), "%d deliveries: one effect", times)
				assert.Len(t, e.messages(e.events), 1, "%d deliveries: one outgoing message", times)
				replies := e.messages(e.replies)
				require.Len(t, replies, times, "one reply per delivery")
				for i, r := range replies {
					assert.Equal(t, replies[0].UUID, r.UUID, "same reply id")
					assert.JSONEq(t, `{"account":"acct","total":100}`, r.Payload)
					assert.Equal(t, "test.Added", r.Metadata[steps.MetaType])
					assert.Equal(t, steps.OutcomeOK, r.Metadata[steps.MetaOutcome])
					assert.Equal(t, "corr-acct", r.Metadata[steps.MetaCorrelationID])
					assert.Equal(t, "saga-acct", r.Metadata[steps.MetaSagaID])
					assert.Equal(t, "key-acct", r.Metadata[steps.MetaKey])
					assert.Equal(t, i > 0, r.Metadata[steps.MetaReplayed] == "true", "copies are marked")
				}
			}
		})
	}
}

// A business failure is stored as failed: the handler's writes and outgoing
// messages are rolled back, the failure reply is published, and every
// duplicate gets the same failure without the handler running again.
func TestBusinessFailureStoredAndReplayed(t *testing.T) {
	t.Parallel()
	for _, m := range modes {
		t.Run(m.name, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t)
			m.deliver(e, e.command("neg", -5), 3)
			assert.Equal(t, 1, e.attempts["neg"], "the handler ran once")
			assert.Zero(t, e.count(`SELECT count(*) FROM `+e.ledger), "the handler's writes were rolled back")
			assert.Empty(t, e.messages(e.events), "its outgoing messages too")
			replies := e.messages(e.replies)
			require.Len(t, replies, 3)
			for _, r := range replies {
				assert.Equal(t, replies[0].UUID, r.UUID)
				assert.Equal(t, steps.OutcomeFailed, r.Metadata[steps.MetaOutcome])
				assert.Equal(t, "negative amount", r.Metadata[steps.MetaReason])
				assert.JSONEq(t, `{"why":"negative amount"}`, r.Payload)
			}
			assert.Equal(t, "failed", e.keyStatus("key-neg"))
		})
	}
}

func (e *env) keyStatus(key string) string {
	var status string
	err := e.db.SQL.QueryRow(`SELECT status FROM idempotency_keys WHERE scope = $1 AND key = $2`, e.step.Name(), key).Scan(&status)
	if err != nil {
		return "none"
	}
	return status
}

// A transient failure leaves no key and no writes; the retry executes and
// succeeds.
func TestTransientFailureRetried(t *testing.T) {
	t.Parallel()
	for _, m := range modes {
		t.Run(m.name, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t)
			e.failN = 2
			m.deliver(e, e.command("zero", 0), 1)
			assert.Equal(t, 3, e.attempts["zero"], "two failures, then success")
			assert.Equal(t, 1, e.count(`SELECT count(*) FROM `+e.ledger), "only the successful attempt's write")
			assert.Len(t, e.messages(e.events), 1)
			assert.Equal(t, "completed", e.keyStatus("key-zero"))
		})
	}
}

// When the retry budget runs out the command goes to pgsaga_dead_letters
// with its error, attempt count and original topic; no key is left behind.
func TestRetryBudgetThenDeadLetter(t *testing.T) {
	t.Parallel()
	for _, m := range modes {
		t.Run(m.name, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t)
			e.failN = 100
			msg := e.command("zero", 0)
			m.deliver(e, msg, 1)
			assert.Equal(t, 4, e.attempts["zero"], "MaxAttempts")
			dead := e.deadLetters()
			require.Len(t, dead, 1)
			assert.Equal(t, msg.UUID, dead[0].UUID)
			assert.Equal(t, "4", dead[0].Metadata[transport.DeadLetterAttempts])
			assert.Equal(t, e.cmds, dead[0].Metadata[transport.DeadLetterTopic])
			assert.Contains(t, dead[0].Metadata[transport.DeadLetterReason], "transient failure 4")
			assert.Equal(t, "none", e.keyStatus("key-zero"), "no key is left for a command that never succeeded")
			assert.Zero(t, e.count(`SELECT count(*) FROM `+e.ledger))
		})
	}
}

// A message that cannot be decoded is dead-lettered at once with a clear
// reason, never retried.
func TestPoisonMessageDeadLetteredAtOnce(t *testing.T) {
	t.Parallel()
	for _, m := range modes {
		t.Run(m.name, func(t *testing.T) {
			t.Parallel()
			for name, msg := range map[string]*message.Message{
				"wrong type": func() *message.Message {
					msg, _ := steps.NewMessage(added{Account: "x"}, steps.Envelope{Key: "k1"})
					return msg
				}(),
				"bad json": func() *message.Message {
					msg := message.NewMessage(uuid.NewString(), []byte(`{"account": 5`))
					msg.Metadata.Set(steps.MetaType, "test.Add")
					return msg
				}(),
			} {
				e := newEnv(t)
				m.deliver(e, msg, 1)
				assert.Empty(t, e.attempts, "%s: the handler never ran", name)
				dead := e.deadLetters()
				require.Len(t, dead, 1, name)
				assert.Equal(t, "1", dead[0].Metadata[transport.DeadLetterAttempts], name)
				assert.Contains(t, dead[0].Metadata[transport.DeadLetterReason], "test.Add", name)
			}
		})
	}
}

// The same key with a different command is refused and dead-lettered; the
// first command's outcome stands.
func TestKeyReusedWithDifferentCommand(t *testing.T) {
	t.Parallel()
	for _, m := range modes {
		t.Run(m.name, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t)
			m.deliver(e, e.command("acct", 100), 1)
			m.deliver(e, e.command("acct", 999), 1) // same key "key-acct"
			assert.Equal(t, 1, e.count(`SELECT count(*) FROM `+e.ledger))
			dead := e.deadLetters()
			require.Len(t, dead, 1)
			assert.Contains(t, dead[0].Metadata[transport.DeadLetterReason], "key reused")
			assert.Equal(t, "1", dead[0].Metadata[transport.DeadLetterAttempts], "refused at once, not retried")
		})
	}
}

func TestEnvelopeRoundTrip(t *testing.T) {
	t.Parallel()
	msg, err := steps.NewMessage(addCmd{Account: "a", Amount: 1}, steps.Envelope{
		ID: "id-1", CorrelationID: "c", CausationID: "x", SagaID: "s", Step: "st", Key: "k", ReplyTo: "r",
	})
	require.NoError(t, err)
	env := steps.EnvelopeOf(msg)
	assert.Equal(t, steps.Envelope{ID: "id-1", Type: "test.Add", CorrelationID: "c", CausationID: "x", SagaID: "s", Step: "st", Key: "k", ReplyTo: "r"}, env)
	cmd, err := steps.Decode[addCmd](msg)
	require.NoError(t, err)
	assert.Equal(t, addCmd{Account: "a", Amount: 1}, cmd)
	_, err = steps.Decode[added](msg)
	var de *steps.DecodeError
	require.ErrorAs(t, err, &de)
	assert.Equal(t, "test.Added", de.Want)
	assert.Equal(t, "test.Add", de.Got)
	_, err = steps.NewMessage(nil, steps.Envelope{})
	require.Error(t, err)
}

// The same command arrives twice at once, on two topics whose consumers run
// in two routers (two batch transactions). One executes; the other waits on
// its claim of the key and, once the first commits, replays its reply.
func TestConcurrentDuplicatesInTwoBatches(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	other := "cmds2_" + e.id
	h := func(ctx context.Context, tx *steps.Tx, cmd addCmd) (steps.Message, error) {
		time.Sleep(300 * time.Millisecond) // hold the claim while the other copy arrives
		return e.handle(ctx, tx, cmd)
	}
	slow := steps.Define(e.step.Name(), e.cmds, h)
	second := steps.Define(e.step.Name(), other, h)
	require.NoError(t, e.tr.Subscribe(context.Background(), e.rt.Subscriptions(second)...))
	var stops []func()
	for _, s := range []steps.AnyStep{slow, second} {
		// Same step name, so same key scope.
		r, err := e.tr.NewRouter()
		require.NoError(t, err)
		require.NoError(t, e.rt.Register(r, s))
		require.NoError(t, r.Start(context.Background()))
		stops = append(stops, func() { require.NoError(t, r.Stop()) })
	}
	defer func() {
		for _, stop := range stops {
			stop()
		}
	}()
	msg := e.command("acct", 100)
	tx, err := e.db.SQL.Begin()
	require.NoError(t, err)
	require.NoError(t, e.tr.Publisher(tx).Publish(e.cmds, msg))
	require.NoError(t, e.tr.Publisher(tx).Publish(other, msg))
	require.NoError(t, tx.Commit())

	deadline := time.Now().Add(20 * time.Second)
	for len(e.messages(e.replies)) < 2 {
		require.True(t, time.Now().Before(deadline), "both copies must be answered")
		time.Sleep(20 * time.Millisecond)
	}
	assert.Equal(t, 1, e.count(`SELECT count(*) FROM `+e.ledger), "one effect")
	assert.Equal(t, 1, e.attempts["acct"], "the handler ran once")
	replies := e.messages(e.replies)
	assert.Equal(t, replies[0].UUID, replies[1].UUID, "the same reply to both copies")
	assert.Empty(t, e.deadLetters())
}

// Copies of one command in one batch: the first runs the step and queues
// its key's completion with the batch's other writes; the others find the
// key claimed in their own transaction and get the stored outcome once
// the batch has written it, in the same batch, with no failed attempt (one
// attempt is all they have here).
func TestDuplicatesInOneBatch(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	tr, err := transport.New(transport.Config{
		DB: e.db.SQL, Logger: logger(), IdlePollInterval: testdb.NoSafetyPoll, BatchSize: 50, BatchTimeout: time.Minute,
		Retry: transport.RetryPolicy{MaxAttempts: 1},
	})
	require.NoError(t, err)
	store, err := idempotency.NewStore(idempotency.Config{DB: e.db.SQL})
	require.NoError(t, err)
	rt, err := stepsrt.New(stepsrt.Config{Transport: tr, Store: store, Events: e.es, Logger: logger()})
	require.NoError(t, err)
	msg := e.command("acct", 100)
	tx, err := e.db.SQL.Begin()
	require.NoError(t, err)
	for range 5 {
		require.NoError(t, tr.Publisher(tx).Publish(e.cmds, msg))
	}
	require.NoError(t, tx.Commit())
	r, err := tr.NewRouter()
	require.NoError(t, err)
	require.NoError(t, rt.Register(r, e.step))
	require.NoError(t, r.Start(context.Background()))
	defer func() { require.NoError(t, r.Stop()) }()

	deadline := time.Now().Add(20 * time.Second)
	for e.waiting() > 0 {
		require.True(t, time.Now().Before(deadline), "commands not consumed")
		time.Sleep(10 * time.Millisecond)
	}
	assert.Empty(t, e.deadLetters(), "no copy failed")
	assert.Equal(t, 1, e.count(`SELECT count(*) FROM `+e.ledger), "one effect")
	replies := e.messages(e.replies)
	require.Len(t, replies, 5, "one reply a copy")
	for _, r := range replies {
		assert.Equal(t, replies[0].UUID, r.UUID)
	}
}

type deposit struct {
	By     string `json:"by"`
	Amount int    `json:"amount"`
}

func (deposit) EventType() string { return "test.deposit" }

// balance folds deposits.
type balance struct {
	total int
	by    []string
}

func (b *balance) Apply(r events.Recorded) error {
	d := r.Data.(deposit)
	b.total += d.Amount
	b.by = append(b.by, d.By)
	return nil
}

// A writer races the step on its stream between the step's load and its
// append: the step retries once on fresh state; both writes land, in order,
// with gapless versions.
func TestRacingWriterCausesOneRetry(t *testing.T) {
	t.Parallel()
	for _, m := range modes {
		t.Run(m.name, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t)
			ctx := context.Background()
			stream := "wallet-" + e.id
			tx, err := e.db.SQL.Begin()
			require.NoError(t, err)
			_, err = e.es.AppendTx(ctx, tx, stream, 0, events.Metadata{}, deposit{By: "setup", Amount: 1})
			require.NoError(t, err)
			require.NoError(t, tx.Commit())

			var (
				mu    sync.Mutex
				calls int
			)
			e.step = steps.Define("deposit-"+e.id, e.cmds, func(ctx context.Context, tx *steps.Tx, cmd addCmd) (steps.Message, error) {
				mu.Lock()
				calls++
				first := calls == 1
				mu.Unlock()
				var b balance
				v, err := tx.Fold(ctx, stream, &b)
				if err != nil {
					return nil, err
				}
				if first {
					// Another writer commits between our load and our append.
					rtx, err := e.db.SQL.Begin()
					require.NoError(t, err)
					_, err = e.es.AppendTx(ctx, rtx, stream, v, events.Metadata{}, deposit{By: "racer", Amount: 10})
					require.NoError(t, err)
					require.NoError(t, rtx.Commit())
				}
				if _, err := tx.Append(ctx, stream, v, deposit{By: "step", Amount: cmd.Amount}); err != nil {
					return nil, err
				}
				return added{Account: cmd.Account, Total: b.total + cmd.Amount}, nil
			})
			m.deliver(e, e.command("acct", 100), 1)

			assert.Equal(t, 2, calls, "one retry, on fresh state")
			var b balance
			v, err := e.es.FoldTx(ctx, e.db.SQL, stream, 0, &b)
			require.NoError(t, err)
			assert.Equal(t, 3, v, "versions 1, 2, 3")
			assert.Equal(t, []string{"setup", "racer", "step"}, b.by, "both writes, in order")
			assert.Equal(t, 111, b.total)
			replies := e.messages(e.replies)
			require.Len(t, replies, 1)
			assert.JSONEq(t, `{"account":"acct","total":111}`, replies[0].Payload, "the retry saw the racer's write")
			assert.Empty(t, e.deadLetters())
			recs, err := e.es.LoadTx(ctx, e.db.SQL, stream, 0)
			require.NoError(t, err)
			assert.Equal(t, "key-acct", recs[2].Metadata.IdempotencyKey, "the step's event carries the command's key")
			assert.Equal(t, "saga-acct", recs[2].Metadata.SagaID)
		})
	}
}

// A command that expects a reply is always answered: a handler that fails
// it without a reply of its own (Fail(nil, reason)), or completes it with
// none, still sends the outcome and the reason, else a saga would wait out
// its deadlines and compensate with "no reply", the participant's reason
// lost. Replayed for a duplicate, like any stored reply.
func TestACommandExpectingAReplyIsAlwaysAnswered(t *testing.T) {
	for _, m := range modes {
		t.Run(m.name, func(t *testing.T) {
			e := newEnv(t)
			e.step = steps.Define("bare-"+e.id, e.cmds, func(ctx context.Context, tx *steps.Tx, cmd addCmd) (steps.Message, error) {
				if cmd.Amount < 0 {
					return nil, steps.Fail(nil, "no negative amounts here")
				}
				return nil, nil
			})
			require.NoError(t, e.tr.Subscribe(context.Background(), e.rt.Subscriptions(e.step)...))
			m.deliver(e, e.command("neg", -1), 2)
			m.deliver(e, e.command("pos", 5), 1)

			replies := e.messages(e.replies)
			require.Len(t, replies, 3, "one reply per delivery, the duplicate's replayed")
			byKey := map[string][]storedMsg{}
			for _, r := range replies {
				byKey[r.Metadata[steps.MetaKey]] = append(byKey[r.Metadata[steps.MetaKey]], r)
			}
			failed := byKey["key-neg"]
			require.Len(t, failed, 2)
			assert.Equal(t, failed[0].UUID, failed[1].UUID, "the replay keeps the reply's id")
			assert.Equal(t, steps.OutcomeFailed, failed[0].Metadata[steps.MetaOutcome])
			assert.Equal(t, "no negative amounts here", failed[0].Metadata[steps.MetaReason])
			assert.Equal(t, steps.FailureReply{}.MessageType(), failed[0].Metadata[steps.MetaType])
			assert.JSONEq(t, `{"reason":"no negative amounts here"}`, failed[0].Payload)
			assert.Equal(t, "true", failed[1].Metadata[steps.MetaReplayed])
			done := byKey["key-pos"]
			require.Len(t, done, 1)
			assert.Equal(t, steps.OutcomeOK, done[0].Metadata[steps.MetaOutcome])
			assert.Equal(t, steps.DoneReply{}.MessageType(), done[0].Metadata[steps.MetaType])
		})
	}
}

// A step defined without a handler is one a saga sends to and another
// process serves: a runtime refuses to register it, saying so, and the
// same step with a handler (Handle) registers.
func TestAStepServedElsewhereIsNotRegistered(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	declared := steps.Define[addCmd]("elsewhere-"+e.id, "elsewhere_"+e.id, nil)
	assert.Equal(t, addCmd{}.MessageType(), declared.CommandType())
	r, err := e.tr.NewRouter()
	require.NoError(t, err)
	err = e.rt.Register(r, declared)
	require.ErrorContains(t, err, "has no handler: it is served elsewhere")
	require.ErrorContains(t, e.rt.Register(r, nil), "nil step")
	require.ErrorContains(t, e.rt.Execute(context.Background(), declared, message.NewMessage("m", nil)), "has no handler")
	require.NoError(t, e.rt.Register(r, declared.Handle(e.handle)))
}
