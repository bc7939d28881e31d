package main

import (
	"cmp"
	"context"
	"database/sql"
	"fmt"
	"io"
	"maps"
	"os"
	"regexp"
	"slices"
	"strings"
	"sync"
	"sync/atomic"

	"github.com/jackc/pgx/v5"
)

// Owners of statements: who sends a statement, told from its text (see
// ownerOf). Their names are the keys of statements_by_owner, a contract.
const (
	ownerDelivery     = "delivery"     // pgsaga's queue, publishes, wake-ups, idempotency keys
	ownerEngine       = "engine"       // the saga engine: instances, history, requests, definitions
	ownerDomain       = "domain"       // the sample's orders and payments, their event streams
	ownerGateway      = "gateway"      // the fake payment gateway's own bookkeeping
	ownerTransactions = "transactions" // BEGIN, COMMIT, ROLLBACK, savepoints, whoever opened them
)

// owners are every owner, in the order the report lists them.
var owners = []string{ownerDelivery, ownerEngine, ownerDomain, ownerGateway, ownerTransactions}

var (
	leadingComment = regexp.MustCompile(`^(\s*--[^\n]*\n)*\s*`)
	transactionCmd = regexp.MustCompile(`^(begin|commit|rollback|savepoint|release|set constraints|start transaction|end)\b`)
	engineTables   = regexp.MustCompile(`\b(saga_instances|saga_history|saga_requests|saga_definitions)\b`)
	deliveryTables = regexp.MustCompile(`\b(pgsaga_[a-z_]+|idempotency_keys|pg_notify)\b`)
)

// ownerOf says who sent query, from its text: a transaction command first
// (whoever opened the transaction), then the tables it names, the gateway's
// before the engine's before pgsaga's delivery; anything else is the
// sample's domain.
func ownerOf(query string) string {
	q := strings.ToLower(leadingComment.ReplaceAllString(query, ""))
	switch {
	case transactionCmd.MatchString(q):
		return ownerTransactions
	case strings.Contains(q, "fake_gateway"):
		return ownerGateway
	case engineTables.MatchString(q):
		return ownerEngine
	case deliveryTables.MatchString(q):
		return ownerDelivery
	}
	return ownerDomain
}

// statementCounter counts the statements the benchmark's pools send: every
// query and exec, and every statement of a pipelined batch, BEGIN and
// COMMIT included (database/sql sends them as statements through pgx),
// by text; and the commits: every COMMIT, and every statement or pipeline
// sent outside a transaction (it commits on its own).
type statementCounter struct {
	n       atomic.Int64
	commits atomic.Int64
	// trips counts round trips: each statement sent on its own, and each
	// pipeline (a pgx batch, a dbtx.Pipe's group) once; the fake
	// gateway's pool apart.
	trips atomic.Int64
	// gatewayCommits are the commits of the fake gateway's own pool (see
	// gateway), not counted in commits.
	gatewayCommits atomic.Int64

	mu     sync.Mutex
	byText map[string]int64
}

var (
	_ pgx.QueryTracer = (*statementCounter)(nil)
	_ pgx.BatchTracer = (*statementCounter)(nil)
)

func (c *statementCounter) count(query string) {
	c.n.Add(1)
	c.mu.Lock()
	if c.byText == nil {
		c.byText = map[string]int64{}
	}
	c.byText[query]++
	c.mu.Unlock()
}

// outside reports whether conn is outside a transaction, so that what it
// sends now commits on its own.
func outside(conn *pgx.Conn) bool { return conn != nil && conn.PgConn().TxStatus() == 'I' }

func (c *statementCounter) TraceQueryStart(ctx context.Context, conn *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	c.count(d.SQL)
	c.trips.Add(1)
	if commits(conn, d.SQL) {
		c.commits.Add(1)
	}
	return ctx
}

// commits reports whether sql, sent on conn, commits: a COMMIT, or a
// statement sent outside a transaction other than BEGIN and ROLLBACK.
func commits(conn *pgx.Conn, sql string) bool {
	q := strings.TrimSpace(sql)
	switch {
	case hasPrefixFold(q, "commit"):
		return true
	case hasPrefixFold(q, "begin") || hasPrefixFold(q, "rollback"):
		return false
	}
	return outside(conn)
}

func hasPrefixFold(s, prefix string) bool {
	return len(s) >= len(prefix) && strings.EqualFold(s[:len(prefix)], prefix)
}

// gateway returns the tracer of the fake gateway's pool: its statements
// are counted with the others, its commits apart (gatewayCommits).
func (c *statementCounter) gateway() *gatewayTracer { return &gatewayTracer{c} }

type gatewayTracer struct{ c *statementCounter }

var (
	_ pgx.QueryTracer = (*gatewayTracer)(nil)
	_ pgx.BatchTracer = (*gatewayTracer)(nil)
)

func (g *gatewayTracer) TraceQueryStart(ctx context.Context, conn *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	g.c.count(d.SQL)
	if commits(conn, d.SQL) {
		g.c.gatewayCommits.Add(1)
	}
	return ctx
}

func (*gatewayTracer) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

func (g *gatewayTracer) TraceBatchStart(ctx context.Context, conn *pgx.Conn, d pgx.TraceBatchStartData) context.Context {
	if outside(conn) && !beginsATransaction(d.Batch) {
		g.c.gatewayCommits.Add(1)
	}
	return ctx
}

func (g *gatewayTracer) TraceBatchQuery(_ context.Context, _ *pgx.Conn, d pgx.TraceBatchQueryData) {
	g.c.count(d.SQL)
	if hasPrefixFold(strings.TrimSpace(d.SQL), "commit") {
		g.c.gatewayCommits.Add(1)
	}
}

func (*gatewayTracer) TraceBatchEnd(context.Context, *pgx.Conn, pgx.TraceBatchEndData) {}

func (*statementCounter) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

func (c *statementCounter) TraceBatchStart(ctx context.Context, conn *pgx.Conn, d pgx.TraceBatchStartData) context.Context {
	c.trips.Add(1)
	if outside(conn) && !beginsATransaction(d.Batch) {
		c.commits.Add(1) // a pipeline outside a transaction commits once, at its end
	}
	return ctx
}

// beginsATransaction reports whether b's first statement is BEGIN (a
// dbtx.Pipe sends it with the transaction's first statement): its COMMIT
// is counted where it is sent.
func beginsATransaction(b *pgx.Batch) bool {
	return b != nil && len(b.QueuedQueries) > 0 && hasPrefixFold(strings.TrimSpace(b.QueuedQueries[0].SQL), "begin")
}

func (c *statementCounter) TraceBatchQuery(_ context.Context, _ *pgx.Conn, d pgx.TraceBatchQueryData) {
	c.count(d.SQL)
	if hasPrefixFold(strings.TrimSpace(d.SQL), "commit") {
		c.commits.Add(1)
	}
}

func (*statementCounter) TraceBatchEnd(context.Context, *pgx.Conn, pgx.TraceBatchEndData) {}

// byText is a copy of the counts by statement text.
func (c *statementCounter) texts() map[string]int64 {
	c.mu.Lock()
	defer c.mu.Unlock()
	return maps.Clone(c.byText)
}

// statementCount is a reading of both counts: the server's
// (pg_stat_statements, for this database, when the extension can be used)
// and the benchmark's own, each in all and by statement text.
type statementCount struct {
	server       int64
	serverOK     bool
	serverByText map[string]int64
	client       int64
	clientByText map[string]int64
	commits      int64
	gwCommits    int64
	trips        int64
}

// serverStatementsSQL reads the calls pg_stat_statements counted in this
// database, by statement. Statements sent inside a pipeline after the first
// are counted too; utility commands such as SAVEPOINT only if
// pg_stat_statements.track_utility is on.
const serverStatementsSQL = `SELECT query, sum(calls)::bigint FROM pg_stat_statements
WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())
GROUP BY query`

// enableStatementStats makes pg_stat_statements usable in the benchmark's
// database, if the server preloads it and the role may create it; without
// it statements_per_saga falls back to the benchmark's own count.
func enableStatementStats(ctx context.Context, db *sql.DB) bool {
	if _, err := db.ExecContext(ctx, `CREATE EXTENSION IF NOT EXISTS pg_stat_statements`); err != nil {
		return false
	}
	_, err := readServerStatements(ctx, db)
	return err == nil
}

func readServerStatements(ctx context.Context, db *sql.DB) (map[string]int64, error) {
	rows, err := db.QueryContext(ctx, serverStatementsSQL)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	m := map[string]int64{}
	for rows.Next() {
		var q string
		var n int64
		if err := rows.Scan(&q, &n); err != nil {
			return nil, err
		}
		m[q] += n
	}
	return m, rows.Err()
}

// countStatements reads both counts, the server's on a pool the counted
// pools do not use.
func (b *bench) countStatements(ctx context.Context) statementCount {
	c := statementCount{client: b.statements.n.Load(), clientByText: b.statements.texts(),
		commits: b.statements.commits.Load(), gwCommits: b.statements.gatewayCommits.Load(), trips: b.statements.trips.Load()}
	if b.statementStats {
		m, err := readServerStatements(ctx, b.statsDB)
		if c.serverOK = err == nil; c.serverOK {
			c.serverByText = m
			for _, n := range m {
				c.server += n
			}
		}
	}
	return c
}

// statementFigures are the statements of a phase, a saga.
type statementFigures struct {
	perSaga, clientPerSaga, commitsPerSaga, gatewayCommitsPerSaga, tripsPerSaga float64
	source                                                                      string
	byOwner                                                                     map[string]float64
	list                                                                        []statementLine
}

// statementLine is one statement's calls a saga.
type statementLine struct {
	perSaga float64
	owner   string
	query   string
}

// perSaga turns two readings into statements and commits per saga, by
// owner too, and says where the figures come from. elsewhere: workers ran
// in other processes, whose statements this process did not see, so its
// own count is no figure of the saga's.
func perSaga(from, to statementCount, sagas int, elsewhere bool) statementFigures {
	var f statementFigures
	if sagas == 0 {
		return f
	}
	n := float64(sagas)
	f.clientPerSaga = round(float64(to.client-from.client) / n)
	var before, after map[string]int64
	switch {
	case from.serverOK && to.serverOK:
		f.perSaga, f.source = round(float64(to.server-from.server)/n), "pg_stat_statements"
		before, after = from.serverByText, to.serverByText
	case elsewhere:
		f.source = "unavailable"
	default:
		f.perSaga, f.source = f.clientPerSaga, "client"
		before, after = from.clientByText, to.clientByText
	}
	if !elsewhere {
		f.commitsPerSaga = round(float64(to.commits-from.commits) / n)
		f.gatewayCommitsPerSaga = round(float64(to.gwCommits-from.gwCommits) / n)
		f.tripsPerSaga = round(float64(to.trips-from.trips) / n)
	}
	if after == nil {
		return f
	}
	f.byOwner = map[string]float64{}
	for _, o := range owners {
		f.byOwner[o] = 0
	}
	sums := map[string]int64{}
	for q, calls := range after {
		d := calls - before[q]
		if d <= 0 {
			continue
		}
		o := ownerOf(q)
		sums[o] += d
		f.list = append(f.list, statementLine{perSaga: float64(d) / n, owner: o, query: q})
	}
	for o, s := range sums {
		f.byOwner[o] = round(float64(s) / n)
	}
	slices.SortFunc(f.list, func(a, b statementLine) int {
		return cmp.Or(cmp.Compare(b.perSaga, a.perSaga), cmp.Compare(a.owner, b.owner), cmp.Compare(a.query, b.query))
	})
	return f
}

var spaces = regexp.MustCompile(`\s+`)

// writeList writes the statements of the phase, a saga each, most called
// first: calls a saga, owner and the statement on one line.
func writeList(w io.Writer, list []statementLine) error {
	for _, l := range list {
		if _, err := fmt.Fprintf(w, "%.2f\t%s\t%s\n", l.perSaga, l.owner, strings.TrimSpace(spaces.ReplaceAllString(l.query, " "))); err != nil {
			return err
		}
	}
	return nil
}

// writeListFile writes list to path (see writeList).
func writeListFile(path string, list []statementLine) error {
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	if err := writeList(f, list); err != nil {
		_ = f.Close()
		return err
	}
	return f.Close()
}
