package idempotency_test

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/idempotency"
	"github.com/pgsaga/pgsaga/saga/delivery"
	"github.com/pgsaga/pgsaga/steps"
)

// messageKeysEnv is a MessageKeys over the shared database, with its
// replies recorded.
type messageKeysEnv struct {
	store *idempotency.Store
	keys  *idempotency.MessageKeys
	db    *sql.DB
	pub   *recordingPublisher
	scope string
}

func newMessageKeys(t *testing.T) *messageKeysEnv {
	t.Helper()
	s, db := newStore(t, nil)
	e := &messageKeysEnv{store: s, db: db.SQL, pub: &recordingPublisher{out: map[string][]*message.Message{}}, scope: "step-" + uuid.NewString()[:8]}
	keys, err := s.MessageKeys(idempotency.MiddlewareConfig{
		Scope:       e.scope,
		KeyMetadata: "key",
		Publisher:   func(delivery.DBTX) message.Publisher { return e.pub },
	})
	require.NoError(t, err)
	e.keys = keys
	return e
}

// inTx runs fn in a transaction and commits it when fn succeeds.
func (e *messageKeysEnv) inTx(t *testing.T, fn func(tx *sql.Tx) error) error {
	t.Helper()
	tx, err := e.db.Begin()
	require.NoError(t, err)
	defer tx.Rollback() //nolint:errcheck
	if err := fn(tx); err != nil {
		return err
	}
	return tx.Commit()
}

// The first delivery of a key runs; a duplicate (a new message, same key)
// gets the stored reply published again, with its UUID, marked replayed.
func TestMessageKeysClaimFinishReplay(t *testing.T) {
	t.Parallel()
	e := newMessageKeys(t)
	ctx := context.Background()
	reply := message.NewMessage(uuid.NewString(), []byte(`{"ok":true}`))
	require.NoError(t, e.inTx(t, func(tx *sql.Tx) error {
		claim, err := e.keys.ClaimTx(ctx, tx, command("k1", `{"n":1}`))
		require.NoError(t, err)
		require.True(t, claim.Run, "a new key runs")
		return e.keys.FinishTx(ctx, tx, claim, idempotency.StatusCompleted, "", reply)
	}))
	require.NoError(t, e.inTx(t, func(tx *sql.Tx) error {
		claim, err := e.keys.ClaimTx(ctx, tx, command("k1", `{"n":1}`))
		require.NoError(t, err)
		assert.False(t, claim.Run, "a duplicate does not run")
		require.ErrorIs(t, e.keys.FinishTx(ctx, tx, claim, idempotency.StatusCompleted, ""), idempotency.ErrNothingToFinish)
		return nil
	}))
	replies := e.pub.out["replies"]
	require.Len(t, replies, 2)
	assert.Equal(t, reply.UUID, replies[1].UUID)
	assert.Equal(t, `{"ok":true}`, string(replies[1].Payload))
	assert.Empty(t, replies[0].Metadata.Get(steps.MetaReplayed))
	assert.Equal(t, "true", replies[1].Metadata.Get(steps.MetaReplayed))
}

// A business failure is stored failed with its reason and reply, and
// replayed like a success.
func TestMessageKeysStoreFailure(t *testing.T) {
	t.Parallel()
	e := newMessageKeys(t)
	ctx := context.Background()
	refusal := message.NewMessage(uuid.NewString(), []byte(`{"refused":true}`))
	require.NoError(t, e.inTx(t, func(tx *sql.Tx) error {
		claim, err := e.keys.ClaimTx(ctx, tx, command("k1", `{}`))
		require.NoError(t, err)
		require.True(t, claim.Run)
		return e.keys.FinishTx(ctx, tx, claim, idempotency.StatusFailed, "out of stock", refusal)
	}))
	rec, err := e.store.Get(ctx, e.scope, "k1")
	require.NoError(t, err)
	assert.Equal(t, idempotency.StatusFailed, rec.Status)
	var body struct {
		Reason string `json:"reason"`
	}
	require.NoError(t, json.Unmarshal(rec.Response.Body, &body))
	assert.Equal(t, "out of stock", body.Reason)

	require.NoError(t, e.inTx(t, func(tx *sql.Tx) error {
		claim, err := e.keys.ClaimTx(ctx, tx, command("k1", `{}`))
		require.NoError(t, err)
		assert.False(t, claim.Run)
		return nil
	}))
	replies := e.pub.out["replies"]
	require.Len(t, replies, 2)
	assert.Equal(t, refusal.UUID, replies[1].UUID)
}

// FinishTx completes only a key claimed in its transaction: a claim whose
// transaction rolled back is gone, and finishing it elsewhere stores
// nothing and says so.
func TestMessageKeysFinishNeedsAClaim(t *testing.T) {
	t.Parallel()
	e := newMessageKeys(t)
	ctx := context.Background()
	var claim *idempotency.MessageClaim
	err := e.inTx(t, func(tx *sql.Tx) error {
		var err error
		claim, err = e.keys.ClaimTx(ctx, tx, command("rolled-back", `{}`))
		require.NoError(t, err)
		return errors.New("the work failed")
	})
	require.Error(t, err)
	err = e.inTx(t, func(tx *sql.Tx) error {
		return e.keys.FinishTx(ctx, tx, claim, idempotency.StatusCompleted, "")
	})
	require.ErrorIs(t, err, idempotency.ErrNotClaimed)
	_, err = e.store.Get(ctx, e.scope, "rolled-back")
	require.ErrorIs(t, err, idempotency.ErrNoSuchKey)
	require.ErrorIs(t, e.keys.FinishTx(ctx, e.db, nil, idempotency.StatusCompleted, ""), idempotency.ErrInvalidRequest)
}

// Bad calls are refused before anything is written: a status that is not
// final, replies for a message that names no reply topic, a key reused for
// another message.
func TestMessageKeysRefuseBadCalls(t *testing.T) {
	t.Parallel()
	e := newMessageKeys(t)
	ctx := context.Background()
	err := e.inTx(t, func(tx *sql.Tx) error {
		claim, err := e.keys.ClaimTx(ctx, tx, command("k1", `{}`))
		if err != nil {
			return err
		}
		return e.keys.FinishTx(ctx, tx, claim, idempotency.StatusPending, "")
	})
	require.ErrorIs(t, err, idempotency.ErrInvalidRequest)

	noReplyTo := message.NewMessage(uuid.NewString(), []byte(`{}`))
	noReplyTo.Metadata.Set("key", "k2")
	err = e.inTx(t, func(tx *sql.Tx) error {
		claim, err := e.keys.ClaimTx(ctx, tx, noReplyTo)
		if err != nil {
			return err
		}
		return e.keys.FinishTx(ctx, tx, claim, idempotency.StatusCompleted, "", message.NewMessage(uuid.NewString(), nil))
	})
	require.ErrorContains(t, err, "names no reply topic")
	assert.Empty(t, e.pub.out)

	require.NoError(t, e.inTx(t, func(tx *sql.Tx) error {
		claim, err := e.keys.ClaimTx(ctx, tx, command("k3", `{"n":1}`))
		if err != nil {
			return err
		}
		return e.keys.FinishTx(ctx, tx, claim, idempotency.StatusCompleted, "")
	}))
	err = e.inTx(t, func(tx *sql.Tx) error {
		_, err := e.keys.ClaimTx(ctx, tx, command("k3", `{"n":2}`))
		return err
	})
	require.ErrorIs(t, err, idempotency.ErrKeyReused)

	_, err = e.store.MessageKeys(idempotency.MiddlewareConfig{})
	require.ErrorIs(t, err, idempotency.ErrInvalidRequest)
}

// A claim is finished once, in the transaction that made it: a second
// FinishTx publishes nothing more and says why; finishing in another
// transaction is refused before anything is published.
func TestMessageKeysFinishOnceInTheClaimsTransaction(t *testing.T) {
	t.Parallel()
	e := newMessageKeys(t)
	ctx := context.Background()
	require.NoError(t, e.inTx(t, func(tx *sql.Tx) error {
		claim, err := e.keys.ClaimTx(ctx, tx, command("k1", `{}`))
		require.NoError(t, err)
		require.NoError(t, e.keys.FinishTx(ctx, tx, claim, idempotency.StatusCompleted, "", message.NewMessage(uuid.NewString(), []byte(`{"ok":true}`))))
		err = e.keys.FinishTx(ctx, tx, claim, idempotency.StatusFailed, "changed my mind", message.NewMessage(uuid.NewString(), []byte(`{"ok":false}`)))
		require.ErrorIs(t, err, idempotency.ErrNothingToFinish)
		return nil
	}))
	require.Len(t, e.pub.out["replies"], 1, "the second finish published nothing")
	rec, err := e.store.Get(ctx, e.scope, "k1")
	require.NoError(t, err)
	assert.Equal(t, idempotency.StatusCompleted, rec.Status)

	err = e.inTx(t, func(tx *sql.Tx) error {
		claim, err := e.keys.ClaimTx(ctx, tx, command("k2", `{}`))
		require.NoError(t, err)
		other, err := e.db.Begin()
		require.NoError(t, err)
		defer other.Rollback() //nolint:errcheck
		return e.keys.FinishTx(ctx, other, claim, idempotency.StatusCompleted, "", message.NewMessage(uuid.NewString(), nil))
	})
	require.ErrorIs(t, err, idempotency.ErrNotClaimed)
	require.Len(t, e.pub.out["replies"], 1, "nothing published for a claim finished elsewhere")
}
