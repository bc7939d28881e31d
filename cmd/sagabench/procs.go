package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/pgsaga/pgsaga/internal/cmdlog"
	"github.com/pgsaga/pgsaga/internal/obs"
	"github.com/pgsaga/pgsaga/internal/pgdb"
	"github.com/pgsaga/pgsaga/internal/transport"
	"github.com/pgsaga/pgsaga/saga/orderpayment"
)

// workerEnv, set in a process's environment, makes sagabench run one
// worker of the run described by its value (a workerSpec in JSON) instead
// of a benchmark: -worker-processes starts its workers so.
const workerEnv = "SAGABENCH_WORKER"

// workerReady is the line a worker process prints once its worker runs.
const workerReady = "sagabench worker ready"

// workerSpec is what a worker process needs of the run.
type workerSpec struct {
	URL             string `json:"url"`
	GatewayURL      string `json:"gateway_url"`
	Consumers       int    `json:"consumers"`
	Batch           int    `json:"batch"`
	AsyncProjection bool   `json:"async_projection"`
	QueueEveryHop   bool   `json:"queue_every_hop"`
	MaxConns        int32  `json:"max_conns"`
	// LogLevel (a slog level's name) and LogFormat are the parent's
	// -log-level (or -v) and -log-format.
	LogLevel  string `json:"log_level"`
	LogFormat string `json:"log_format"`
	// Metrics: serve the worker's metrics on a free port of 127.0.0.1
	// (the parent's -metrics-addr); its address is announced before
	// workerReady.
	Metrics bool `json:"metrics"`
}

// workerMetrics starts the line a worker process prints with its metrics
// address.
const workerMetrics = "sagabench worker metrics "

// runWorkerProcess is a worker process: it runs one worker of the sample
// over the run's database until SIGTERM, SIGINT or the end of its stdin
// (the parent's end), then drains it. Exit
// status 0 once drained; 1 if the worker could not start or stopped by
// itself.
func runWorkerProcess(raw string, stdout, stderr io.Writer) int {
	var spec workerSpec
	if err := json.Unmarshal([]byte(raw), &spec); err != nil {
		fmt.Fprintln(stderr, "sagabench worker: reading", workerEnv+":", err)
		return exitUsage
	}
	level := slog.LevelWarn
	if spec.LogLevel != "" {
		if err := level.UnmarshalText([]byte(spec.LogLevel)); err != nil {
			fmt.Fprintln(stderr, "sagabench worker: reading", workerEnv+":", err)
			return exitUsage
		}
	}
	log := cmdlog.New(stderr, spec.LogFormat, level).With("worker_pid", os.Getpid())
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	// The parent holds stdin open while it runs: its end is ours.
	ctx, parentGone := context.WithCancel(ctx)
	go func() {
		_, _ = io.Copy(io.Discard, os.Stdin)
		parentGone()
	}()
	stopTracing, err := obs.Tracing(ctx, "sagabench-worker", stderr)
	if err != nil {
		fmt.Fprintln(stderr, "sagabench worker:", err)
		return exitNoService
	}
	defer flushTraces(ctx, stopTracing, stderr)
	db, err := pgdb.Open(ctx, pgdb.Config{URL: spec.URL, MaxConns: spec.MaxConns, ApplicationName: "sagabench-worker"})
	if err != nil {
		fmt.Fprintln(stderr, "sagabench worker:", err)
		return exitNoService
	}
	defer db.Close()
	tcfg := transport.Config{BatchSize: spec.Batch, Consumers: spec.Consumers}
	var reg *prometheus.Registry
	if spec.Metrics {
		reg = obs.NewRegistry()
		tcfg.Metrics = reg
	}
	app, err := orderpayment.New(orderpayment.Config{DB: db.SQL, GatewayURL: spec.GatewayURL,
		Transport:       tcfg,
		AsyncProjection: spec.AsyncProjection, QueueEveryHop: spec.QueueEveryHop, FinishedChannel: finishedChannel, Logger: log})
	if err != nil {
		fmt.Fprintln(stderr, "sagabench worker:", err)
		return exitNoService
	}
	w, err := app.NewWorker()
	if err == nil {
		err = w.Start(ctx)
	}
	if err != nil {
		fmt.Fprintln(stderr, "sagabench worker: starting:", err)
		return exitNoService
	}
	if reg != nil {
		// The database's gauges are the parent's to serve: here, only
		// what this process counts.
		srv, err := obs.ServeMetrics("127.0.0.1:0", reg, log)
		if err != nil {
			_ = w.Stop()
			fmt.Fprintln(stderr, "sagabench worker:", err)
			return exitNoService
		}
		defer srv.Close() //nolint:errcheck // the process ends
		fmt.Fprintf(stdout, "%shttp://%s/metrics\n", workerMetrics, srv.Addr())
	}
	fmt.Fprintln(stdout, workerReady)
	select {
	case <-ctx.Done():
		if err := w.Stop(); err != nil {
			fmt.Fprintln(stderr, "sagabench worker: stopping:", err)
			return exitFailed
		}
		return exitOK
	case <-w.Stopped():
		fmt.Fprintln(stderr, "sagabench worker: the worker stopped by itself:", w.Err())
		return exitFailed
	}
}

// workerProcess is a worker process of the run (workerwatch.Stoppable).
type workerProcess struct {
	// metricsURL is where it serves its metrics ("" if it does not).
	metricsURL string

	cmd     *exec.Cmd
	stdin   *os.File // closing it stops the worker
	stopped chan struct{}
	err     error // why it exited; read after stopped
}

// workerStopTimeout bounds a worker process's drain; then it is killed.
const workerStopTimeout = time.Minute

func (p *workerProcess) Stopped() <-chan struct{} { return p.stopped }
func (p *workerProcess) Err() error               { return p.err }

// startWorkerProcess starts a copy of this program as a worker of spec and
// returns once its worker runs, or with the reason it could not start.
func startWorkerProcess(ctx context.Context, spec workerSpec, stderr io.Writer) (*workerProcess, error) {
	raw, err := json.Marshal(spec)
	if err != nil {
		return nil, err
	}
	exe, err := os.Executable()
	if err != nil {
		return nil, fmt.Errorf("finding this program to start a worker process: %w", err)
	}
	// The worker outlives no parent: it stops when its stdin, a pipe this
	// process holds, ends (however this process ends), and the kernel
	// sends it SIGTERM if this process dies first.
	stdin, toChild, err := os.Pipe()
	if err != nil {
		return nil, err
	}
	fromChild, stdout, err := os.Pipe()
	if err != nil {
		_ = stdin.Close()
		_ = toChild.Close()
		return nil, err
	}
	cmd := exec.Command(exe)
	cmd.Env = append(os.Environ(), workerEnv+"="+string(raw))
	cmd.Stdin, cmd.Stdout, cmd.Stderr = stdin, stdout, stderr
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGTERM}
	err = cmd.Start()
	_ = stdin.Close() // the child's ends
	_ = stdout.Close()
	if err != nil {
		_ = toChild.Close()
		_ = fromChild.Close()
		return nil, fmt.Errorf("starting a worker process: %w", err)
	}
	p := &workerProcess{cmd: cmd, stopped: make(chan struct{}), stdin: toChild}
	ready := make(chan bool, 1)
	go func() {
		defer fromChild.Close()
		lines := bufio.NewScanner(fromChild)
		ok := lines.Scan()
		if url, found := strings.CutPrefix(lines.Text(), workerMetrics); ok && found {
			p.metricsURL = url // read after ready
			ok = lines.Scan()
		}
		ready <- ok && lines.Text() == workerReady
		_, _ = io.Copy(io.Discard, fromChild) // nothing more is expected; keep the pipe drained
	}()
	go func() {
		p.err = cmd.Wait()
		if p.err == nil {
			p.err = errors.New("the worker process exited")
		}
		close(p.stopped)
	}()
	select {
	case ok := <-ready:
		if ok {
			return p, nil
		}
		_ = cmd.Process.Kill()
		<-p.stopped
		return nil, fmt.Errorf("a worker process did not start: %w", p.err)
	case <-ctx.Done():
		_ = p.stop()
		return nil, context.Cause(ctx)
	}
}

// stop asks the process to drain and waits for it to exit, killing it
// after workerStopTimeout.
func (p *workerProcess) stop() error {
	defer p.stdin.Close()
	select {
	case <-p.stopped:
		return nil // exited already; Watch reported why
	default:
	}
	if err := p.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		return fmt.Errorf("stopping worker process %d: %w", p.cmd.Process.Pid, err)
	}
	select {
	case <-p.stopped:
	case <-time.After(workerStopTimeout):
		_ = p.cmd.Process.Kill()
		<-p.stopped
		return fmt.Errorf("worker process %d did not drain within %s and was killed", p.cmd.Process.Pid, workerStopTimeout)
	}
	var exit *exec.ExitError
	if errors.As(p.err, &exit) && !exit.Success() {
		return fmt.Errorf("worker process %d: %w", p.cmd.Process.Pid, p.err)
	}
	return nil
}
