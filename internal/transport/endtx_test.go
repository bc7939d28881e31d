package transport_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/internal/transport"
)

// A handler that ends its attempt's transaction (COMMIT, END, ROLLBACK, or
// COMMIT with more statements behind it) commits nothing of the attempt:
// not what it wrote before, not what it tries after. The message is
// dead-lettered in one attempt, since its handler would do it every time;
// the messages handled before it in the same batch are rolled back with it
// and handled again, once. Through a Router and through HandleInTx alike.
func TestHandlerEndingItsTransactionCommitsNothing(t *testing.T) {
	t.Parallel()
	for _, ending := range []string{"COMMIT", "END", "ROLLBACK", "COMMIT AND CHAIN", "COMMIT; INSERT INTO %s (msg, part) VALUES ('sneaked', 'in')"} {
		t.Run("router/"+ending, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t, nil)
			r, err := e.tr.NewRouter()
			require.NoError(t, err)
			var afterErr atomic.Value
			require.NoError(t, r.AddHandler("h", e.in, "g", func(msg *message.Message) error {
				if err := effect(msg, e.eff, "a"); err != nil {
					return err
				}
				if msg.Metadata.Get("ends") != "yes" {
					return effect(msg, e.eff, "b")
				}
				tx, _ := transport.TxFromContext(msg.Context())
				if err := e.tr.Publisher(tx).Publish(e.out, message.NewMessage(replyID(msg), nil)); err != nil {
					return err
				}
				_, _ = tx.ExecContext(msg.Context(), statement(ending, e.eff))
				err := effect(msg, e.eff, "b")
				afterErr.Store(&err)
				return err
			}))
			startRouter(t, r)

			var msgs []*message.Message
			for i := range 5 {
				msgs = append(msgs, message.NewMessage(fmt.Sprintf("m%d-%s", i, e.id), []byte(`{}`)))
			}
			bad := message.NewMessage("ends-"+e.id, []byte(`{}`))
			bad.Metadata.Set("ends", "yes")
			require.NoError(t, e.tr.Publisher(e.db.SQL).Publish(e.in, append(msgs, bad)...)) // one batch, the bad one last

			e.drained(e.in, "g", 10*time.Second)
			assert.ErrorIs(t, *afterErr.Load().(*error), transport.ErrTransactionEnded, "the handler can do nothing more")
			assert.Zero(t, e.count(`SELECT count(*) FROM `+e.eff+` WHERE msg = $1 OR msg = 'sneaked'`, bad.UUID), "nothing of the attempt committed")
			assert.Zero(t, e.published(), "nor its outgoing message")
			dead := e.deadLetters(e.in)
			require.Len(t, dead, 1)
			assert.Equal(t, bad.UUID, dead[0].UUID)
			assert.Equal(t, 1, dead[0].Attempts)
			assert.Contains(t, dead[0].Reason, "ended its attempt's transaction")
			for _, m := range msgs {
				assert.Equal(t, 2, e.count(`SELECT count(*) FROM `+e.eff+` WHERE msg = $1`, m.UUID), "%s handled once, completely", m.UUID)
			}
		})
		t.Run("own transaction/"+ending, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t, nil)
			msg := message.NewMessage("ends-"+e.id, []byte(`{}`))
			var calls atomic.Int32
			err := e.tr.HandleInTx(context.Background(), "h", e.in, msg, func(msg *message.Message) error {
				calls.Add(1)
				if err := effect(msg, e.eff, "a"); err != nil {
					return err
				}
				tx, _ := transport.TxFromContext(msg.Context())
				_, _ = tx.ExecContext(msg.Context(), statement(ending, e.eff))
				return effect(msg, e.eff, "b")
			})
			require.ErrorIs(t, err, transport.ErrDeadLettered)
			require.ErrorIs(t, err, transport.ErrTransactionEnded)
			assert.Zero(t, e.count(`SELECT count(*) FROM `+e.eff), "nothing committed")
			dead := e.deadLetters(e.in)
			require.Len(t, dead, 1)
			assert.Equal(t, 1, dead[0].Attempts, "one attempt: it would end its transaction every time")
			assert.EqualValues(t, 1, calls.Load())
		})
	}
}

// statement fills the effects table into ending, if it names one.
func statement(ending, table string) string {
	if strings.Contains(ending, "%s") {
		return fmt.Sprintf(ending, table)
	}
	return ending
}

// A handler's own savepoints keep their meaning with queued writes: a
// message published before SAVEPOINT survives a ROLLBACK TO it, one
// published after does not, however the statements are written (here the
// SAVEPOINT hides behind a SELECT in one string). Nothing is parsed: what
// is queued is sent before the handler's next statement.
func TestHandlerSavepointsKeepQueuedWrites(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	r, err := e.tr.NewRouter()
	require.NoError(t, err)
	require.NoError(t, r.AddHandler("h", e.in, "g", func(msg *message.Message) error {
		tx, _ := transport.TxFromContext(msg.Context())
		pub := e.tr.Publisher(tx)
		if err := pub.Publish(e.out, message.NewMessage("kept-"+msg.UUID, nil)); err != nil {
			return err
		}
		if _, err := tx.ExecContext(msg.Context(), `SELECT 1; SAVEPOINT mine`); err != nil {
			return err
		}
		if err := pub.Publish(e.out, message.NewMessage("taken-back-"+msg.UUID, nil)); err != nil {
			return err
		}
		if _, err := tx.ExecContext(msg.Context(), `ROLLBACK TO SAVEPOINT mine`); err != nil {
			return err
		}
		return effect(msg, e.eff, "row")
	}))
	startRouter(t, r)
	ids := e.publish(2)
	e.drained(e.in, "g", 10*time.Second)
	for _, id := range ids {
		assert.Equal(t, 1, e.count(`SELECT count(*) FROM pgsaga_queue WHERE topic = $1 AND uuid = $2`, e.out, "kept-"+id), "published before the savepoint")
		assert.Zero(t, e.count(`SELECT count(*) FROM pgsaga_queue WHERE topic = $1 AND uuid = $2`, e.out, "taken-back-"+id), "published after it")
	}
	assert.Equal(t, 2, e.count(`SELECT count(*) FROM `+e.eff))
	assert.Empty(t, e.deadLetters(e.in))
}

// Savepoint rolls back what its function wrote and published when it fails,
// keeps it when it succeeds, and the attempt goes on either way.
func TestSavepointHelper(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	r, err := e.tr.NewRouter()
	require.NoError(t, err)
	require.NoError(t, r.AddHandler("h", e.in, "g", func(msg *message.Message) error {
		ctx := msg.Context()
		tx, _ := transport.TxFromContext(ctx)
		pub := e.tr.Publisher(tx)
		if err := pub.Publish(e.out, message.NewMessage("before-"+msg.UUID, nil)); err != nil {
			return err
		}
		err := transport.Savepoint(ctx, tx, func(tx transport.Tx) error {
			if err := e.tr.Publisher(tx).Publish(e.out, message.NewMessage("failed-"+msg.UUID, nil)); err != nil {
				return err
			}
			if _, err := tx.ExecContext(ctx, `INSERT INTO `+e.eff+` (msg, part) VALUES ($1, 'failed')`, msg.UUID); err != nil {
				return err
			}
			_, err := tx.ExecContext(ctx, `SELECT 1/0`) // and the transaction is saved all the same
			return err
		})
		if err == nil {
			return errors.New("the failing function's error is returned")
		}
		if err := transport.Savepoint(ctx, tx, func(tx transport.Tx) error {
			return e.tr.Publisher(tx).Publish(e.out, message.NewMessage("succeeded-"+msg.UUID, nil))
		}); err != nil {
			return err
		}
		return effect(msg, e.eff, "row")
	}))
	startRouter(t, r)
	ids := e.publish(1)
	e.drained(e.in, "g", 10*time.Second)
	for prefix, want := range map[string]int{"before-": 1, "failed-": 0, "succeeded-": 1} {
		assert.Equal(t, want, e.count(`SELECT count(*) FROM pgsaga_queue WHERE topic = $1 AND uuid = $2`, e.out, prefix+ids[0]), prefix)
	}
	assert.Equal(t, 1, e.count(`SELECT count(*) FROM `+e.eff), "the failed function's row was rolled back")
	assert.Empty(t, e.deadLetters(e.in))

	// Outside an attempt it works on a plain transaction.
	tx, err := e.db.SQL.Begin()
	require.NoError(t, err)
	require.Error(t, transport.Savepoint(context.Background(), tx, func(tx transport.Tx) error {
		_, err := tx.ExecContext(context.Background(), `INSERT INTO `+e.eff+` (msg, part) VALUES ('plain', 'x')`)
		require.NoError(t, err)
		return errors.New("undo")
	}))
	require.NoError(t, tx.Commit())
	assert.Zero(t, e.count(`SELECT count(*) FROM `+e.eff+` WHERE msg = 'plain'`))
}

// A queued statement that fails fails its attempt, and the error names the
// statement; nothing of the attempt is kept.
func TestQueuedStatementErrorsNameTheStatement(t *testing.T) {
	t.Parallel()
	e := newEnv(t, func(c *transport.Config) { c.Retry.MaxAttempts = 1 })
	r, err := e.tr.NewRouter()
	require.NoError(t, err)
	require.NoError(t, r.AddHandler("h", e.in, "g", func(msg *message.Message) error {
		tx, _ := transport.TxFromContext(msg.Context())
		if err := effect(msg, e.eff, "row"); err != nil {
			return err
		}
		if err := transport.Queue(msg.Context(), tx, "recording the thing", `INSERT INTO `+e.eff+` (msg, part) VALUES ($1, 'ok')`, msg.UUID); err != nil {
			return err
		}
		return transport.Queue(msg.Context(), tx, "the broken statement", `INSERT INTO `+e.eff+` (msg, part) VALUES ($1, NULL)`, msg.UUID)
	}))
	startRouter(t, r)
	e.publish(1)
	e.drained(e.in, "g", 10*time.Second)
	dead := e.deadLetters(e.in)
	require.Len(t, dead, 1)
	assert.Contains(t, dead[0].Reason, "the broken statement: ")
	assert.Contains(t, dead[0].Reason, "23502", "the server's error, with its code")
	assert.Zero(t, e.count(`SELECT count(*) FROM `+e.eff))
}

// recordingTx is a transaction that notes the statements it runs.
type recordingTx struct {
	*sql.Tx
	ran []string
}

func (r *recordingTx) ExecContext(ctx context.Context, query string, args ...any) (sql.Result, error) {
	r.ran = append(r.ran, query)
	return r.Tx.ExecContext(ctx, query, args...)
}

// Savepoints nest under one name: a failing inner one takes back its
// own work only, and every call sends the same statements. (A name of
// its own for each call was a statement the server had never seen: pgx
// prepared and cached each, and pg_stat_statements kept an entry each.)
func TestSavepointsNestUnderOneName(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	ctx := context.Background()
	sqlTx, err := e.db.SQL.Begin()
	require.NoError(t, err)
	tx := &recordingTx{Tx: sqlTx}
	insert := func(tx transport.Tx, part string) error {
		_, err := tx.ExecContext(ctx, `INSERT INTO `+e.eff+` (msg, part) VALUES ('nested', $1)`, part)
		return err
	}
	require.NoError(t, transport.Savepoint(ctx, tx, func(tx transport.Tx) error {
		if err := insert(tx, "outer-before"); err != nil {
			return err
		}
		require.Error(t, transport.Savepoint(ctx, tx, func(tx transport.Tx) error {
			require.NoError(t, insert(tx, "inner"))
			return errors.New("undo the inner one")
		}))
		return insert(tx, "outer-after")
	}))
	require.NoError(t, transport.Savepoint(ctx, tx, func(tx transport.Tx) error { return insert(tx, "second") }))
	require.NoError(t, sqlTx.Commit())

	var parts []string
	rows, err := e.db.SQL.Query(`SELECT part FROM ` + e.eff + ` WHERE msg = 'nested' ORDER BY part`)
	require.NoError(t, err)
	for rows.Next() {
		var p string
		require.NoError(t, rows.Scan(&p))
		parts = append(parts, p)
	}
	require.NoError(t, rows.Err())
	assert.Equal(t, []string{"outer-after", "outer-before", "second"}, parts, "the inner savepoint took back its own row only")

	opened := map[string]bool{}
	for _, q := range tx.ran {
		if strings.HasPrefix(q, "SAVEPOINT ") {
			opened[q] = true
		}
	}
	assert.Len(t, opened, 1, "every savepoint is opened by the same statement: %v", tx.ran)
}
