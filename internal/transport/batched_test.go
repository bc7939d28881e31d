package transport_test

import (
	"context"
	"encoding/json"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/internal/dbtx"
	"github.com/pgsaga/pgsaga/internal/pgdb"
	"github.com/pgsaga/pgsaga/internal/testdb"
	"github.com/pgsaga/pgsaga/internal/transport"
)

// recorder is a batched write into an env's effects table that counts its
// statements and the rows of each: a row is the message and the part.
type recorder struct {
	w     *dbtx.Batched
	mu    sync.Mutex
	sizes []int // rows of each statement built
}

func newRecorder(e *env) *recorder {
	r := &recorder{}
	r.w = &dbtx.Batched{Name: "recording parts", Statement: func(rows [][]any) (string, []any) {
		r.mu.Lock()
		r.sizes = append(r.sizes, len(rows))
		r.mu.Unlock()
		// The part's attempt number must be an integer: "x" fails the
		// statement.
		return `INSERT INTO ` + e.eff + ` (msg, part, attempt) SELECT u.msg, 'batched', u.attempt::int
FROM unnest($1::text[], $2::text[]) AS u(msg, attempt)`, []any{dbtx.Column[string](rows, 0), dbtx.Column[string](rows, 1)}
	}}
	return r
}

// oneBatch configures an env whose one consumer claims everything
// published before it starts in one batch, with maxAttempts (0: the
// default).
func oneBatch(maxAttempts int) func(*transport.Config) {
	return func(c *transport.Config) {
		c.BatchSize, c.BatchTimeout = 50, time.Minute
		if maxAttempts > 0 {
			c.Retry.MaxAttempts = maxAttempts
		}
	}
}

func (r *recorder) statements() []int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]int(nil), r.sizes...)
}

// The rows a batch's attempts queue are written in one statement per kind
// when the batch ends, its published messages in the order they were
// published, and its messages leave their queue with them.
func TestBatchedRowsAreWrittenOneStatementAKindABatch(t *testing.T) {
	t.Parallel()
	e := newEnv(t, oneBatch(0))
	rec := newRecorder(e)
	ids := e.publish(30) // before the router: one claim takes them all
	r, err := e.tr.NewRouter()
	require.NoError(t, err)
	require.NoError(t, r.AddHandler("h", e.in, "g", func(msg *message.Message) error {
		tx, _ := transport.TxFromContext(msg.Context())
		if err := effect(msg, e.eff, "row"); err != nil {
			return err
		}
		if err := dbtx.WriteBatched(msg.Context(), tx, rec.w, []any{msg.UUID, "1"}); err != nil {
			return err
		}
		return e.tr.Publisher(tx).Publish(e.out, message.NewMessage(replyID(msg), msg.Payload))
	}))
	startRouter(t, r)
	e.drained(e.in, "g", 10*time.Second)
	assertExactlyOnce(t, e, 30)
	assert.Equal(t, []int{30}, rec.statements(), "one statement for the batch's 30 rows")
	// Replies queued for the archive in the order their messages were
	// handled, which is the order they were published in.
	rows, err := e.db.SQL.Query(`SELECT convert_from(payload, 'UTF8') FROM pgsaga_queue WHERE topic = $1 AND consumer_group = 'archive' ORDER BY id`, e.out)
	require.NoError(t, err)
	defer rows.Close()
	var got []int
	for rows.Next() {
		var p string
		require.NoError(t, rows.Scan(&p))
		var v map[string]int
		require.NoError(t, json.Unmarshal([]byte(p), &v))
		got = append(got, v["i"])
	}
	require.NoError(t, rows.Err())
	want := make([]int, len(ids))
	for i := range want {
		want[i] = i
	}
	assert.Equal(t, want, got)
}

// A batched write that fails when its batch ends cannot be pinned on a
// message: the batch is rolled back whole, its messages are delivered
// again one a batch, and only the one whose row fails ends dead-lettered,
// with the write's error; nothing of it is kept, everything of the others
// is kept once.
func TestAFailedBatchedWriteIsolatesItsMessages(t *testing.T) {
	t.Parallel()
	e := newEnv(t, oneBatch(2))
	rec := newRecorder(e)
	ids := e.publish(10)
	bad := ids[3]
	r, err := e.tr.NewRouter()
	require.NoError(t, err)
	require.NoError(t, r.AddHandler("h", e.in, "g", func(msg *message.Message) error {
		tx, _ := transport.TxFromContext(msg.Context())
		if err := effect(msg, e.eff, "row"); err != nil {
			return err
		}
		attempt := strconv.Itoa(transport.AttemptFromContext(msg.Context()))
		if msg.UUID == bad {
			attempt = "x"
		}
		return dbtx.WriteBatched(msg.Context(), tx, rec.w, []any{msg.UUID, attempt})
	}))
	startRouter(t, r)
	e.drained(e.in, "g", 20*time.Second)
	dead := e.deadLetters(e.in)
	require.Len(t, dead, 1)
	assert.Equal(t, bad, dead[0].UUID)
	assert.Contains(t, dead[0].Reason, "recording parts")
	assert.Contains(t, dead[0].Reason, "22P02", "the server's error, with its code")
	assert.Zero(t, e.count(`SELECT count(*) FROM `+e.eff+` WHERE msg = $1`, bad), "nothing of the bad message is kept")
	assertExactlyOnce(t, e, 9)
	sizes := rec.statements()
	require.NotEmpty(t, sizes)
	assert.Equal(t, 10, sizes[0], "the first batch held them all")
}

// What an attempt queued goes with it: a failed attempt's rows, and the
// rows of a Savepoint that failed, are never written; the rows before a
// handler's own savepoint stay when it rolls back to it, those after it go.
func TestRolledBackWorkTakesItsBatchedRows(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	rec := newRecorder(e)
	var mu sync.Mutex
	tries := map[string]int{}
	r, err := e.tr.NewRouter()
	require.NoError(t, err)
	require.NoError(t, r.AddHandler("h", e.in, "g", func(msg *message.Message) error {
		ctx := msg.Context()
		tx, _ := transport.TxFromContext(ctx)
		mu.Lock()
		tries[msg.UUID]++
		n := tries[msg.UUID]
		mu.Unlock()
		queue := func(tx transport.Tx, part string) error {
			return dbtx.WriteBatched(ctx, tx, rec.w, []any{msg.UUID + "/" + part, strconv.Itoa(n)})
		}
		if err := queue(tx, "attempt"); err != nil {
			return err
		}
		if n == 1 {
			return assert.AnError // the first attempt fails: its row goes
		}
		_ = transport.Savepoint(ctx, tx, func(tx transport.Tx) error {
			if err := queue(tx, "in-failed-savepoint"); err != nil {
				return err
			}
			return assert.AnError
		})
		if err := transport.Savepoint(ctx, tx, func(tx transport.Tx) error { return queue(tx, "in-kept-savepoint") }); err != nil {
			return err
		}
		if _, err := tx.ExecContext(ctx, `SAVEPOINT mine`); err != nil {
			return err
		}
		if err := queue(tx, "after-own-savepoint"); err != nil {
			return err
		}
		if _, err := tx.ExecContext(ctx, `ROLLBACK TO SAVEPOINT mine`); err != nil {
			return err
		}
		if err := queue(tx, "before-failed-savepoint"); err != nil {
			return err
		}
		// Inside a Savepoint that fails, the handler's own savepoint
		// statement writes the rows queued so far; the rollback takes them
		// back, and they are written again later.
		_ = transport.Savepoint(ctx, tx, func(tx transport.Tx) error {
			if _, err := tx.ExecContext(ctx, `SAVEPOINT inner; RELEASE SAVEPOINT inner`); err != nil {
				return err
			}
			return assert.AnError
		})
		return queue(tx, "last")
	}))
	startRouter(t, r)
	ids := e.publish(3)
	e.drained(e.in, "g", 10*time.Second)
	for _, id := range ids {
		parts := map[string]int{}
		rows, err := e.db.SQL.Query(`SELECT msg, attempt FROM `+e.eff+` WHERE msg LIKE $1 || '/%'`, id)
		require.NoError(t, err)
		for rows.Next() {
			var m string
			var a int
			require.NoError(t, rows.Scan(&m, &a))
			parts[m[len(id)+1:]] = a
		}
		require.NoError(t, rows.Err())
		rows.Close()
		assert.Equal(t, map[string]int{"attempt": 2, "in-kept-savepoint": 2, "before-failed-savepoint": 2, "last": 2}, parts, id)
	}
	assert.Empty(t, e.deadLetters(e.in))
}

// An in-process delivery's rows go with it: written with its publisher's
// batch when it is kept, dropped with its savepoint when it fails (its
// message is then queued, and its rows are written by the attempt that
// handles it there).
func TestInProcessDeliveriesTakeTheirBatchedRows(t *testing.T) {
	t.Parallel()
	e := newLocalEnv(t, nil)
	rec := newRecorder(e)
	var calls atomic.Int32
	e.routeLocal(t, func(msg *message.Message) error {
		tx, _ := transport.TxFromContext(msg.Context())
		return e.tr.Publisher(tx).Publish(e.out, message.NewMessage(replyID(msg), msg.Payload))
	}, func(msg *message.Message) error {
		tx, _ := transport.TxFromContext(msg.Context())
		n := calls.Add(1)
		if err := dbtx.WriteBatched(msg.Context(), tx, rec.w, []any{msg.UUID, strconv.Itoa(int(n))}); err != nil {
			return err
		}
		var v map[string]int
		_ = json.Unmarshal(msg.Payload, &v)
		if v["i"] == 1 && transport.InProcessFromContext(msg.Context()) {
			return assert.AnError // fails in process: queued
		}
		return nil
	})
	e.publish(3)
	e.drained(e.in, "g", 10*time.Second)
	e.drained(e.out, "local", 10*time.Second)
	assert.Equal(t, 3, e.count(`SELECT count(*) FROM `+e.eff+` WHERE part = 'batched'`), "one row a delivery kept")
	assert.Equal(t, 3, e.count(`SELECT count(DISTINCT msg) FROM `+e.eff+` WHERE part = 'batched'`))
	assert.Equal(t, 1, e.count(`SELECT count(*) FROM queued_log WHERE grp = 'local'`), "the failed one was queued")
}

// A publish PostgreSQL could not store fails at once, permanently, in the
// handler, not when its batch ends.
func TestAnUnstorablePublishFailsAtOnce(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	tx, err := e.db.SQL.Begin()
	require.NoError(t, err)
	defer func() { _ = tx.Rollback() }()
	for name, m := range map[string]*message.Message{
		"NUL in metadata":     message.NewMessage("ok", nil),
		"NUL in a UUID":       message.NewMessage("a\x00b", nil),
		"a UUID not in UTF-8": message.NewMessage("\xff\xfe", nil),
	} {
		if name == "NUL in metadata" {
			m.Metadata.Set("note", "a\x00b")
		}
		err := e.tr.Publisher(tx).Publish(e.out, m)
		assert.ErrorIs(t, err, transport.ErrUnstorable, name)
		assert.True(t, transport.IsPermanent(err), name)
	}
}

// Rows an earlier attempt queued that fail when written for a later one
// (which read a row they change: dbtx.ErrBatchedPending) are not the later
// message's fault: it is charged no attempt, and the batch is delivered
// again one message a batch, where the message at fault is found.
func TestAFailedEarlyWriteIsNotPinnedOnTheMessageThatAskedForIt(t *testing.T) {
	t.Parallel()
	e := newEnv(t, oneBatch(3))
	rec := newRecorder(e)
	ids := e.publish(2) // bad, then asking
	bad, asking := ids[0], ids[1]
	var asked atomic.Bool
	r, err := e.tr.NewRouter()
	require.NoError(t, err)
	require.NoError(t, r.AddHandler("h", e.in, "g", func(msg *message.Message) error {
		tx, _ := transport.TxFromContext(msg.Context())
		attempt := strconv.Itoa(transport.AttemptFromContext(msg.Context()))
		switch msg.UUID {
		case bad:
			attempt = "x" // kept, but its row fails when written
		case asking:
			if !asked.Swap(true) {
				return fmt.Errorf("a row it reads is queued: %w", dbtx.ErrBatchedPending)
			}
		}
		return dbtx.WriteBatched(msg.Context(), tx, rec.w, []any{msg.UUID, attempt})
	}))
	startRouter(t, r)
	e.drained(e.in, "g", 20*time.Second)
	dead := e.deadLetters(e.in)
	require.Len(t, dead, 1)
	assert.Equal(t, bad, dead[0].UUID)
	assert.Equal(t, 1, e.count(`SELECT count(*) FROM `+e.eff+` WHERE msg = $1 AND attempt = 1`, asking), "done in its first attempt: none was charged")
}

// rollbackCounter counts the rollbacks to an attempt's savepoint.
type rollbackCounter struct{ n atomic.Int64 }

func (c *rollbackCounter) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	if strings.HasPrefix(d.SQL, "ROLLBACK TO SAVEPOINT pgsaga_attempt") {
		c.n.Add(1)
	}
	return ctx
}

func (*rollbackCounter) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

// An attempt that fails having sent nothing (a handler that awaits a call
// before touching the database, as the charge step does now that its key
// is the batch's) is not rolled back: its savepoint serves the run after
// the call. One that sent something is rolled back, and what it wrote is
// gone.
func TestAnUntouchedAttemptIsNotRolledBack(t *testing.T) {
	t.Parallel()
	for _, touch := range []bool{false, true} {
		t.Run(fmt.Sprint("touched=", touch), func(t *testing.T) {
			t.Parallel()
			var rb rollbackCounter
			db := testdb.Shared(t)
			pool, err := pgdb.Open(context.Background(), pgdb.Config{URL: db.URL, MaxConns: 4, Tracer: &rb})
			require.NoError(t, err)
			t.Cleanup(pool.Close) // after the router's stop, registered later
			e := newEnvOn(t, db, func(c *transport.Config) { c.DB = pool.SQL; c.BatchSize = 50; c.BatchTimeout = time.Minute })
			r, err := e.tr.NewRouter()
			require.NoError(t, err)
			require.NoError(t, r.AddHandler("h", e.in, "g", func(msg *message.Message) error {
				if !transport.AwaitedFromContext(msg.Context()) {
					if touch {
						if err := effect(msg, e.eff, "first run"); err != nil {
							return err
						}
					}
					return transport.Await(5*time.Second, func(context.Context) error { return nil })
				}
				return effect(msg, e.eff, "after the call")
			}))
			e.publish(5)
			startRouter(t, r)
			e.drained(e.in, "g", 20*time.Second)
			assert.Equal(t, 5, e.count(`SELECT count(*) FROM `+e.eff+` WHERE part = 'after the call'`))
			assert.Zero(t, e.count(`SELECT count(*) FROM `+e.eff+` WHERE part = 'first run'`), "a rolled-back first run leaves nothing")
			if touch {
				assert.Positive(t, rb.n.Load(), "a touched attempt is rolled back")
			} else {
				assert.Zero(t, rb.n.Load(), "nothing to roll back")
			}
		})
	}
}

// An untouched attempt whose transaction is gone meanwhile (its session
// terminated; the client learns it only from its next statement) keeps no
// savepoint that is not there: the run after the call finds the batch
// gone, and the message is delivered again and handled once. Its awaited
// call may be made again, as after a crash: awaited calls are at least
// once (the charge's is idempotent by its gateway key).
func TestAnUntouchedAttemptOfALostBatchIsDeliveredAgain(t *testing.T) {
	t.Parallel()
	db := testdb.Fresh(t)
	e := newEnvOn(t, db, nil)
	var calls atomic.Int32
	var killed atomic.Bool
	r, err := e.tr.NewRouter()
	require.NoError(t, err)
	require.NoError(t, r.AddHandler("h", e.in, "g", func(msg *message.Message) error {
		ctx := msg.Context()
		if !transport.AwaitedFromContext(ctx) {
			if !killed.Swap(true) {
				// The batch's session ends while the handler has sent nothing.
				_, err := db.SQL.ExecContext(ctx, `SELECT pg_terminate_backend(pid) FROM pg_stat_activity
					WHERE datname = current_database() AND pid <> pg_backend_pid() AND state LIKE 'idle in transaction%'`)
				if err != nil {
					return err
				}
			}
			return transport.Await(5*time.Second, func(context.Context) error { calls.Add(1); return nil })
		}
		return effect(msg, e.eff, "after the call")
	}))
	e.publish(1)
	startRouter(t, r)
	e.drained(e.in, "g", 20*time.Second)
	assert.Equal(t, 1, e.count(`SELECT count(*) FROM `+e.eff+` WHERE part = 'after the call'`), "handled once")
	assert.Empty(t, e.deadLetters(e.in))
	assert.True(t, killed.Load())
	assert.LessOrEqual(t, calls.Load(), int32(2), "the dead batch's call, and the redelivery's")
}
