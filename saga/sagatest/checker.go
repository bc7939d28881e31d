package sagatest

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/google/uuid"

	"github.com/pgsaga/pgsaga/internal/sqlcheck"
	"github.com/pgsaga/pgsaga/saga"
)

// Invariant is a property that must hold once the sagas have settled.
// Check returns the rows that break it (none when it holds).
type Invariant struct {
	Name  string
	Check func(ctx context.Context, db *sql.DB) ([]string, error)
}

// Violation is a broken invariant and the rows that break it.
type Violation struct {
	Invariant string
	Rows      []string
}

// String implements fmt.Stringer: the invariant, then its rows.
func (v Violation) String() string { return sqlcheck.Violation(v).String() }

// Checker checks the generic invariants of sagas, and the domain's.
type Checker struct {
	// DB is required.
	DB *sql.DB
	// Definitions whose sagas and commands are checked. Required.
	Definitions []*saga.Definition
	// Domain invariants, checked after the generic ones.
	Domain []Invariant
	// Participants are the databases of services that run steps of these
	// sagas on their own (steps/broker). A command counts as handled,
	// dead-lettered or queued in any of them, and the invariants of steps
	// (no idempotency key left pending, no effect applied twice) are
	// checked in each. Default: none, every step runs on DB.
	Participants []*sql.DB
}

// Invariants lists the generic invariants:
//
//   - every saga is terminal, and none is parked as failed;
//   - no idempotency key is left pending;
//   - every command's effect happened at most once: no domain event was
//     appended twice to a stream under the same idempotency key;
//   - no command was lost: every command a saga sent (its timeline names
//     each by its idempotency key) was handled by a participant, which
//     stored its outcome under that key, or is dead-lettered, saying why,
//     or is still queued.
func (c Checker) Invariants() []Invariant {
	types := make([]string, len(c.Definitions))
	for i, d := range c.Definitions {
		types[i] = d.Name
	}
	q := func(query string, args ...any) func(ctx context.Context, db *sql.DB) ([]string, error) {
		return func(ctx context.Context, db *sql.DB) ([]string, error) { return Rows(ctx, db, query, args...) }
	}
	// In every database where steps run.
	each := func(query string) func(ctx context.Context, db *sql.DB) ([]string, error) {
		return func(ctx context.Context, db *sql.DB) ([]string, error) {
			var out []string
			for i, d := range append([]*sql.DB{db}, c.Participants...) {
				rows, err := Rows(ctx, d, query)
				if err != nil {
					return nil, err
				}
				if i > 0 {
					for j := range rows {
						rows[j] = fmt.Sprintf("participant %d: %s", i, rows[j])
					}
				}
				out = append(out, rows...)
			}
			return out, nil
		}
	}
	invs := []Invariant{
		{"sagas not terminal", q(`SELECT id::text || ' ' || saga_type || ' ' || status FROM saga_instances
WHERE saga_type = ANY ($1::text[]) AND status IN ('running', 'compensating') ORDER BY created_at`, types)},
		{"sagas parked as failed", q(`SELECT id::text || ' ' || coalesce(failure_reason, '') FROM saga_instances
WHERE saga_type = ANY ($1::text[]) AND status = 'failed' ORDER BY created_at`, types)},
		{"idempotency keys left pending", each(`SELECT scope || '/' || key FROM idempotency_keys WHERE status = 'pending' ORDER BY created_at`)},
		{"effects applied more than once (events appended twice under one key)", each(`SELECT stream_id || ' ' || event_type || ' key ' || (metadata->>'idempotency_key') || ' x' || count(*)
FROM domain_events WHERE metadata->>'idempotency_key' IS NOT NULL
GROUP BY stream_id, event_type, metadata->>'idempotency_key' HAVING count(*) > 1`)},
	}
	invs = append(invs, Invariant{
		Name: "commands neither handled, dead-lettered nor queued",
		Check: func(ctx context.Context, db *sql.DB) ([]string, error) {
			sent, err := Rows(ctx, db, `SELECT DISTINCT h.command_key FROM saga_history h JOIN saga_instances s ON s.id = h.saga_id
WHERE s.saga_type = ANY ($1::text[]) AND h.kind IN ('sent', 'resent') AND h.command_key IS NOT NULL ORDER BY 1`, types)
			if err != nil || len(sent) == 0 {
				return nil, err
			}
			found := map[string]bool{}
			for _, d := range append([]*sql.DB{db}, c.Participants...) {
				keys, err := Rows(ctx, d, `SELECT key FROM idempotency_keys WHERE status <> 'pending' AND key = ANY ($1::text[])
UNION SELECT metadata->>'idempotency_key' FROM pgsaga_dead_letters WHERE metadata->>'idempotency_key' = ANY ($1::text[])
UNION SELECT metadata->>'idempotency_key' FROM pgsaga_queue WHERE metadata->>'idempotency_key' = ANY ($1::text[])`, sent)
				if err != nil {
					return nil, err
				}
				for _, k := range keys {
					found[k] = true
				}
			}
			var lost []string
			for _, k := range sent {
				if !found[k] {
					lost = append(lost, k)
				}
			}
			return lost, nil
		},
	})
	return invs
}

// Check runs every invariant and returns the broken ones.
func (c Checker) Check(ctx context.Context) ([]Violation, error) {
	if c.DB == nil || len(c.Definitions) == 0 {
		return nil, errors.New("sagatest: Checker needs DB and Definitions")
	}
	var out []Violation
	for _, inv := range append(c.Invariants(), c.Domain...) {
		rows, err := inv.Check(ctx, c.DB)
		if err != nil {
			return out, fmt.Errorf("sagatest: checking %q: %w", inv.Name, err)
		}
		if len(rows) > 0 {
			if len(rows) > 20 {
				rows = append(rows[:20:20], fmt.Sprintf("… and %d more", len(rows)-20))
			}
			out = append(out, Violation{Invariant: inv.Name, Rows: rows})
		}
	}
	return out, nil
}

// Querier runs queries: a *sql.DB, *sql.Conn or *sql.Tx.
type Querier interface {
	QueryContext(ctx context.Context, query string, args ...any) (*sql.Rows, error)
}

// Rows runs a query returning one text column: a helper for invariants.
func Rows(ctx context.Context, db Querier, query string, args ...any) ([]string, error) {
	return sqlcheck.Rows(ctx, db, query, args...)
}

// WaitTerminal polls until every saga in ids exists and is terminal, or
// timeout passes; it returns the count per status, and an error naming the
// sagas still unfinished. It rides out a database that is briefly down.
func WaitTerminal(ctx context.Context, db *sql.DB, ids []uuid.UUID, timeout time.Duration) (map[saga.Status]int, error) {
	want := make([]string, len(ids))
	for i, id := range ids {
		want[i] = id.String()
	}
	deadline := time.Now().Add(timeout)
	for {
		counts, unfinished, err := sagaStates(ctx, db, want)
		if err == nil && len(unfinished) == 0 {
			return counts, nil
		}
		if time.Now().After(deadline) {
			if err != nil {
				return counts, fmt.Errorf("sagatest: reading the sagas after %s: %w", timeout, err)
			}
			if len(unfinished) > 10 {
				unfinished = append(unfinished[:10:10], fmt.Sprintf("… and %d more", len(unfinished)-10))
			}
			return counts, fmt.Errorf("sagatest: %d sagas unfinished after %s: %s", len(unfinished), timeout, strings.Join(unfinished, ", "))
		}
		select {
		case <-ctx.Done():
			return counts, ctx.Err()
		case <-time.After(20 * time.Millisecond):
		}
	}
}

func sagaStates(ctx context.Context, db *sql.DB, want []string) (map[saga.Status]int, []string, error) {
	rows, err := db.QueryContext(ctx, `SELECT w.id, coalesce(s.status, 'not started') FROM unnest($1::text[]) w(id)
		LEFT JOIN saga_instances s ON s.id::text = w.id`, want)
	if err != nil {
		return nil, nil, err
	}
	defer rows.Close()
	counts := map[saga.Status]int{}
	var unfinished []string
	for rows.Next() {
		var id, status string
		if err := rows.Scan(&id, &status); err != nil {
			return nil, nil, err
		}
		st := saga.Status(status)
		counts[st]++
		if !st.Terminal() {
			unfinished = append(unfinished, id+" "+status)
		}
	}
	return counts, unfinished, rows.Err()
}
