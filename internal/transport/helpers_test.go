package transport_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/internal/testdb"
	"github.com/pgsaga/pgsaga/internal/testout"
	"github.com/pgsaga/pgsaga/internal/testpg"
	"github.com/pgsaga/pgsaga/internal/transport"
)

func TestMain(m *testing.M) {
	// A copy of this test binary started by TestTwoProcessesShareAGroup runs
	// one worker and exits.
	if os.Getenv(workerEnv) != "" {
		os.Exit(runWorker())
	}
	testpg.Main(m)
}

// testLogger is the tests' logger (PGSAGA_TEST_LOG shows it).
var testLogger = testout.Logger

// fastConfig polls and retries quickly so tests finish fast. Idle consumers
// wait an hour for a wake-up: a lost one fails the test instead of hiding
// behind a safety poll.
func fastConfig(db *testdb.DB) transport.Config {
	return transport.Config{
		DB:               db.SQL,
		Logger:           testLogger(),
		IdlePollInterval: testdb.NoSafetyPoll,
		RetryInterval:    20 * time.Millisecond,
		Retry:            transport.RetryPolicy{MaxAttempts: 5, InitialBackoff: 10 * time.Millisecond, MaxBackoff: 50 * time.Millisecond},
	}
}

// env is one test's slice of a database: its own topics and effects table.
// Everything published to out is kept queued for the group "archive".
type env struct {
	t   *testing.T
	db  *testdb.DB
	tr  *transport.Transport
	id  string
	in  string // topic the handlers consume
	out string // topic the handlers publish to
	eff string // effects table: one row per effect, (msg, part)
}

func newEnv(t *testing.T, mutate func(*transport.Config)) *env {
	t.Helper()
	return newEnvOn(t, testdb.Shared(t), mutate)
}

// newEnvOn is newEnv on a database of the test's choosing.
func newEnvOn(t *testing.T, db *testdb.DB, mutate func(*transport.Config)) *env {
	t.Helper()
	cfg := fastConfig(db)
	if mutate != nil {
		mutate(&cfg)
	}
	tr, err := transport.New(cfg)
	require.NoError(t, err)
	id := randomID()
	e := &env{t: t, db: db, tr: tr, id: id, in: "in_" + id, out: "out_" + id, eff: "effects_" + id}
	require.NoError(t, tr.Subscribe(context.Background(),
		transport.Subscription{Topic: e.in, ConsumerGroup: "g"},
		transport.Subscription{Topic: e.out, ConsumerGroup: "archive"}))
	_, err = db.SQL.Exec(`CREATE TABLE ` + e.eff + ` (msg text NOT NULL, part text NOT NULL, attempt int NOT NULL DEFAULT 0)`)
	require.NoError(t, err)
	return e
}

func randomID() string {
	b := make([]byte, 5)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// publish puts n messages on the env's input topic, in one transaction, and
// returns their UUIDs in order.
func (e *env) publish(n int) []string {
	e.t.Helper()
	ids := make([]string, n)
	msgs := make([]*message.Message, n)
	for i := range msgs {
		payload, _ := json.Marshal(map[string]int{"i": i})
		msgs[i] = message.NewMessage(uuid.NewString(), payload)
		ids[i] = msgs[i].UUID
	}
	tx, err := e.db.SQL.Begin()
	require.NoError(e.t, err)
	for start := 0; start < n; start += 500 {
		require.NoError(e.t, e.tr.Publisher(tx).Publish(e.in, msgs[start:min(start+500, n)]...))
	}
	require.NoError(e.t, tx.Commit())
	return ids
}

// replyID derives the id of the reply to msg: the same every attempt.
func replyID(msg *message.Message) string {
	return uuid.NewSHA1(uuid.NameSpaceOID, []byte("reply:"+msg.UUID)).String()
}

// effect records one part of msg's effect through the attempt's transaction.
func effect(msg *message.Message, table, part string) error {
	tx, ok := transport.TxFromContext(msg.Context())
	if !ok {
		return fmt.Errorf("no transaction in context")
	}
	_, err := tx.ExecContext(msg.Context(), `INSERT INTO `+table+` (msg, part) VALUES ($1, $2)`, msg.UUID, part)
	return err
}

// waiting counts the messages of topic still queued for group (retries
// included).
func (e *env) waiting(topic, group string) int {
	e.t.Helper()
	return e.count(`SELECT count(*) FROM pgsaga_queue WHERE topic = $1 AND consumer_group = $2`, topic, group)
}

// drained waits until group has no message of topic left.
func (e *env) drained(topic, group string, timeout time.Duration) {
	e.t.Helper()
	waitFor(e.t, timeout, topic+" drained by "+group, func() bool { return e.waiting(topic, group) == 0 })
}

func (e *env) count(query string, args ...any) int {
	e.t.Helper()
	var n int
	require.NoError(e.t, e.db.SQL.QueryRow(query, args...).Scan(&n))
	return n
}

// published counts the messages published to the env's output topic.
func (e *env) published() int {
	return e.count(`SELECT count(*) FROM pgsaga_queue WHERE topic = $1 AND consumer_group = 'archive'`, e.out)
}

// deadLetters lists the dead letters of topic.
func (e *env) deadLetters(topic string) []transport.DeadLetter {
	e.t.Helper()
	dl, err := e.tr.DeadLetters(context.Background(), transport.DeadLetterFilter{Topic: topic})
	require.NoError(e.t, err)
	return dl
}

// waitFor polls cond until it holds or the deadline passes.
func waitFor(t testing.TB, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %s waiting for %s", timeout, what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// startRouter starts r and returns a function that stops it; the test
// stops it at cleanup if it has not.
func startRouter(t testing.TB, r *transport.Router) (stop func()) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	require.NoError(t, r.Start(ctx), "router did not start")
	var once sync.Once
	stop = func() {
		once.Do(func() { require.NoError(t, r.Stop()) })
	}
	t.Cleanup(stop)
	return stop
}

func (e *env) route(t *testing.T, h transport.HandlerFunc, mw ...message.HandlerMiddleware) {
	t.Helper()
	r, err := e.tr.NewRouter()
	require.NoError(t, err)
	r.AddMiddleware(mw...)
	require.NoError(t, r.AddHandler("h", e.in, "g", h))
	startRouter(t, r)
}

// runOne routes h (see route) and publishes one message to it.
func (e *env) runOne(t *testing.T, h transport.HandlerFunc) {
	t.Helper()
	e.route(t, h)
	e.publish(1)
}

// attempts counts delivery attempts per message UUID.
type attempts struct {
	mu sync.Mutex
	n  map[string]int
}

func newAttempts() *attempts { return &attempts{n: map[string]int{}} }

func (a *attempts) next(id string) int {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.n[id]++
	return a.n[id]
}

func (a *attempts) of(id string) int {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.n[id]
}

// assertExactlyOnce checks that each of n messages has both parts of its
// effect exactly once.
func assertExactlyOnce(t *testing.T, e *env, n int) {
	t.Helper()
	require.Equal(t, n, e.count(`SELECT count(DISTINCT msg) FROM `+e.eff), "messages with an effect")
	require.Zero(t, e.count(`SELECT count(*) FROM (SELECT msg FROM `+e.eff+` GROUP BY msg, part HAVING count(*) <> 1) d`), "effect parts present more than once")
	require.Zero(t, e.count(`SELECT count(*) FROM (SELECT msg FROM `+e.eff+` GROUP BY msg HAVING count(*) <> 2) d`), "messages with a partial effect")
}
