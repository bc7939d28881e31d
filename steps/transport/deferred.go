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
// A handler's own savepoints keep their meaning: queued statements are sent
// before its SAVEPOINT or RELEASE, and taken back by its ROLLBACK TO. If
// they cannot be sent, the attempt fails even if the handler carries on.
//
// Arguments are interpolated client-side by pgx (quoted and escaped, as
// QueryExecModeSimpleProtocol does) when the attempt ends, so they must not
// change after DeferExec; pass JSON and text as strings, not []byte
// ([]byte is sent as bytea, which a text column stores as \x… hex).

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
	if _, err := a.raw.ExecContext(context.WithoutCancel(ctx), q, args...); err != nil {
		// The statements are gone from the queue whether or not the server
		// saw them: the attempt must not be kept, even if the handler goes
		// on as if nothing happened.
		a.defMu.Lock()
		if a.flushErr == nil {
			a.flushErr = err
		}
		a.defMu.Unlock()
		return fmt.Errorf("transport: sending deferred statements: %w", err)
	}
	return nil
}

// failedFlush returns the error of a failed send of queued statements.
func (a *attemptTx) failedFlush() error {
	a.defMu.Lock()
	defer a.defMu.Unlock()
	return a.flushErr
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
// $(n+offset). It reads SQL the way pgx's client-side interpolation does
// (which later binds the composed query's arguments): string literals ('…',
// E'…' with backslash escapes, $tag$…$tag$), quoted identifiers and comments
// (--…, nested /* … */) are copied as they are.
func appendRenumbered(b *strings.Builder, query string, offset int) {
	if offset == 0 {
		b.WriteString(query)
		return
	}
	i := 0
	for i < len(query) {
		c := query[i]
		var next byte
		if i+1 < len(query) {
			next = query[i+1]
		}
		var end int // end of a span copied as it is
		switch {
		case (c == 'e' || c == 'E') && next == '\'':
			end = quotedEnd(query, i+2, '\'', true)
		case c == '\'' || c == '"':
			end = quotedEnd(query, i+1, c, false)
		case c == '-' && next == '-':
			end = len(query)
			if j := strings.IndexAny(query[i:], "\n\r"); j >= 0 {
				end = i + j + 1
			}
		case c == '/' && next == '*':
			end = commentEnd(query, i+2)
		case c == '$' && next >= '0' && next <= '9':
			j := i + 1
			for j < len(query) && query[j] >= '0' && query[j] <= '9' {
				j++
			}
			n, _ := strconv.Atoi(query[i+1 : j])
			b.WriteByte('$')
			b.WriteString(strconv.Itoa(n + offset))
			i = j
			continue
		case c == '$':
			tag, ok := dollarTag(query[i+1:])
			if !ok {
				end = i + 1
				break
			}
			closer := "$" + tag + "$"
			body := i + len(closer)
			end = len(query)
			if j := strings.Index(query[body:], closer); j >= 0 {
				end = body + j + len(closer)
			}
		default:
			end = i + 1
		}
		b.WriteString(query[i:end])
		i = end
	}
}

// quotedEnd returns the index just past the quote that closes a literal or
// identifier whose body starts at i; a doubled quote is part of the body,
// and so is a backslash-escaped character in an E” string.
func quotedEnd(query string, i int, quote byte, backslash bool) int {
	for i < len(query) {
		switch c := query[i]; {
		case backslash && c == '\\':
			i += 2
		case c == quote:
			if i+1 < len(query) && query[i+1] == quote {
				i += 2
				continue
			}
			return i + 1
		default:
			i++
		}
	}
	return len(query)
}

// commentEnd returns the index just past the */ that closes a comment whose
// body starts at i; comments nest.
func commentEnd(query string, i int) int {
	depth := 0
	for i+1 < len(query) {
		switch query[i : i+2] {
		case "/*":
			depth++
			i += 2
		case "*/":
			if depth == 0 {
				return i + 2
			}
			depth--
			i += 2
		default:
			i++
		}
	}
	return len(query)
}

// dollarTag reports whether s (just past a '$') opens a dollar-quoted
// string, and its tag: empty, or a letter or underscore (or a non-ASCII
// byte) followed by those and digits, then '$'.
func dollarTag(s string) (string, bool) {
	for i := 0; i < len(s); i++ {
		c := s[i]
		switch {
		case c == '$':
			return s[:i], true
		case c == '_' || c >= 0x80 || (c|0x20 >= 'a' && c|0x20 <= 'z'):
		case i > 0 && c >= '0' && c <= '9':
		default:
			return "", false
		}
	}
	return "", false
}

// A savepoint command a handler runs in its attempt, and what it means for
// the queued statements: they were all queued after the most recent
// savepoint command (every one is handled here), so before a SAVEPOINT or a
// RELEASE they are sent, and a successful ROLLBACK (TO) takes them back
// without sending them. Sending them first would also fail in a transaction
// an error has aborted, which is exactly when handlers roll back.
type savepointCommand int

const (
	notSavepointCommand savepointCommand = iota
	flushBefore                          // SAVEPOINT, RELEASE
	discardAfter                         // ROLLBACK, ROLLBACK TO
)

// classify reads the first keyword of query, after white space and
// comments.
func classify(query string) savepointCommand {
	q := skipSpaceAndComments(query)
	keyword := func(kw string) bool {
		if len(q) < len(kw) || !strings.EqualFold(q[:len(kw)], kw) {
			return false
		}
		if len(q) == len(kw) {
			return true
		}
		c := q[len(kw)]
		return !(c == '_' || c == '$' || c >= 0x80 || (c >= '0' && c <= '9') || (c|0x20 >= 'a' && c|0x20 <= 'z'))
	}
	switch {
	case keyword("SAVEPOINT"), keyword("RELEASE"):
		return flushBefore
	case keyword("ROLLBACK"):
		return discardAfter
	}
	return notSavepointCommand
}

func skipSpaceAndComments(q string) string {
	for {
		q = strings.TrimLeft(q, " \t\r\n\f")
		switch {
		case strings.HasPrefix(q, "--"):
			j := strings.IndexAny(q, "\n\r")
			if j < 0 {
				return ""
			}
			q = q[j+1:]
		case strings.HasPrefix(q, "/*"):
			q = q[commentEnd(q, 2):]
		default:
			return q
		}
	}
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
