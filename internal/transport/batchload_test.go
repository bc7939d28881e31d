package transport_test

import (
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/internal/dbtx"
	"github.com/pgsaga/pgsaga/internal/transport"
)

// preloads is what each message's attempt found loaded for it: its first
// take and whether a second take found anything.
type preloads struct {
	mu    sync.Mutex
	first map[string]any
	again map[string]bool
	txids map[int64]bool // the transactions the attempts ran in
}

// loadEach runs env e's messages (published before the router starts, one
// claim takes them all) through a handler that loads, for the batch, a
// value per message with statement query (its one argument the messages'
// UUIDs), and records what each attempt took.
func loadEach(t *testing.T, e *env, n int, query string) *preloads {
	t.Helper()
	return loadEachWith(t, e, n, query, nil)
}

// loadEachWith is loadEach whose load's reader fails with scanErr, unless
// nil.
func loadEachWith(t *testing.T, e *env, n int, query string, scanErr error) *preloads {
	t.Helper()
	e.publish(n)
	p := &preloads{first: map[string]any{}, again: map[string]bool{}, txids: map[int64]bool{}}
	load := transport.BatchLoad{
		Key: func(msg *message.Message) (string, []any, bool) { return msg.UUID, []any{msg.UUID}, true },
		Statement: func(rows [][]any) (string, []any) {
			return query, []any{dbtx.Column[string](rows, 0)}
		},
		Scan: func(rows pgx.Rows) (string, any, error) {
			var u string
			if err := rows.Scan(&u); err != nil {
				return "", nil, err
			}
			if scanErr != nil {
				return "", nil, scanErr
			}
			return u, "loaded " + u, nil
		},
	}
	r, err := e.tr.NewRouter()
	require.NoError(t, err)
	require.NoError(t, r.AddHandler("h", e.in, "g", func(msg *message.Message) error {
		tx, _ := transport.TxFromContext(msg.Context())
		v, _ := transport.Preloaded(tx, msg.UUID)
		_, again := transport.Preloaded(tx, msg.UUID)
		var txid int64
		if err := tx.QueryRowContext(msg.Context(), `SELECT txid_current()`).Scan(&txid); err != nil {
			return err
		}
		p.mu.Lock()
		p.first[msg.UUID], p.again[msg.UUID] = v, again
		p.txids[txid] = true
		p.mu.Unlock()
		if err := effect(msg, e.eff, "a"); err != nil {
			return err
		}
		return effect(msg, e.eff, "b")
	}, transport.LoadPerBatch(load)))
	startRouter(t, r)
	e.drained(e.in, "g", 10*time.Second)
	assertExactlyOnce(t, e, n)
	return p
}

// A batch loads a value for each of its messages in one statement; each
// attempt takes its own, once.
func TestABatchLoadHandsEachMessageItsValueOnce(t *testing.T) {
	t.Parallel()
	e := newEnv(t, oneBatch(0))
	p := loadEach(t, e, 5, `SELECT u FROM unnest($1::text[]) AS u`)
	require.Len(t, p.first, 5)
	for u, v := range p.first {
		assert.Equal(t, "loaded "+u, v)
		assert.False(t, p.again[u], "handed out once")
	}
}

// A load that fails leaves the batch usable: every message is handled in
// the batch's transaction, finding nothing loaded (it reads for itself).
func TestAFailedBatchLoadLeavesTheAttemptsToRead(t *testing.T) {
	t.Parallel()
	e := newEnv(t, oneBatch(0))
	p := loadEach(t, e, 5, `SELECT u FROM unnest($1::text[]) AS u WHERE 1 / (length(u) - length(u)) = 1`)
	require.Len(t, p.first, 5)
	for u, v := range p.first {
		assert.Nil(t, v, "nothing loaded for %s", u)
	}
	assert.Len(t, p.txids, 1, "one transaction: the batch went on after its load failed")
	assert.Empty(t, e.deadLetters(e.in))
}

// A load whose rows cannot be read (in the client, the server having run
// the prelude to its end) leaves the batch usable too.
func TestABatchLoadItsReaderRefusedLeavesTheAttemptsToRead(t *testing.T) {
	t.Parallel()
	e := newEnv(t, oneBatch(0))
	p := loadEachWith(t, e, 5, `SELECT u FROM unnest($1::text[]) AS u`, errors.New("unreadable"))
	require.Len(t, p.first, 5)
	for u, v := range p.first {
		assert.Nil(t, v, "nothing loaded for %s", u)
	}
	assert.Len(t, p.txids, 1, "one transaction: the batch went on after its load failed")
}
