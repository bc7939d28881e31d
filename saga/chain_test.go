package saga_test

import (
	"context"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/internal/testdb"
	"github.com/pgsaga/pgsaga/internal/transport"
	"github.com/pgsaga/pgsaga/saga"
	"github.com/pgsaga/pgsaga/steps"
)

// saveCounter counts (its note, a testdb.Tracer) the statements that
// write saga instances: one at a time, or a batch's at once; and those
// with which a reply reads and locks its instance itself.
type saveCounter struct {
	one, batch, reads atomic.Int64
}

func (c *saveCounter) note(sql string, _ []any) {
	switch {
	case strings.HasPrefix(sql, "UPDATE saga_instances SET"):
		c.one.Add(1)
	case strings.Contains(sql, "saga_instance_changed(u.id"):
		c.batch.Add(1)
	case strings.HasPrefix(sql, "SELECT id, saga_type") && strings.HasSuffix(sql, "FOR UPDATE"):
		c.reads.Add(1) // a reply's own (a caller's Get reads unlocked, the sweeper skips locked rows)
	}
}

// newChainClient is a client serving a two-step signup (open, then
// welcome), both steps and the engine taking in-process deliveries: a
// batch of open commands runs each saga's whole chain (open, its reply,
// welcome, its reply) in its transaction. during runs in the welcome step
// before it writes. The pool traces every statement to tracer.
func newChainClient(t *testing.T, tracer testdb.Tracer, during func(context.Context, SendWelcome)) (*saga.Client, *saga.Definition, *testdb.DB) {
	t.Helper()
	db := testdb.Fresh(t)
	_, err := db.SQL.Exec(`CREATE TABLE opened (email text PRIMARY KEY); CREATE TABLE welcomed (email text PRIMARY KEY)`)
	require.NoError(t, err)
	c, err := saga.NewClient(tracedPool(t, db, 0, tracer), saga.ClientConfig{
		Transport: transport.Config{PollInterval: 20 * time.Millisecond, IdlePollInterval: testdb.NoSafetyPoll,
			BatchSize: 50, BatchTimeout: time.Minute},
		FinishedChannel: "chain_finished",
		InProcessEngine: true,
		InProcessSteps:  []string{"accounts.open", "mail.welcome"},
		Logger:          logger(),
	})
	require.NoError(t, err)
	open := openStep(nil)
	welcome := steps.Define("mail.welcome", "mail.welcome", func(ctx context.Context, tx *steps.Tx, cmd SendWelcome) (steps.Message, error) {
		if during != nil {
			during(ctx, cmd)
		}
		_, err := tx.ExecContext(ctx, `INSERT INTO welcomed VALUES ($1)`, cmd.Email)
		return Done{}, err
	})
	def := saga.MustDefine(saga.Spec[signup]{
		Name:    "chain",
		Trigger: saga.On("chain.signups", func(s SignedUp) (string, signup, error) { return s.Email, signup(s), nil }),
		Steps: []saga.Step[signup]{
			{Name: "account", Deadline: time.Minute, Action: saga.Send(open, func(s signup) OpenAccount { return OpenAccount(s) })},
			{Name: "welcome", Deadline: time.Minute, Action: saga.Send(welcome, func(s signup) SendWelcome { return SendWelcome(s) })},
		},
	})
	require.NoError(t, c.Register(def))
	require.NoError(t, c.AddSteps(open, welcome))
	require.NoError(t, c.Setup(context.Background()))
	return c, def, db
}

var chainHistory = []string{"started", "sent:account", "reply_ok:account", "sent:welcome", "reply_ok:welcome", "completed"}

// A saga's chain of reactions in one transaction (a reply, the next
// step in process, its reply) reads its instance once, when the batch
// begins, and writes it once, when the batch ends: the second reply takes
// the instance as the first saved it, and every instance the batch
// changed is written in one statement.
func TestAChainOfReactionsSavesItsInstanceOnceForTheBatch(t *testing.T) {
	t.Parallel()
	var sc saveCounter
	c, def, _ := newChainClient(t, sc.note, nil)
	emails := []string{"a@example.com", "b@example.com", "c@example.com"}
	for _, email := range emails {
		signUp(t, c, def, email, true) // each queues its first command; no worker runs yet
	}
	sc.one.Store(0)
	sc.batch.Store(0)
	sc.reads.Store(0)
	startRunning(t, c)
	for _, email := range emails {
		inst := waitFinished(t, c, def, email)
		assert.Equal(t, saga.StatusCompleted, inst.Status)
		got, err := c.Get(context.Background(), inst.ID)
		require.NoError(t, err)
		assert.Equal(t, chainHistory, kinds(got.History), email)
	}
	assert.Equal(t, int64(1), sc.batch.Load(), "the batch's instances are written in one statement")
	assert.Zero(t, sc.one.Load(), "no reaction wrote its instance alone")
	assert.Zero(t, sc.reads.Load(), "no reply read its instance itself")
}

// An instance another transaction changes while the batch that saves it
// runs (its reaction took it unlocked; the save comes at the end) is not
// overwritten: the batch's save finds its version moved on and fails the
// batch, whose messages then run again, one a transaction, on the
// instance as the other transaction left it.
func TestAnInstanceChangedDuringItsBatchIsNotOverwritten(t *testing.T) {
	t.Parallel()
	var (
		once    sync.Once
		changed error
		db      *testdb.DB
		def     *saga.Definition
	)
	const note = "noted by an operator meanwhile"
	emails := []string{"a@example.com", "b@example.com"}
	// In b's welcome, after a's chain saved a's instance (queued for the
	// batch's end): change a's instance from another transaction.
	during := func(ctx context.Context, cmd SendWelcome) {
		if cmd.Email != emails[1] {
			return
		}
		once.Do(func() {
			tx, err := db.SQL.BeginTx(ctx, nil)
			if err != nil {
				changed = err
				return
			}
			defer func() { _ = tx.Rollback() }()
			if _, err = tx.ExecContext(ctx, `SET LOCAL lock_timeout = '2s'`); err == nil {
				_, err = tx.ExecContext(ctx, `UPDATE saga_instances SET failure_reason = $2, version = version + 1 WHERE id = $1`,
					saga.ID(def.Name, emails[0]), note)
			}
			if err == nil {
				err = tx.Commit()
			}
			changed = err
		})
	}
	c, d, tdb := newChainClient(t, func(string, []any) {}, during)
	db, def = tdb, d
	for _, email := range emails {
		signUp(t, c, def, email, true)
	}
	startRunning(t, c)
	for _, email := range emails {
		assert.Equal(t, saga.StatusCompleted, waitFinished(t, c, def, email).Status)
	}
	require.NoError(t, changed, "the other transaction could change the instance: the batch held no lock on it")
	var reason string
	require.NoError(t, db.SQL.QueryRow(`SELECT coalesce(failure_reason, '') FROM saga_instances WHERE id = $1`,
		saga.ID(def.Name, emails[0])).Scan(&reason))
	assert.Equal(t, note, reason, "the batch's save did not overwrite the other transaction's change")
	got, err := c.Get(context.Background(), saga.ID(def.Name, emails[0]))
	require.NoError(t, err)
	assert.Equal(t, chainHistory, kinds(got.History), "the saga's reactions were applied once")
}
