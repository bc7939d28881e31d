package main

import (
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	mrand "math/rand/v2"
	"os"
	"runtime"
	"runtime/pprof"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/pgsaga/pgsaga/cmd/internal/workerwatch"
	"github.com/pgsaga/pgsaga/internal/pgdb"
	"github.com/pgsaga/pgsaga/saga"
	"github.com/pgsaga/pgsaga/saga/orderpayment"
)

// result is the JSON on the last line of stdout. Its field names are a
// contract.
type result struct {
	OK bool `json:"ok"`

	// Throughput phase.
	Sagas        int     `json:"sagas"`
	SagasPerS    float64 `json:"sagas_per_s"`
	StepsPerS    float64 `json:"steps_per_s"`
	StepsPerSaga float64 `json:"steps_per_saga"`
	ThroughputS  float64 `json:"throughput_s"`
	// SagasPerSByQuarter is the rate in each quarter of the phase: flat
	// when nothing degrades as the tables see traffic.
	SagasPerSByQuarter [4]float64 `json:"sagas_per_s_by_quarter"`
	// TopicRowsLeft is how many messages the saga topics still hold at the
	// end of the phase, retention running.
	TopicRowsLeft int `json:"topic_rows_left"`

	// Latency phase.
	Rate         float64 `json:"rate"`
	LatencySagas int     `json:"latency_sagas"`
	P50Ms        float64 `json:"p50_ms"`
	P95Ms        float64 `json:"p95_ms"`
	P99Ms        float64 `json:"p99_ms"`
	MaxMs        float64 `json:"max_ms"`

	// Baseline: single-insert commits per second at 16 connections.
	CommitTPS float64 `json:"commit_tps"`
	// StepsPerCommit is steps_per_s / commit_tps.
	StepsPerCommit float64 `json:"steps_per_commit"`

	// CPU seconds per 1,000 sagas in the throughput phase, and CPU use
	// while idle in percent of one core. Postgres figures are null when the
	// server's processes cannot be read.
	CPUPer1kSagas cpuFigures `json:"cpu_s_per_1k_sagas"`
	// StatementsPerSaga in the throughput phase: counted by
	// pg_stat_statements in the benchmark's database when it can be used
	// (StatementsSource "pg_stat_statements"), else by the benchmark's
	// pools ("client"). ClientStatementsPerSaga is always the pools' count.
	StatementsPerSaga       float64 `json:"statements_per_saga"`
	StatementsSource        string  `json:"statements_source"`
	ClientStatementsPerSaga float64 `json:"client_statements_per_saga"`
	// StatementsByOwner splits StatementsPerSaga by who sent each
	// statement (see ownerOf); null when StatementsSource is
	// "unavailable".
	StatementsByOwner map[string]float64 `json:"statements_by_owner"`
	// CommitsPerSaga counts the commits of this process's pools (COMMIT,
	// and each statement or pipeline outside a transaction), but the fake
	// gateway's (GatewayCommitsPerSaga); 0 with -worker-processes.
	CommitsPerSaga        float64 `json:"commits_per_saga"`
	GatewayCommitsPerSaga float64 `json:"gateway_commits_per_saga"`
	// RoundTripsPerSaga counts the round trips of this process's pools
	// (each statement sent on its own, each pipeline once), the fake
	// gateway's apart; 0 with -worker-processes.
	RoundTripsPerSaga float64    `json:"round_trips_per_saga"`
	IdleCPUPct        cpuFigures `json:"idle_cpu_pct"`

	Completed    int      `json:"completed"`
	Compensated  int      `json:"compensated"`
	Failed       int      `json:"failed"`
	Unfinished   int      `json:"unfinished"`
	InvariantsOK bool     `json:"invariants_ok"`
	Violations   []string `json:"violations"`

	Config  benchConfig `json:"config"`
	Machine machine     `json:"machine"`
}

type cpuFigures struct {
	Process  float64  `json:"process"`
	Postgres *float64 `json:"postgres"`
}

type benchConfig struct {
	Consumers int `json:"consumers"`
	// Lanes is the old name of Consumers, kept for readers of earlier runs.
	Lanes     int     `json:"lanes"`
	Workers   int     `json:"workers"`
	Batch     int     `json:"batch"`
	Inflight  int     `json:"inflight"`
	DurationS float64 `json:"duration_s"`
	BaselineS float64 `json:"baseline_s"`
	IdleS     float64 `json:"idle_s"`
	// AsyncProjection: order_views kept by a consumer, not inline.
	AsyncProjection bool `json:"async_projection"`
	// QueueEveryHop: no in-process deliveries.
	QueueEveryHop bool `json:"queue_every_hop"`
	// GatewayDelayMs: every gateway call answered after this long.
	GatewayDelayMs float64 `json:"gateway_delay_ms"`
	// WorkerProcesses: the workers ran as this many processes (0: in this
	// one).
	WorkerProcesses int `json:"worker_processes"`
	// PaymentsService: the payment step ran as a service of its own, on a
	// second database, reached through a broker (-payments-service).
	PaymentsService bool `json:"payments_service"`
}

type machine struct {
	Cores    int    `json:"cores"`
	GOOS     string `json:"goos"`
	GOARCH   string `json:"goarch"`
	Go       string `json:"go"`
	Postgres string `json:"postgres"`
}

func (b *bench) run(ctx context.Context) int {
	interrupted := ctx // SIGINT, SIGTERM
	ctx, stopWatching, err := b.startWorkers(ctx)
	if err != nil {
		fmt.Fprintln(b.status, "sagabench:", err)
		return exitNoService
	}
	defer stopWatching()
	r := result{Violations: []string{}, Rate: b.opts.rate,
		Config: benchConfig{Consumers: b.opts.consumers, Lanes: b.opts.consumers, Workers: b.opts.workers, Batch: b.opts.batch, Inflight: b.opts.inflight,
			DurationS: b.opts.duration.Seconds(), BaselineS: b.opts.baseline.Seconds(), IdleS: b.opts.idle.Seconds(),
			AsyncProjection: b.opts.asyncProjection, QueueEveryHop: b.opts.queueEveryHop, WorkerProcesses: b.opts.workerProcs,
			PaymentsService: b.opts.paymentsService != "",
			GatewayDelayMs:  float64(b.opts.gatewayDelay) / float64(time.Millisecond)},
		Machine: machine{Cores: runtime.NumCPU(), GOOS: runtime.GOOS, GOARCH: runtime.GOARCH, Go: runtime.Version()}}
	_ = b.db.SQL.QueryRowContext(ctx, `SELECT current_setting('server_version')`).Scan(&r.Machine.Postgres)
	finished := true

	if b.opts.baseline > 0 {
		tps, err := b.commitBaseline(ctx)
		if err != nil {
			fmt.Fprintln(b.status, "sagabench: baseline:", cmp.Or(workerwatch.Stopped(ctx), err))
			return exitFailed
		}
		r.CommitTPS = tps
		fmt.Fprintf(b.status, "baseline     %.0f single-insert commits/s at 16 connections\n", tps)
	}

	if b.opts.sagas > 0 {
		ok, err := b.throughput(ctx, &r)
		if err != nil {
			fmt.Fprintln(b.status, "sagabench: throughput phase:", cmp.Or(workerwatch.Stopped(ctx), err))
			return exitFailed
		}
		finished = finished && ok
	}
	if b.opts.rate > 0 && ctx.Err() == nil {
		ok, err := b.latency(ctx, &r)
		if err != nil {
			fmt.Fprintln(b.status, "sagabench: latency phase:", cmp.Or(workerwatch.Stopped(ctx), err))
			return exitFailed
		}
		finished = finished && ok
	}
	if b.opts.idle > 0 && ctx.Err() == nil {
		fmt.Fprintf(b.status, "idle         measuring for %s\n", b.opts.idle)
		start := b.cpu.read()
		select {
		case <-ctx.Done():
		case <-time.After(b.opts.idle):
		}
		u := since(start, b.cpu.read())
		r.IdleCPUPct = figures(u, func(d time.Duration) float64 { return 100 * d.Seconds() / u.wall.Seconds() })
	}

	stopWatching() // the workers' own stop below is no failure
	if err := workerwatch.Stopped(ctx); err != nil {
		fmt.Fprintln(b.status, "sagabench:", err)
		return exitFailed
	}
	// Stop the workers before checking, so nothing moves under the check.
	b.stopWorkers()
	var report orderpayment.Report
	if b.pay != nil {
		report, err = orderpayment.CheckSplit(context.WithoutCancel(ctx), b.db.SQL, b.payDB.SQL, nil)
	} else {
		report, err = orderpayment.Check(context.WithoutCancel(ctx), b.db.SQL, nil)
	}
	if err != nil {
		fmt.Fprintln(b.status, "sagabench: checking invariants:", err)
		return exitFailed
	}
	r.Completed, r.Compensated, r.Failed = report.Sagas[saga.StatusCompleted], report.Sagas[saga.StatusCompensated], report.Sagas[saga.StatusFailed]
	r.Unfinished = report.Total - r.Completed - r.Compensated - r.Failed
	for _, v := range report.Violations {
		r.Violations = append(r.Violations, v.String())
	}
	r.InvariantsOK = report.OK()
	if r.CommitTPS > 0 {
		r.StepsPerCommit = r.StepsPerS / r.CommitTPS
	}
	r.OK = finished && r.InvariantsOK && r.Unfinished == 0 && interrupted.Err() == nil
	b.print(r)
	if !r.OK {
		return exitFailed
	}
	return exitOK
}

func figures(u usage, f func(time.Duration) float64) cpuFigures {
	c := cpuFigures{Process: round(f(u.process))}
	if u.pgOK {
		v := round(f(u.postgres))
		c.Postgres = &v
	}
	return c
}

func round(v float64) float64 { return float64(int64(v*100+0.5)) / 100 }

// commitBaseline measures single-row insert commits per second with 16
// connections, each in autocommit.
func (b *bench) commitBaseline(ctx context.Context) (float64, error) {
	url := b.db.Pool.Config().ConnString()
	pool, err := pgdb.Open(ctx, pgdb.Config{URL: url, MaxConns: 16, ApplicationName: "sagabench-baseline"})
	if err != nil {
		return 0, err
	}
	defer pool.Close()
	if _, err := pool.SQL.ExecContext(ctx, `CREATE TABLE bench_commits (id bigserial PRIMARY KEY, v integer NOT NULL)`); err != nil {
		return 0, err
	}
	defer func() { _, _ = pool.SQL.Exec(`DROP TABLE bench_commits`) }()
	var n atomic.Int64
	var wg sync.WaitGroup
	deadline := time.Now().Add(b.opts.baseline)
	errs := make(chan error, 16)
	for w := range 16 {
		wg.Go(func() {
			defer b.dropOnPanic()
			for i := 0; time.Now().Before(deadline); i++ {
				if _, err := pool.Pool.Exec(ctx, `INSERT INTO bench_commits (v) VALUES ($1)`, w*1_000_000+i); err != nil {
					errs <- err
					return
				}
				n.Add(1)
			}
		})
	}
	start := time.Now()
	wg.Wait()
	elapsed := time.Since(start)
	close(errs)
	if err := firstError(ctx, errs); err != nil {
		return 0, err
	}
	return float64(n.Load()) / elapsed.Seconds(), nil
}

// throughput runs the closed loop.
func (b *bench) throughput(ctx context.Context, r *result) (bool, error) {
	const phase = "throughput"
	n := b.opts.sagas
	fmt.Fprintf(b.status, "throughput   %s, at most %d in flight, %s a handler, %s, batch %d\n", plural(n, "saga", "sagas"), b.opts.inflight,
		plural(b.opts.consumers, "consumer", "consumers"), plural(b.opts.workers, "worker", "workers"), b.opts.batch)
	slots := make(chan struct{}, b.opts.inflight)
	b.tracker.setWindow(phase, slots)
	if b.opts.profile != "" {
		f, err := os.Create(b.opts.profile)
		if err != nil {
			return false, fmt.Errorf("creating the CPU profile: %w", err)
		}
		defer f.Close()
		if err := pprof.StartCPUProfile(f); err != nil {
			return false, fmt.Errorf("starting the CPU profile: %w", err)
		}
		defer pprof.StopCPUProfile()
	}
	cpuStart := b.cpu.read()
	stmtStart := b.countStatements(ctx)
	next := make(chan int)
	errs := make(chan error, b.opts.placers())
	// The phase ends once waitPhase returns: no more placements. (A failed
	// placement used to leave the loop below waiting for a slot that sagas
	// which could no longer end would never free, and the run hung.)
	over := make(chan struct{})
	var wg sync.WaitGroup
	for p := range b.opts.placers() {
		rng := mrand.New(mrand.NewPCG(uint64(p), 1))
		wg.Go(func() {
			defer b.dropOnPanic()
			for i := range next {
				start := time.Now()
				if err := b.place(ctx, phase, i, rng, start); err != nil {
					<-slots
					errs <- err
					return
				}
			}
		})
	}
	go func() {
		defer b.dropOnPanic()
		defer close(next)
		for i := range n {
			select {
			case slots <- struct{}{}:
			case <-ctx.Done():
				return
			case <-over:
				return
			}
			select {
			case next <- i:
			case <-ctx.Done():
				return
			case <-over:
				return
			}
		}
	}()
	ok := b.waitPhase(ctx, phase, n, errs)
	close(over)
	wg.Wait()
	close(errs)
	if err := firstError(ctx, errs); err != nil {
		return false, err
	}
	cpu := since(cpuStart, b.cpu.read())
	stmtEnd := b.countStatements(context.WithoutCancel(ctx))
	res := b.tracker.result(phase)
	took := res.last.Sub(res.first)
	r.Sagas = len(res.latencies)
	sf := perSaga(stmtStart, stmtEnd, r.Sagas, b.opts.workerProcs > 0)
	r.StatementsPerSaga, r.ClientStatementsPerSaga, r.StatementsSource = sf.perSaga, sf.clientPerSaga, sf.source
	r.StatementsByOwner, r.CommitsPerSaga, r.GatewayCommitsPerSaga = sf.byOwner, sf.commitsPerSaga, sf.gatewayCommitsPerSaga
	r.RoundTripsPerSaga = sf.tripsPerSaga
	if b.opts.statementList != "" {
		if err := writeListFile(b.opts.statementList, sf.list); err != nil {
			return false, fmt.Errorf("-statement-list: %w", err)
		}
	}
	r.ThroughputS = round(took.Seconds())
	if took > 0 {
		r.SagasPerS = round(float64(r.Sagas) / took.Seconds())
	}
	steps, err := b.countSteps(context.WithoutCancel(ctx))
	if err != nil {
		return false, err
	}
	if took > 0 && r.Sagas > 0 {
		r.StepsPerS = round(float64(steps) / took.Seconds())
		r.StepsPerSaga = round(float64(steps) / float64(r.Sagas))
	}
	for i, q := range res.byQuarter() {
		r.SagasPerSByQuarter[i] = round(q)
	}
	r.TopicRowsLeft = b.topicRows(context.WithoutCancel(ctx))
	if r.Sagas > 0 {
		per := 1000 / float64(r.Sagas)
		r.CPUPer1kSagas = figures(cpu, func(d time.Duration) float64 { return d.Seconds() * per })
	}
	fmt.Fprintf(b.status, "throughput   %s in %.1fs: %.0f sagas/s, %.0f steps/s\n", plural(r.Sagas, "saga", "sagas"), took.Seconds(), r.SagasPerS, r.StepsPerS)
	return ok, nil
}

// topicRows counts the messages waiting in the queues.
func (b *bench) topicRows(ctx context.Context) int {
	var n int
	if err := b.db.SQL.QueryRowContext(ctx, `SELECT count(*) FROM pgsaga_queue`).Scan(&n); err != nil {
		return -1
	}
	return n
}

// countSteps counts the idempotent steps run so far: every saga reaction
// (a start, a reply applied) and every participant step.
func (b *bench) countSteps(ctx context.Context) (int, error) {
	var n int
	err := b.db.SQL.QueryRowContext(ctx, `SELECT
    (SELECT count(*) FROM saga_history WHERE kind IN ('started', 'reply_ok', 'reply_failed')) +
    (SELECT count(*) FROM idempotency_keys WHERE scope = ANY ($1) AND status <> 'pending')`, b.app.StepNames()).Scan(&n)
	if err != nil {
		return 0, fmt.Errorf("counting steps: %w", err)
	}
	return n, nil
}

// latency runs the open loop.
func (b *bench) latency(ctx context.Context, r *result) (bool, error) {
	const phase = "latency"
	n := int(b.opts.rate * b.opts.duration.Seconds())
	fmt.Fprintf(b.status, "latency      %.0f sagas/s offered for %s (%s)\n", b.opts.rate, b.opts.duration, plural(n, "saga", "sagas"))
	errs := make(chan error, n)
	var wg sync.WaitGroup
	over := make(chan struct{}) // no more placements once waitPhase returns
	scheduled := make(chan struct{})
	go func() {
		defer b.dropOnPanic()
		defer close(scheduled)
		start := time.Now()
		interval := time.Duration(float64(time.Second) / b.opts.rate)
		for i := range n {
			at := start.Add(time.Duration(i) * interval)
			if d := time.Until(at); d > 0 {
				select {
				case <-time.After(d):
				case <-ctx.Done():
					return
				case <-over:
					return
				}
			}
			rng := mrand.New(mrand.NewPCG(uint64(i), 2))
			wg.Go(func() {
				defer b.dropOnPanic()
				if err := b.place(ctx, phase, i, rng, at); err != nil {
					errs <- err
				}
			})
		}
	}()
	ok := b.waitPhase(ctx, phase, n, errs)
	close(over)
	<-scheduled // before Wait: the scheduler adds to wg
	wg.Wait()
	close(errs)
	if err := firstError(ctx, errs); err != nil {
		return false, err
	}
	res := b.tracker.result(phase)
	lat := res.latencies
	slices.Sort(lat)
	r.LatencySagas = len(lat)
	r.P50Ms = ms(percentile(lat, 0.50))
	r.P95Ms = ms(percentile(lat, 0.95))
	r.P99Ms = ms(percentile(lat, 0.99))
	if len(lat) > 0 {
		r.MaxMs = ms(lat[len(lat)-1])
	}
	fmt.Fprintf(b.status, "latency      p50 %.1fms, p95 %.1fms, p99 %.1fms, max %.1fms\n", r.P50Ms, r.P95Ms, r.P99Ms, r.MaxMs)
	return ok, nil
}

// firstError is the first error of a phase's clients, unless ctx ended:
// then calls cut short are the interruption's doing (the phase reports it)
// and the figures so far still count.
func firstError(ctx context.Context, errs <-chan error) error {
	err := <-errs
	if ctx.Err() != nil {
		return nil
	}
	return err
}

func ms(d time.Duration) float64 { return round(float64(d.Microseconds()) / 1000) }

// waitPhase shows progress until n sagas of phase ended, a placement
// failed, the timeout passed or ctx was cancelled.
func (b *bench) waitPhase(ctx context.Context, phase string, n int, errs chan error) bool {
	deadline := time.NewTimer(b.opts.timeout)
	defer deadline.Stop()
	tick := time.NewTicker(50 * time.Millisecond)
	defer tick.Stop()
	start, lastPrint, lastEnded := time.Now(), time.Now(), 0
	for {
		placed, ended := b.tracker.progress(phase)
		if ended >= n {
			return true
		}
		if since := time.Since(lastPrint); since >= time.Second {
			fmt.Fprintf(b.status, "%-12s %5.1fs  placed %d, ended %d of %d (%.0f/s)\n", phase, time.Since(start).Seconds(), placed, ended, n, float64(ended-lastEnded)/since.Seconds())
			lastPrint, lastEnded = time.Now(), ended
		}
		select {
		case <-ctx.Done():
			b.interrupted(ctx)
			return false
		case <-deadline.C:
			fmt.Fprintf(b.status, "gave up waiting after %s: %d of %s ended\n", b.opts.timeout, ended, plural(n, "saga", "sagas"))
			return false
		case err := <-errs:
			errs <- err // for the caller
			if ctx.Err() != nil {
				// A placement the interruption cut short: select picks
				// either of the two, and the run was interrupted.
				b.interrupted(ctx)
			}
			return false
		case <-tick.C:
		}
	}
}

// interrupted says the phase was interrupted, unless a worker's stop
// ended ctx (run says why then).
func (b *bench) interrupted(ctx context.Context) {
	if workerwatch.Stopped(ctx) == nil {
		fmt.Fprintln(b.status, "interrupted")
	}
}

func (b *bench) print(r result) {
	w := b.out
	fmt.Fprintln(w)
	fmt.Fprintf(w, "  %-18s %s, %s, Go %s, PostgreSQL %s\n", "machine", r.Machine.GOOS+"/"+r.Machine.GOARCH, plural(r.Machine.Cores, "core", "cores"), r.Machine.Go, r.Machine.Postgres)
	fmt.Fprintf(w, "  %-18s %s a handler, %s, batch %d\n", "config", plural(r.Config.Consumers, "consumer", "consumers"), plural(r.Config.Workers, "worker", "workers"), r.Config.Batch)
	if r.CommitTPS > 0 {
		fmt.Fprintf(w, "  %-18s %.0f single-insert commits/s (16 connections)\n", "baseline", r.CommitTPS)
	}
	if r.Sagas > 0 {
		fmt.Fprintf(w, "  %-18s %.0f sagas/s, %.0f steps/s (%.1f steps a saga; %.2f steps per baseline commit)\n", "throughput", r.SagasPerS, r.StepsPerS, r.StepsPerSaga, r.StepsPerCommit)
		fmt.Fprintf(w, "  %-18s %.0f, %.0f, %.0f, %.0f sagas/s by quarter; %s left in the topics (retention on)\n", "steadiness",
			r.SagasPerSByQuarter[0], r.SagasPerSByQuarter[1], r.SagasPerSByQuarter[2], r.SagasPerSByQuarter[3], plural(r.TopicRowsLeft, "message", "messages"))
		fmt.Fprintf(w, "  %-18s process %.2f s%s\n", "CPU per 1k sagas", r.CPUPer1kSagas.Process, pgFigure(r.CPUPer1kSagas.Postgres, " s"))
		fmt.Fprintf(w, "  %-18s %.1f (%s; the pools sent %.1f)%s\n", "statements/saga", r.StatementsPerSaga, r.StatementsSource, r.ClientStatementsPerSaga, ownerFigures(r.StatementsByOwner))
		fmt.Fprintf(w, "  %-18s %.2f (this process's pools; the fake gateway's own %.2f more)\n", "commits/saga", r.CommitsPerSaga, r.GatewayCommitsPerSaga)
		if r.StatementsSource != "pg_stat_statements" {
			fmt.Fprintf(w, "  %-18s the server does not preload pg_stat_statements (shared_preload_libraries), so statements are counted by this program's pools, which do not see the server's own\n", "note")
		}
	}
	if r.LatencySagas > 0 {
		fmt.Fprintf(w, "  %-18s p50 %.1f ms, p95 %.1f ms, p99 %.1f ms, max %.1f ms at %.0f sagas/s offered\n", "latency", r.P50Ms, r.P95Ms, r.P99Ms, r.MaxMs, r.Rate)
	}
	if r.Config.IdleS > 0 {
		fmt.Fprintf(w, "  %-18s process %.2f%% of a core%s\n", "idle CPU", r.IdleCPUPct.Process, pgFigure(r.IdleCPUPct.Postgres, "%"))
	}
	fmt.Fprintf(w, "  %-18s %d completed, %d compensated, %d failed, %d unfinished\n", "sagas", r.Completed, r.Compensated, r.Failed, r.Unfinished)
	if r.InvariantsOK {
		fmt.Fprintf(w, "  %-18s all hold\n", "invariants")
	} else {
		fmt.Fprintf(w, "  %-18s BROKEN\n", "invariants")
		for _, v := range r.Violations {
			fmt.Fprintf(w, "    - %s\n", v)
		}
	}
	j, _ := json.Marshal(r)
	fmt.Fprintln(w, string(j))
}

// ownerFigures is the statements a saga by owner, for the report.
func ownerFigures(by map[string]float64) string {
	if by == nil {
		return ""
	}
	parts := make([]string, 0, len(owners))
	for _, o := range owners {
		parts = append(parts, fmt.Sprintf("%s %.1f", o, by[o]))
	}
	return ": " + strings.Join(parts, ", ")
}

func pgFigure(v *float64, unit string) string {
	if v == nil {
		return ", PostgreSQL not readable"
	}
	return fmt.Sprintf(", PostgreSQL %.2f%s", *v, unit)
}
