package saga_test

import (
	"context"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/internal/testdb"
	"github.com/pgsaga/pgsaga/saga"
	"github.com/pgsaga/pgsaga/steps"
	"github.com/pgsaga/pgsaga/steps/transport"
)

// newSignupClient is a client serving a one-step signup saga whose step
// records each e-mail in a table, on a database of its own.
func newSignupClient(t *testing.T) (*saga.Client, *saga.Definition, *testdb.DB) {
	t.Helper()
	db := testdb.Fresh(t)
	_, err := db.SQL.Exec(`CREATE TABLE opened (email text PRIMARY KEY)`)
	require.NoError(t, err)
	c, err := saga.NewClient(db.Pool, saga.ClientConfig{
		Transport:       transport.Config{PollInterval: 20 * time.Millisecond, IdlePollInterval: testdb.NoSafetyPoll},
		FinishedChannel: "signup_finished",
		Logger:          logger(),
	})
	require.NoError(t, err)
	open := steps.Define("accounts.open", "accounts.open", func(ctx context.Context, tx *steps.Tx, cmd OpenAccount) (steps.Message, error) {
		_, err := tx.ExecContext(ctx, `INSERT INTO opened VALUES ($1)`, cmd.Email)
		return Done{}, err
	})
	def := saga.MustDefine(saga.Spec[signup]{
		Name: "signup",
		Trigger: saga.Trigger[signup]{Topic: "signups", Start: func(msg *message.Message) (string, signup, error) {
			s, err := steps.Decode[SignedUp](msg)
			return s.Email, signup(s), err
		}},
		Steps: []saga.Step[signup]{{Name: "account", Deadline: time.Minute,
			Action: &saga.Command[signup]{Topic: open.Topic, Build: func(s signup) steps.Message { return OpenAccount(s) }}}},
	})
	require.NoError(t, c.Register(def))
	require.NoError(t, c.AddSteps(open))
	return c, def, db
}

func trigger(t *testing.T, email string) *message.Message {
	t.Helper()
	m, err := steps.NewMessage(SignedUp{Email: email}, steps.Envelope{})
	require.NoError(t, err)
	return m
}

// startRunning starts c until the test ends.
func startRunning(t *testing.T, c *saga.Client) {
	t.Helper()
	require.NoError(t, c.Start(context.Background()))
	t.Cleanup(func() { require.NoError(t, c.Stop()) })
}

// signUp starts the signup of email in a transaction that commits, or
// rolls back if commit is false.
func signUp(t *testing.T, c *saga.Client, def *saga.Definition, email string, commit bool) {
	t.Helper()
	ctx := context.Background()
	tx, err := c.DB().BeginTx(ctx, nil)
	require.NoError(t, err)
	require.NoError(t, c.StartTx(ctx, tx, def.Name, trigger(t, email)))
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
	_, err = c.Engine().Get(ctx, saga.ID(def.Name, "ghost@example.com"))
	require.ErrorIs(t, err, saga.ErrNotFound)
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
	require.ErrorIs(t, c.StartTx(ctx, tx, "no-such-saga", trigger(t, "x@example.com")), saga.ErrUnknownDefinition)

	require.NoError(t, c.Start(ctx))
	require.ErrorIs(t, c.Start(ctx), saga.ErrClientStarted)
	require.ErrorIs(t, c.Register(def), saga.ErrClientStarted)
	require.ErrorIs(t, c.AddSteps(), saga.ErrClientStarted)
	require.ErrorIs(t, c.AddProjections(), saga.ErrClientStarted)
	require.NoError(t, c.Stop())
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
	require.NoError(t, c.Stop())
}
