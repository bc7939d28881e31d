package saga_test

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/internal/testdb"
	"github.com/pgsaga/pgsaga/internal/transport"
	"github.com/pgsaga/pgsaga/saga"
	"github.com/pgsaga/pgsaga/steps"
)

// newSignupClient is a client serving a one-step signup saga whose step
// records each e-mail in a table, on a database of its own.
func newSignupClient(t *testing.T) (*saga.Client, *saga.Definition, *testdb.DB) {
	t.Helper()
	return newSignupClientOnPool(t, 0)
}

// newSignupClientOnPool is newSignupClient over a pool of its own of at
// most maxConns connections (0: the database's shared pool).
func newSignupClientOnPool(t *testing.T, maxConns int32) (*saga.Client, *saga.Definition, *testdb.DB) {
	t.Helper()
	return newSignupClientWith(t, maxConns, nil)
}

// newSignupClientWith is newSignupClientOnPool with its config changed by
// mutate.
func newSignupClientWith(t *testing.T, maxConns int32, mutate func(*saga.ClientConfig)) (*saga.Client, *saga.Definition, *testdb.DB) {
	t.Helper()
	return newSignupClientTraced(t, maxConns, nil, nil, mutate)
}

// newSignupClientTraced is newSignupClientWith over a pool of its own
// whose statements tracer sees, unless nil; during, unless nil, runs in
// the accounts.open step before it opens the account.
func newSignupClientTraced(t *testing.T, maxConns int32, tracer pgx.QueryTracer, during func(context.Context, OpenAccount), mutate func(*saga.ClientConfig)) (*saga.Client, *saga.Definition, *testdb.DB) {
	t.Helper()
	db := testdb.Fresh(t)
	_, err := db.SQL.Exec(`CREATE TABLE opened (email text PRIMARY KEY)`)
	require.NoError(t, err)
	pool := db.Pool
	if maxConns > 0 || tracer != nil {
		pool = tracedPool(t, db, maxConns, tracer)
	}
	cfg := saga.ClientConfig{
		Transport:       transport.Config{PollInterval: 20 * time.Millisecond, IdlePollInterval: testdb.NoSafetyPoll},
		FinishedChannel: "signup_finished",
		Logger:          logger(),
	}
	if mutate != nil {
		mutate(&cfg)
	}
	c, err := saga.NewClient(pool, cfg)
	require.NoError(t, err)
	open := openStep(during)
	def := saga.MustDefine(saga.Spec[signup]{
		Name:    "signup",
		Trigger: saga.On("signups", func(s SignedUp) (string, signup, error) { return s.Email, signup(s), nil }),
		Steps: []saga.Step[signup]{{Name: "account", Deadline: time.Minute,
			Action: saga.Send(open, func(s signup) OpenAccount { return OpenAccount(s) })}},
	})
	require.NoError(t, c.Register(def))
	require.NoError(t, c.AddSteps(open))
	return c, def, db
}

// tracedPool is a pool on db of maxConns connections at most (0: pgx's
// default) whose statements go to tracer.
func tracedPool(t *testing.T, db *testdb.DB, maxConns int32, tracer pgx.QueryTracer) *pgxpool.Pool {
	t.Helper()
	pcfg, err := pgxpool.ParseConfig(db.URL)
	require.NoError(t, err)
	if maxConns > 0 {
		pcfg.MaxConns = maxConns
	}
	pcfg.ConnConfig.Tracer = tracer
	pool, err := pgxpool.NewWithConfig(context.Background(), pcfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	return pool
}

// openStep opens an account (a row of table opened), running during
// first if it is not nil.
func openStep(during func(context.Context, OpenAccount)) steps.Step[OpenAccount] {
	return steps.Define("accounts.open", "accounts.open", func(ctx context.Context, tx *steps.Tx, cmd OpenAccount) (steps.Message, error) {
		if during != nil {
			during(ctx, cmd)
		}
		_, err := tx.ExecContext(ctx, `INSERT INTO opened VALUES ($1)`, cmd.Email)
		return Done{}, err
	})
}

func trigger(email string) SignedUp { return SignedUp{Email: email} }

// startRunning starts c until the test ends.
func startRunning(t *testing.T, c *saga.Client) {
	t.Helper()
	require.NoError(t, c.Start(context.Background()))
	t.Cleanup(func() { require.NoError(t, c.Stop(context.Background())) })
}

// signUp starts the signup of email in a transaction that commits, or
// rolls back if commit is false.
func signUp(t *testing.T, c *saga.Client, def *saga.Definition, email string, commit bool) {
	t.Helper()
	ctx := context.Background()
	tx, err := c.DB().BeginTx(ctx, nil)
	require.NoError(t, err)
	id, err := c.StartTx(ctx, tx, def.Name, trigger(email))
	require.NoError(t, err)
	require.Equal(t, saga.ID(def.Name, email), id, "StartTx returns the saga's id")
	if commit {
		require.NoError(t, tx.Commit())
	} else {
		require.NoError(t, tx.Rollback())
	}
}

// waitFinished waits for the signup of email, 30 s at most.
func waitFinished(t *testing.T, c *saga.Client, def *saga.Definition, email string) saga.Instance {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	inst, err := c.WaitFinished(ctx, saga.ID(def.Name, email))
	require.NoError(t, err)
	return inst
}

// A saga started in the caller's transaction exists if, and only if, that
// transaction commits; the client runs it to the end.
func TestClientStartTxFollowsTheCallersTransaction(t *testing.T) {
	t.Parallel()
	c, def, db := newSignupClient(t)
	ctx := context.Background()
	startRunning(t, c)
	require.NoError(t, c.Health(ctx))
	signUp(t, c, def, "ghost@example.com", false)
	signUp(t, c, def, "ada@example.com", true)
	assert.Equal(t, saga.StatusCompleted, waitFinished(t, c, def, "ada@example.com").Status)

	var emails []string
	rows, err := db.SQL.Query(`SELECT email FROM opened`)
	require.NoError(t, err)
	for rows.Next() {
		var e string
		require.NoError(t, rows.Scan(&e))
		emails = append(emails, e)
	}
	require.NoError(t, rows.Err())
	assert.Equal(t, []string{"ada@example.com"}, emails, "the rolled-back start started nothing")
	_, err = c.Get(ctx, saga.ID(def.Name, "ghost@example.com"))
	require.ErrorIs(t, err, saga.ErrNoSuchSaga)
}

// What a client serves is fixed when it starts; misuse says why.
func TestClientRefusesMisuse(t *testing.T) {
	t.Parallel()
	c, def, _ := newSignupClient(t)
	ctx := context.Background()
	require.Error(t, c.Health(ctx), "not running yet")

	tx, err := c.DB().BeginTx(ctx, nil)
	require.NoError(t, err)
	defer tx.Rollback() //nolint:errcheck
	_, err = c.StartTx(ctx, tx, "no-such-saga", trigger("x@example.com"))
	require.ErrorIs(t, err, saga.ErrUnknownDefinition)

	require.NoError(t, c.Start(ctx))
	require.ErrorIs(t, c.Start(ctx), saga.ErrClientStarted)
	require.ErrorIs(t, c.Register(def), saga.ErrClientStarted)
	require.ErrorIs(t, c.AddSteps(), saga.ErrClientStarted)
	require.ErrorIs(t, c.AddProjections(), saga.ErrClientStarted)
	require.NoError(t, c.Stop(context.Background()))
	<-c.Stopped()
	require.Error(t, c.Health(ctx), "stopped")

	_, err = saga.NewClient(nil, saga.ClientConfig{})
	require.Error(t, err)
	noChannel, err := saga.NewClient(testdb.Shared(t).Pool, saga.ClientConfig{Logger: logger()})
	require.NoError(t, err)
	_, err = noChannel.WaitFinished(ctx, uuid.New())
	require.ErrorContains(t, err, "FinishedChannel")
}

// WaitFinished learns of an end that happened before it listened: it looks
// the instance up once it listens.
func TestClientWaitFinishedSeesAnEarlierEnd(t *testing.T) {
	t.Parallel()
	c, def, _ := newSignupClient(t)
	startRunning(t, c)
	signUp(t, c, def, "early@example.com", true)
	first := waitFinished(t, c, def, "early@example.com")
	again := waitFinished(t, c, def, "early@example.com") // the instance had ended before this wait began
	assert.Equal(t, first.Status, again.Status)
}

// A client that cannot run says why from Start, and may be started again
// once the cause is gone; nothing runs meanwhile.
func TestClientStartSaysWhyItCannotRun(t *testing.T) {
	t.Parallel()
	db := testdb.Custom(t, "TEMPLATE template0 ENCODING 'SQL_ASCII' LC_COLLATE 'C' LC_CTYPE 'C'")
	c, err := saga.NewClient(db.Pool, saga.ClientConfig{Logger: logger()})
	require.NoError(t, err)
	err = c.Start(context.Background())
	require.ErrorIs(t, err, transport.ErrNotUTF8)
	require.ErrorIs(t, c.Start(context.Background()), transport.ErrNotUTF8, "not ErrClientStarted: nothing runs")
	require.Error(t, c.Health(context.Background()))
	require.NoError(t, c.Stop(context.Background()))
}

// Waiters share one LISTEN connection: many of them on a small pool (4, as
// pgxpool gives a small machine) neither starve the worker nor each other.
func TestClientWaitersShareOneConnection(t *testing.T) {
	t.Parallel()
	c, def, db := newSignupClientOnPool(t, 4)
	startRunning(t, c)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	const waiters = 6
	results := make(chan error, waiters)
	for range waiters {
		go func() {
			inst, err := c.WaitFinished(ctx, saga.ID(def.Name, "many@example.com"))
			if err == nil && inst.Status != saga.StatusCompleted {
				err = fmt.Errorf("status %s", inst.Status)
			}
			results <- err
		}()
	}
	// Every waiter waits on the one listener before the saga starts.
	for deadline := time.Now().Add(30 * time.Second); ; {
		var listening int
		require.NoError(t, db.SQL.QueryRow(`SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND query LIKE 'LISTEN "signup_finished"%'`).Scan(&listening))
		if listening > 0 {
			require.Equal(t, 1, listening, "one LISTEN connection for all waiters")
			break
		}
		require.True(t, time.Now().Before(deadline), "nobody listens")
		time.Sleep(5 * time.Millisecond)
	}
	signUp(t, c, def, "many@example.com", true)
	for range waiters {
		require.NoError(t, <-results)
	}
}

// Stop during a Start that waits (here for a lock another session holds)
// ends that Start: nothing runs after Stop returns.
func TestClientStopDuringStartLeavesNothingRunning(t *testing.T) {
	t.Parallel()
	c, _, db := newSignupClient(t)
	ctx := context.Background()
	blocker, err := db.SQL.BeginTx(ctx, nil)
	require.NoError(t, err)
	defer blocker.Rollback() //nolint:errcheck
	_, err = blocker.Exec(`LOCK TABLE pgsaga_subscriptions IN EXCLUSIVE MODE`)
	require.NoError(t, err)
	started := make(chan error, 1)
	go func() { started <- c.Start(ctx) }()
	for deadline := time.Now().Add(30 * time.Second); ; {
		var waiting int
		require.NoError(t, db.SQL.QueryRow(`SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'`).Scan(&waiting))
		if waiting > 0 {
			break
		}
		require.True(t, time.Now().Before(deadline), "Start never waited for the lock")
		time.Sleep(5 * time.Millisecond)
	}
	require.NoError(t, c.Stop(context.Background()))
	require.Error(t, <-started, "the Start in progress gave up")
	require.NoError(t, blocker.Rollback())
	select {
	case <-c.Stopped():
	default:
		t.Fatal("Stopped is not closed after Stop")
	}
	require.Error(t, c.Health(ctx))
	require.ErrorIs(t, c.Start(ctx), saga.ErrClientStarted, "a stopped client does not start again")
}

// Stopped can be taken before Start: it closes when the client stops.
func TestClientStoppedTakenEarly(t *testing.T) {
	t.Parallel()
	c, _, _ := newSignupClient(t)
	early := c.Stopped()
	require.NotNil(t, early)
	startRunning(t, c)
	require.NoError(t, c.Stop(context.Background()))
	<-early
}

// Settings that would fail only once the client runs are refused when it
// is built; a cancelled context publishes nothing and the caller's message
// keeps its own context.
func TestClientChecksItsInputsUpFront(t *testing.T) {
	t.Parallel()
	pool := testdb.Shared(t).Pool
	for _, cfg := range []saga.ClientConfig{
		{KeyTTL: -time.Hour},
		{Prune: saga.PruneConfig{History: -time.Hour}},
		{FinishedChannel: strings.Repeat("x", 64)},
	} {
		_, err := saga.NewClient(pool, cfg)
		require.Error(t, err, "%+v", cfg)
	}

	c, def, _ := newSignupClient(t)
	require.NoError(t, c.Setup(context.Background()))
	tx, err := c.DB().BeginTx(context.Background(), nil)
	require.NoError(t, err)
	defer tx.Rollback() //nolint:errcheck
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	id, err := c.StartTx(ctx, tx, def.Name, trigger("late@example.com"))
	require.ErrorIs(t, err, context.Canceled)
	assert.Equal(t, uuid.Nil, id)
}

// ClientConfig.InProcessSteps names steps the client serves; a name it
// does not serve is refused when a worker is built.
// A nil step is refused when added, not a panic when a worker is built.
func TestClientRefusesANilStep(t *testing.T) {
	t.Parallel()
	c, err := saga.NewClient(testdb.Shared(t).Pool, saga.ClientConfig{Logger: logger()})
	require.NoError(t, err)
	require.ErrorContains(t, c.AddSteps(nil), "nil step")
}

func TestClientInProcessStepsMustBeServed(t *testing.T) {
	t.Parallel()
	c, err := saga.NewClient(testdb.Shared(t).Pool, saga.ClientConfig{InProcessSteps: []string{"nobody.serves"}, Logger: logger()})
	require.NoError(t, err)
	_, err = c.NewWorker()
	require.ErrorContains(t, err, `InProcessSteps names "nobody.serves"`)
}

// With InProcessEngine, StartTx starts the saga in the caller's
// transaction: once it commits the instance runs and its first command is
// queued, with no worker and no trigger queued; a rollback leaves nothing.
// A trigger the engine cannot start from is queued instead, for the
// workers to retry and dead-letter.
func TestClientStartTxInProcessStartsInTheCallersTransaction(t *testing.T) {
	t.Parallel()
	c, def, db := newSignupClientWith(t, 0, func(cfg *saga.ClientConfig) { cfg.InProcessEngine = true })
	// A saga whose first command cannot be built: the engine refuses to
	// start it.
	broken := saga.MustDefine(saga.Spec[signup]{
		Name:    "broken-signup",
		Trigger: saga.On("broken-signups", func(s SignedUp) (string, signup, error) { return s.Email, signup(s), nil }),
		Steps: []saga.Step[signup]{{Name: "account",
			Action: saga.Send(steps.Define[OpenAccount]("accounts.open", "accounts.open", nil), func(signup) OpenAccount { panic("no command for you") })}},
	})
	require.NoError(t, c.Register(broken))
	require.NoError(t, c.Setup(context.Background()))
	queued := func(topic string) int {
		var n int
		require.NoError(t, db.SQL.QueryRow(`SELECT count(*) FROM pgsaga_queue WHERE topic = $1`, topic).Scan(&n))
		return n
	}
	signUp(t, c, def, "ghost@example.com", false)
	signUp(t, c, def, "ada@example.com", true)
	inst, err := c.Get(context.Background(), saga.ID(def.Name, "ada@example.com"))
	require.NoError(t, err, "started at commit, with no worker running")
	assert.Equal(t, saga.StatusRunning, inst.Status)
	assert.Equal(t, "account", inst.Step)
	_, err = c.Get(context.Background(), saga.ID(def.Name, "ghost@example.com"))
	require.ErrorIs(t, err, saga.ErrNoSuchSaga)
	assert.Zero(t, queued(def.Trigger), "no trigger queued")
	assert.Equal(t, 1, queued("accounts.open"), "the first command is queued")

	ctx := context.Background()
	tx, err := c.DB().BeginTx(ctx, nil)
	require.NoError(t, err)
	_, err = c.StartTx(ctx, tx, def.Name, trigger("")) // no key: its start fails
	require.ErrorContains(t, err, "empty key")
	_, err = c.StartTx(ctx, tx, def.Name, OpenAccount{Email: "x@example.com"})
	require.ErrorIs(t, err, saga.ErrTriggerType)
	_, err = c.StartTx(ctx, tx, def.Name, (*SignedUp)(nil))
	require.ErrorIs(t, err, saga.ErrTriggerType, "a nil trigger is refused, not a panic")
	id, err := c.StartTx(ctx, tx, broken.Name, trigger("boom@example.com"))
	require.NoError(t, err)
	require.Equal(t, saga.ID(broken.Name, "boom@example.com"), id)
	require.NoError(t, tx.Commit())
	assert.Zero(t, queued(def.Trigger), "a trigger refused at StartTx is not queued")
	assert.Equal(t, 1, queued(broken.Trigger), "a trigger the engine cannot start from is queued, for the workers to dead-letter")

	startRunning(t, c)
	assert.Equal(t, saga.StatusCompleted, waitFinished(t, c, def, "ada@example.com").Status)
}

// A saga starts in the caller's pgx transaction (PgxTx) as in a *sql.Tx:
// it exists if, and only if, that transaction commits, in process (the
// engine's writes in the pgx transaction) or queued; PublishTx takes one
// too.
func TestClientStartTxInAPgxTx(t *testing.T) {
	t.Parallel()
	for _, inProcess := range []bool{false, true} {
		t.Run(fmt.Sprint("in-process=", inProcess), func(t *testing.T) {
			t.Parallel()
			c, def, db := newSignupClientWith(t, 0, func(cfg *saga.ClientConfig) { cfg.InProcessEngine = inProcess })
			require.NoError(t, c.Setup(context.Background()))
			ctx := context.Background()
			start := func(email string, commit bool) uuid.UUID {
				tx, err := db.Pool.Begin(ctx)
				require.NoError(t, err)
				defer tx.Rollback(ctx) //nolint:errcheck
				id, err := c.StartTx(ctx, saga.PgxTx(tx), def.Name, trigger(email))
				require.NoError(t, err)
				note, err := steps.NewMessage(trigger(email), steps.Envelope{})
				require.NoError(t, err)
				require.NoError(t, c.PublishTx(ctx, saga.PgxTx(tx), "signup-notes", note))
				if commit {
					require.NoError(t, tx.Commit(ctx))
				}
				return id
			}
			notes := func() int {
				var n int
				require.NoError(t, db.SQL.QueryRow(`SELECT count(*) FROM pgsaga_queue WHERE topic = 'signup-notes'`).Scan(&n))
				return n
			}
			tr, err := transport.New(transport.Config{DB: db.SQL})
			require.NoError(t, err)
			require.NoError(t, tr.Subscribe(ctx, transport.Subscription{Topic: "signup-notes", ConsumerGroup: "notes"}))
			ghost := start("ghost@example.com", false)
			assert.Zero(t, notes(), "a rolled-back pgx transaction publishes nothing")
			id := start("ada@example.com", true)
			assert.Equal(t, 1, notes(), "published at the pgx transaction's commit")
			_, err = c.Get(ctx, id)
			if inProcess {
				require.NoError(t, err, "the engine started it in the pgx transaction, with no worker running")
			} else {
				require.ErrorIs(t, err, saga.ErrNoSuchSaga, "its trigger waits for a worker")
			}
			startRunning(t, c)
			done := waitFinished(t, c, def, "ada@example.com")
			assert.Equal(t, saga.StatusCompleted, done.Status)
			assert.Equal(t, "ada@example.com", done.CorrelationID, "the saga's correlation id is its key")
			assert.Equal(t, saga.ID(def.Name, "ada@example.com"), id)
			_, err = c.Get(ctx, ghost)
			require.ErrorIs(t, err, saga.ErrNoSuchSaga, "a rolled-back pgx transaction starts nothing")
		})
	}
}
