package idempotency_test

import (
	"context"
	"database/sql"
	"errors"
	"sync"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/idempotency"
	"github.com/pgsaga/pgsaga/saga/delivery"
	"github.com/pgsaga/pgsaga/steps"
)

// recordingPublisher keeps what it is asked to publish.
type recordingPublisher struct {
	mu  sync.Mutex
	out map[string][]*message.Message
}

func (p *recordingPublisher) Publish(topic string, msgs ...*message.Message) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.out[topic] = append(p.out[topic], msgs...)
	return nil
}

func (p *recordingPublisher) Close() error { return nil }

type txKey struct{}

// deliverInTx runs the wrapped handler on msg in a transaction of its own and
// commits it if the handler succeeded, as a subscriber would.
func deliverInTx(t *testing.T, db *sql.DB, h message.HandlerFunc, msg *message.Message) error {
	t.Helper()
	tx, err := db.Begin()
	require.NoError(t, err)
	defer tx.Rollback() //nolint:errcheck
	m := msg.Copy()
	m.SetContext(context.WithValue(context.Background(), txKey{}, tx))
	if _, err := h(m); err != nil {
		return err
	}
	return tx.Commit()
}

// middlewareEnv is a store, a middleware over it, and where replies go.
type middlewareEnv struct {
	store *idempotency.Store
	scope string
}

func newMiddleware(t *testing.T) (*middlewareEnv, *sql.DB, *recordingPublisher, message.HandlerMiddleware) {
	s, db := newStore(t, nil)
	pub := &recordingPublisher{out: map[string][]*message.Message{}}
	scope := "handler-" + uuid.NewString()[:8]
	mw, err := s.Middleware(idempotency.MiddlewareConfig{
		Scope:       scope,
		KeyMetadata: "key",
		TxFromContext: func(ctx context.Context) (delivery.DBTX, bool) {
			tx, ok := ctx.Value(txKey{}).(*sql.Tx)
			return tx, ok
		},
		Publisher: func(delivery.DBTX) message.Publisher { return pub },
	})
	require.NoError(t, err)
	return &middlewareEnv{store: s, scope: scope}, db.SQL, pub, mw
}

func command(key, payload string) *message.Message {
	m := message.NewMessage(uuid.NewString(), []byte(payload))
	m.Metadata.Set("key", key)
	m.Metadata.Set(steps.MetaReplyTo, "replies")
	return m
}

// Duplicates of a handled message do not run the handler again; each gets the
// stored reply published again with its original UUID, marked as a replay.
func TestMiddlewareReplaysStoredReply(t *testing.T) {
	t.Parallel()
	_, db, pub, mw := newMiddleware(t)
	calls := 0
	h := mw(func(msg *message.Message) ([]*message.Message, error) {
		calls++
		return []*message.Message{message.NewMessage(uuid.NewString(), []byte(`{"ok":true}`))}, nil
	})
	for range 3 {
		// A re-sent command: new message UUID, same key.
		require.NoError(t, deliverInTx(t, db, h, command("k1", `{"n":1}`)))
	}
	assert.Equal(t, 1, calls)
	replies := pub.out["replies"]
	require.Len(t, replies, 3)
	for i, r := range replies {
		assert.Equal(t, replies[0].UUID, r.UUID)
		assert.Equal(t, `{"ok":true}`, string(r.Payload))
		assert.Equal(t, i > 0, r.Metadata.Get(steps.MetaReplayed) == "true")
	}
}

func TestMiddlewareRejectsReusedKey(t *testing.T) {
	t.Parallel()
	_, db, _, mw := newMiddleware(t)
	h := mw(func(msg *message.Message) ([]*message.Message, error) { return nil, nil })
	require.NoError(t, deliverInTx(t, db, h, command("k1", `{"n":1}`)))
	err := deliverInTx(t, db, h, command("k1", `{"n":2}`))
	require.ErrorIs(t, err, idempotency.ErrKeyReused)
}

// A Rejection is stored as failed, with its replies, and replayed.
func TestMiddlewareStoresRejection(t *testing.T) {
	t.Parallel()
	me, db, pub, mw := newMiddleware(t)
	calls := 0
	h := mw(func(msg *message.Message) ([]*message.Message, error) {
		calls++
		return nil, idempotency.Reject("out of stock", message.NewMessage(uuid.NewString(), []byte(`{"refused":true}`)))
	})
	msg := command("k1", `{}`)
	require.NoError(t, deliverInTx(t, db, h, msg))
	require.NoError(t, deliverInTx(t, db, h, msg))
	assert.Equal(t, 1, calls)
	require.Len(t, pub.out["replies"], 2)
	rec, err := me.store.Get(context.Background(), me.scope, "k1")
	require.NoError(t, err)
	assert.Equal(t, idempotency.StatusFailed, rec.Status)
}

// A handler error stores nothing: once the transaction rolls back, the next
// delivery executes.
func TestMiddlewareTransientErrorStoresNothing(t *testing.T) {
	t.Parallel()
	_, db, _, mw := newMiddleware(t)
	calls := 0
	h := mw(func(msg *message.Message) ([]*message.Message, error) {
		calls++
		if calls == 1 {
			return nil, errors.New("database hiccup")
		}
		return nil, nil
	})
	msg := command("k1", `{}`)
	require.Error(t, deliverInTx(t, db, h, msg))
	require.NoError(t, deliverInTx(t, db, h, msg))
	assert.Equal(t, 2, calls)
}

func TestMiddlewareNeedsTransaction(t *testing.T) {
	t.Parallel()
	_, _, _, mw := newMiddleware(t)
	h := mw(func(msg *message.Message) ([]*message.Message, error) { return nil, nil })
	_, err := h(command("k", `{}`))
	require.ErrorContains(t, err, "carries no transaction")
}
