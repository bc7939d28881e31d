package transport_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/internal/testdb"
	"github.com/pgsaga/pgsaga/steps/transport"
)

func TestMain(m *testing.M) { testdb.Main(m) }

// testLogger is quiet unless PGSAGA_TEST_LOG is set.
func testLogger() *slog.Logger {
	if os.Getenv("PGSAGA_TEST_LOG") != "" {
		return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug}))
	}
	return slog.New(slog.NewTextHandler(io.Discard, nil))
}

// fastConfig polls and resends quickly so tests finish fast.
func fastConfig(db *testdb.DB) transport.Config {
	return transport.Config{
		DB:             db.SQL,
		Logger:         testLogger(),
		PollInterval:   20 * time.Millisecond,
		RetryInterval:  20 * time.Millisecond,
		ResendInterval: 20 * time.Millisecond,
	}
}

// env is one test's slice of the shared database: its own topics and tables.
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
	require.NoError(t, tr.CreateTopics(context.Background(), e.in, e.out))
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

// consumed counts messages of topic that group's offset has passed.
func (e *env) consumed(topic, group string) int {
	e.t.Helper()
	var n int
	err := e.db.SQL.QueryRow(`
		SELECT count(*) FROM `+e.tr.MessagesTable(topic)+` m
		JOIN `+e.tr.OffsetsTable(topic)+` o ON o.consumer_group = $1
		WHERE m.transaction_id < o.last_processed_transaction_id
		   OR (m.transaction_id = o.last_processed_transaction_id AND m."offset" <= o.offset_acked)`, group).Scan(&n)
	if err != nil && strings.Contains(err.Error(), "does not exist") {
		return 0
	}
	require.NoError(e.t, err)
	return n
}

func (e *env) count(query string, args ...any) int {
	e.t.Helper()
	var n int
	require.NoError(e.t, e.db.SQL.QueryRow(query, args...).Scan(&n))
	return n
}

// messagesIn counts the messages stored on topic.
func (e *env) messagesIn(topic string) int {
	return e.count(`SELECT count(*) FROM ` + e.tr.MessagesTable(topic))
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

// startRouter runs r in the background and returns a function that closes
// it and waits for Run to return.
func startRouter(t testing.TB, r *transport.Router) (stop func()) {
	t.Helper()
	done := make(chan error, 1)
	go func() { done <- r.Run(context.Background()) }()
	select {
	case <-r.Running():
	case err := <-done:
		t.Fatalf("router stopped at start: %v", err)
	case <-time.After(10 * time.Second):
		t.Fatalf("router did not start")
	}
	var once sync.Once
	stop = func() {
		once.Do(func() {
			require.NoError(t, r.Close())
			select {
			case err := <-done:
				require.NoError(t, err)
			case <-time.After(30 * time.Second):
				t.Fatalf("router did not stop")
			}
		})
	}
	t.Cleanup(stop)
	return stop
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

func jsonUnmarshal(s string, v any) error { return json.Unmarshal([]byte(s), v) }
