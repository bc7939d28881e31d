package saga_test

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/internal/pgdb"
	"github.com/pgsaga/pgsaga/internal/testdb"
	"github.com/pgsaga/pgsaga/internal/transport"
	"github.com/pgsaga/pgsaga/saga"
	"github.com/pgsaga/pgsaga/steps"
)

// loadCounter counts (its note, a testdb.Tracer) the statements that read
// saga instances for replies: one instance at a time, or a batch's at
// once.
type loadCounter struct {
	one, many atomic.Int64
	mu        sync.Mutex
	read      map[string]int // instance id → reads of its own
}

func (c *loadCounter) note(sql string, args []any) {
	switch {
	case !strings.HasPrefix(sql, "SELECT id, saga_type"):
	case strings.Contains(sql, "unnest("):
		c.many.Add(1)
	case strings.Contains(sql, "command_id = $2"):
		c.one.Add(1)
		c.mu.Lock()
		defer c.mu.Unlock()
		if c.read == nil {
			c.read = map[string]int{}
		}
		c.read[instanceArg(args)]++
	}
}

// instanceArg is the first argument that names an instance (pgx's
// database/sql driver may put its options before).
func instanceArg(args []any) string {
	for _, a := range args {
		switch v := a.(type) {
		case string:
			return v
		case uuid.UUID:
			return v.String()
		case fmt.Stringer:
			return v.String()
		}
	}
	return ""
}

// readsOf is how many times a reply read instance id itself.
func (c *loadCounter) readsOf(id uuid.UUID) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.read[id.String()]
}

// payInFlight starts a saga per trip, whose pay participant is silent,
// and waits until each has sent pay.
func payInFlight(t *testing.T, e *env, trips ...string) []uuid.UUID {
	t.Helper()
	var ids []uuid.UUID
	for _, trip := range trips {
		ids = append(ids, e.start(trip))
	}
	for _, id := range ids {
		e.wait(id, "pay in flight", func(i saga.Instance) bool { return i.Step == "pay" && i.Attempt == 1 })
	}
	return ids
}

// payAnswer is pay's reply for saga id, caused by message causation (""
// for the command in flight as the instance records it).
func payAnswer(t *testing.T, e *env, id uuid.UUID, causation string) *message.Message {
	t.Helper()
	var cmdID, payKey, token string
	require.NoError(t, e.db.SQL.QueryRow(`SELECT uuid, metadata->>$2, metadata->>$3 FROM `+archived(e.topics["pay"])+
		` WHERE metadata->>'saga_id' = $1`, id.String(), steps.MetaKey, steps.MetaReplyToken).Scan(&cmdID, &payKey, &token))
	if causation == "" {
		causation = cmdID
	}
	answer, err := steps.NewMessage(tripReply{Op: "pay"}, steps.Envelope{SagaID: id.String(), Step: "pay", Key: payKey,
		CausationID: causation, Outcome: steps.OutcomeOK, ReplyToken: token})
	require.NoError(t, err)
	return answer
}

// replyBatch stops e's router, publishes replies in one transaction, and
// runs the engine again on a pool that counts instance loads, so that one
// claim of the reply queue takes them all; it returns once they are
// consumed.
func replyBatch(t *testing.T, e *env, replies ...*message.Message) *loadCounter {
	t.Helper()
	lc := startReplyBatch(t, e, replies...)
	e.waitConsumed(e.def.ReplyTopic, "")
	return lc
}

// startReplyBatch is replyBatch without waiting.
func startReplyBatch(t *testing.T, e *env, replies ...*message.Message) *loadCounter {
	t.Helper()
	require.NoError(t, e.router.Stop())
	ctx := context.Background()
	tx, err := e.db.SQL.Begin()
	require.NoError(t, err)
	require.NoError(t, e.tr.Publisher(tx).Publish(e.def.ReplyTopic, replies...))
	require.NoError(t, tx.Commit())

	var lc loadCounter
	db, err := pgdb.Open(ctx, pgdb.Config{URL: e.db.URL, MaxConns: 4, Tracer: testdb.Tracer(lc.note)})
	require.NoError(t, err)
	t.Cleanup(func() { db.Close() })
	tr, err := transport.New(transport.Config{DB: db.SQL, Logger: logger(), IdlePollInterval: testdb.NoSafetyPoll,
		BatchSize: 50, BatchTimeout: time.Minute, RetryInterval: 20 * time.Millisecond,
		Retry: transport.RetryPolicy{MaxAttempts: 3, InitialBackoff: 10 * time.Millisecond, MaxBackoff: 20 * time.Millisecond}})
	require.NoError(t, err)
	engine, err := saga.NewEngine(saga.Config{DB: db.SQL, Transport: tr, Logger: logger()})
	require.NoError(t, err)
	require.NoError(t, engine.Register(e.def))
	r, err := tr.NewRouter()
	require.NoError(t, err)
	require.NoError(t, engine.AddHandlers(r))
	require.NoError(t, r.Start(ctx))
	t.Cleanup(func() { require.NoError(t, r.Stop()) })
	return &lc
}

// A batch of replies loads the instances they answer in one statement;
// no reply reads its own.
func TestABatchOfRepliesLoadsItsInstancesInOneStatement(t *testing.T) {
	t.Parallel()
	e := newEnv(t, options{silent: []string{"pay"}})
	ids := payInFlight(t, e, "riga", "kiev", "bonn", "nice", "pisa")
	var answers []*message.Message
	for _, id := range ids {
		answers = append(answers, payAnswer(t, e, id, ""))
	}
	lc := replyBatch(t, e, answers...)
	for _, id := range ids {
		inst := e.terminal(id)
		assert.Equal(t, saga.StatusCompleted, inst.Status)
		assert.Equal(t, []string{"started", "sent:book", "reply_ok:book", "sent:pay", "reply_ok:pay", "completed"}, kinds(inst.History))
	}
	assert.Equal(t, int64(1), lc.many.Load(), "one load for the batch")
	assert.Zero(t, lc.one.Load(), "no reply read its instance itself")
}

// An instance loaded for a batch, then changed by an earlier attempt of
// the batch (a reply to an older copy of the command in flight, which
// the batch did not load for, applied it), is not applied again by the
// reply it was loaded for: the instance as the earlier attempt saved it
// (pending, for the batch's end) takes precedence over the stale copy,
// and says the reply is no longer for the command in flight.
func TestAnInstanceChangedEarlierInTheBatchIsNotAppliedTwice(t *testing.T) {
	t.Parallel()
	e := newEnv(t, options{silent: []string{"pay"}})
	id := payInFlight(t, e, "gent")[0]
	older := payAnswer(t, e, id, uuid.NewString()) // answers an earlier copy, same key
	latest := payAnswer(t, e, id, "")
	lc := replyBatch(t, e, older, latest)
	inst := e.terminal(id)
	assert.Equal(t, saga.StatusCompleted, inst.Status)
	assert.Equal(t, []string{"started", "sent:book", "reply_ok:book", "sent:pay", "reply_ok:pay", "completed"}, kinds(inst.History),
		"the reply was applied once")
	assert.Equal(t, int64(1), lc.many.Load(), "the batch loaded the instance for the latest reply")
}

// A batch's load locks no instance: while its commands run, every
// instance whose reply the batch has not applied yet is free for others.
// (Locked up front, instances the load took and the ones its attempts
// lock one by one deadlocked with another batch holding copies of the
// same replies.) The save of each reply locks and checks its instance.
func TestABatchLoadLocksNoInstance(t *testing.T) {
	t.Parallel()
	emails := []string{"a@example.com", "b@example.com", "c@example.com"}
	var (
		mu      sync.Mutex
		applied = map[string]bool{}
		held    []string
		lc      loadCounter
		db      *testdb.DB
		def     *saga.Definition
	)
	// Before each command runs: try, from another transaction, to lock
	// the instances whose replies the batch has not applied.
	during := func(ctx context.Context, cmd OpenAccount) {
		mu.Lock()
		defer mu.Unlock()
		for _, email := range emails {
			if applied[email] {
				continue // its reply's save holds it until the batch commits
			}
			tx, err := db.SQL.BeginTx(ctx, nil)
			if err != nil {
				held = append(held, email+": "+err.Error())
				continue
			}
			if _, err := tx.ExecContext(ctx, `SELECT FROM saga_instances WHERE id = $1 FOR UPDATE NOWAIT`, saga.ID(def.Name, email)); err != nil {
				held = append(held, email+": "+err.Error())
			}
			_ = tx.Rollback()
		}
		applied[cmd.Email] = true
	}
	c, d, tdb := newSignupClientTraced(t, 0, testdb.Tracer(lc.note), during, func(cfg *saga.ClientConfig) {
		cfg.InProcessEngine = true
		cfg.Transport.BatchSize, cfg.Transport.BatchTimeout = 50, time.Minute
	})
	db, def = tdb, d
	require.NoError(t, c.Setup(context.Background()))
	for _, email := range emails {
		signUp(t, c, def, email, true)
	}
	startRunning(t, c)
	for _, email := range emails {
		assert.Equal(t, saga.StatusCompleted, waitFinished(t, c, def, email).Status)
	}
	require.Equal(t, int64(1), lc.many.Load(), "the batch loaded its instances")
	mu.Lock()
	defer mu.Unlock()
	assert.Empty(t, held, "instances the batch loaded were locked")
}

// With InProcessEngine, the replies to a batch of commands reach the
// engine in the batch's transaction: the instances they read are loaded
// with the batch, in one statement, and no reply reads its own.
func TestInProcessRepliesToABatchOfCommandsReadNoInstance(t *testing.T) {
	t.Parallel()
	var lc loadCounter
	c, def, _ := newSignupClientTraced(t, 0, testdb.Tracer(lc.note), nil, func(cfg *saga.ClientConfig) {
		cfg.InProcessEngine = true
		cfg.Transport.BatchSize, cfg.Transport.BatchTimeout = 50, time.Minute
	})
	require.NoError(t, c.Setup(context.Background()))
	emails := []string{"a@example.com", "b@example.com", "c@example.com", "d@example.com"}
	for _, email := range emails {
		signUp(t, c, def, email, true) // each queues its first command; no worker runs yet
	}
	startRunning(t, c)
	for _, email := range emails {
		assert.Equal(t, saga.StatusCompleted, waitFinished(t, c, def, email).Status)
	}
	assert.Equal(t, int64(1), lc.many.Load(), "one load for the batch of commands")
	assert.Zero(t, lc.one.Load(), "no in-process reply read its instance itself")
}
