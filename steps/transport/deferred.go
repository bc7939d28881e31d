package transport

import (
	"context"
	"fmt"
	"strconv"
	"strings"

	"github.com/jackc/pgx/v5"
)

// Deferred statements.
//
// Most of what a step writes needs no answer from the database: the
// messages it publishes, the completion of its idempotency key, the lines
// of a saga's timeline. Inside a Router attempt such statements are queued
// (DeferExec) and sent at the end of the attempt in the same round trip as
// the attempt's own bookkeeping: one simple-protocol query that runs the
// queued statements, releases the attempt's savepoint, stores the
// message's offset and opens the next attempt's savepoint. They run in the
// attempt, before it is kept: if one fails, the attempt fails and is rolled
// back like any other, so what they write still commits with the step or
// not at all.
//
// Arguments are interpolated client-side by pgx (quoted and escaped, as
// QueryExecModeSimpleProtocol does); pass JSON as a string, not []byte
// ([]byte is sent as bytea).

// Deferrer is implemented by the Tx of a Router attempt. Code that writes
// through a Tx may check for it and defer statements whose result it does
// not need; other Tx implementations run them at once.
type Deferrer interface {
	// DeferExec queues query to run at the end of the attempt, before it is
	// kept. Placeholders are $1…$n of args.
	DeferExec(ctx context.Context, query string, args ...any) error
}

// ExecOrDefer defers query if tx is a Deferrer, and runs it at once
// otherwise.
func ExecOrDefer(ctx context.Context, tx Tx, query string, args ...any) error {
	if d, ok := tx.(Deferrer); ok {
		return d.DeferExec(ctx, query, args...)
	}
	_, err := tx.ExecContext(ctx, query, args...)
	return err
}

type deferredStmt struct {
	query string
	args  []any
}

// DeferExec queues query; see Deferrer.
func (a *attemptTx) DeferExec(_ context.Context, query string, args ...any) error {
	a.mu.RLock()
	defer a.mu.RUnlock()
	if a.over {
		return ErrAttemptOver
	}
	a.defMu.Lock()
	defer a.defMu.Unlock()
	a.deferred = append(a.deferred, deferredStmt{query: query, args: args})
	return nil
}

// deferNotify queues the wake-up of topic's subscribers, once per attempt.
func (a *attemptTx) deferNotify(channel, topic string) error {
	a.defMu.Lock()
	if a.notified[topic] {
		a.defMu.Unlock()
		return nil
	}
	if a.notified == nil {
		a.notified = map[string]bool{}
	}
	a.notified[topic] = true
	a.defMu.Unlock()
	return a.DeferExec(context.Background(), notifySQL, channel, topic)
}

// takeDeferred empties the queue and returns what it held.
func (a *attemptTx) takeDeferred() []deferredStmt {
	a.defMu.Lock()
	defer a.defMu.Unlock()
	out := a.deferred
	a.deferred, a.notified = nil, nil
	return out
}

// flushDeferred runs the queued statements now, in one round trip. The
// caller holds a.mu (shared).
func (a *attemptTx) flushDeferred(ctx context.Context) error {
	stmts := a.takeDeferred()
	if len(stmts) == 0 {
		return nil
	}
	q, args := composeStatements(stmts, "")
	_, err := a.raw.ExecContext(context.WithoutCancel(ctx), q, args...)
	return err
}

// composeStatements joins stmts, then tail (no placeholders), into one
// simple-protocol query; it returns the query and its arguments, the first
// being pgx.QueryExecModeSimpleProtocol.
func composeStatements(stmts []deferredStmt, tail string) (string, []any) {
	var b strings.Builder
	args := []any{pgx.QueryExecModeSimpleProtocol}
	for _, s := range stmts {
		appendRenumbered(&b, s.query, len(args)-1)
		b.WriteString(";\n")
		args = append(args, s.args...)
	}
	b.WriteString(tail)
	return b.String(), args
}

// appendRenumbered writes query to b with every placeholder $n turned into
// $(n+offset). Quoted identifiers, string literals and comments are copied
// as they are.
func appendRenumbered(b *strings.Builder, query string, offset int) {
	if offset == 0 {
		b.WriteString(query)
		return
	}
	for i := 0; i < len(query); {
		c := query[i]
		switch {
		case c == '\'' || c == '"':
			j := i + 1
			for j < len(query) {
				if query[j] == c {
					if j+1 < len(query) && query[j+1] == c { // doubled quote
						j += 2
						continue
					}
					break
				}
				j++
			}
			end := min(j+1, len(query))
			b.WriteString(query[i:end])
			i = end
		case c == '-' && i+1 < len(query) && query[i+1] == '-':
			j := strings.IndexByte(query[i:], '\n')
			if j < 0 {
				j = len(query) - i
			}
			b.WriteString(query[i : i+j])
			i += j
		case c == '$' && i+1 < len(query) && query[i+1] >= '0' && query[i+1] <= '9':
			j := i + 1
			for j < len(query) && query[j] >= '0' && query[j] <= '9' {
				j++
			}
			n, _ := strconv.Atoi(query[i+1 : j])
			b.WriteByte('$')
			b.WriteString(strconv.Itoa(n + offset))
			i = j
		default:
			b.WriteByte(c)
			i++
		}
	}
}

// isSavepointCommand reports whether query is a SAVEPOINT, ROLLBACK TO or
// RELEASE statement: queued statements are flushed before it, so that a
// handler's own savepoints take back exactly what they would without
// deferral.
func isSavepointCommand(query string) bool {
	q := strings.TrimSpace(query)
	for _, kw := range []string{"SAVEPOINT", "ROLLBACK", "RELEASE"} {
		if len(q) >= len(kw) && strings.EqualFold(q[:len(kw)], kw) {
			return true
		}
	}
	return false
}

// insertMessagesSQL is watermill-sql's insert of msgs into a topic table,
// written for deferral: placeholders $1…$3n, JSON metadata as a string.
func insertMessagesSQL(table string, n int) string {
	var b strings.Builder
	b.WriteString("INSERT INTO ")
	b.WriteString(table)
	b.WriteString(" (uuid, payload, metadata, transaction_id) VALUES ")
	for i := range n {
		if i > 0 {
			b.WriteByte(',')
		}
		fmt.Fprintf(&b, "($%d,$%d,$%d,pg_current_xact_id())", 3*i+1, 3*i+2, 3*i+3)
	}
	return b.String()
}
