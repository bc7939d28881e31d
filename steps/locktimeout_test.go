package steps_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/idempotency"
	"github.com/pgsaga/pgsaga/internal/stepsrt"
	"github.com/pgsaga/pgsaga/internal/testdb"
	"github.com/pgsaga/pgsaga/internal/transport"
	"github.com/pgsaga/pgsaga/steps"
	"github.com/pgsaga/pgsaga/steps/events"
)

// The lock timeout of a batch's claim of its keys (the idempotency
// store's) ends with the claim: the step's handler waits for locks as
// long as the transport's LockTimeout allows, not the claim's.
func TestTheClaimsLockTimeoutEndsWithTheClaim(t *testing.T) {
	t.Parallel()
	db := testdb.Shared(t)
	tr, err := transport.New(transport.Config{
		DB: db.SQL, Logger: logger(), IdlePollInterval: testdb.NoSafetyPoll, LockTimeout: 7 * time.Second,
		Retry: transport.RetryPolicy{MaxAttempts: 1},
	})
	require.NoError(t, err)
	store, err := idempotency.NewStore(idempotency.Config{DB: db.SQL, LockTimeout: 250 * time.Millisecond})
	require.NoError(t, err)
	es, err := events.NewStore(events.Config{Registry: events.NewRegistry()})
	require.NoError(t, err)
	rt, err := stepsrt.New(stepsrt.Config{Transport: tr, Store: store, Events: es, Logger: logger()})
	require.NoError(t, err)
	id := uuid.NewString()[:8]
	seen := make(chan string, 3)
	step := steps.Define("locks-"+id, "locks_"+id, func(ctx context.Context, tx *steps.Tx, cmd addCmd) (steps.Message, error) {
		var lt string
		if err := tx.QueryRowContext(ctx, `SELECT current_setting('lock_timeout')`).Scan(&lt); err != nil {
			return nil, err
		}
		seen <- lt
		return nil, nil
	})
	require.NoError(t, tr.Subscribe(context.Background(), rt.Subscriptions(step)...))
	// Queued before the router starts: one batch, whose keys are claimed
	// together.
	for i := range 3 {
		msg, err := steps.NewMessage(addCmd{Account: "a", Amount: i}, steps.Envelope{Key: fmt.Sprintf("k-%s-%d", id, i)})
		require.NoError(t, err)
		require.NoError(t, tr.Publisher(db.SQL).Publish(step.Topic(), msg))
	}
	r, err := tr.NewRouter()
	require.NoError(t, err)
	require.NoError(t, rt.Register(r, step))
	require.NoError(t, r.Start(context.Background()))
	defer func() { require.NoError(t, r.Stop()) }()
	for range 3 {
		select {
		case lt := <-seen:
			assert.Equal(t, "7s", lt, "the transport's lock timeout, not the claim's")
		case <-time.After(30 * time.Second):
			t.Fatal("the step never ran")
		}
	}
}
