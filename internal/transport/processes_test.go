package transport_test

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/internal/pgdb"
	"github.com/pgsaga/pgsaga/internal/testdb"
	"github.com/pgsaga/pgsaga/internal/transport"
)

// workerEnv makes this test binary a worker process (see runWorker): its
// value is "<database URL>|<topic>|<effects table>|<tag>".
const workerEnv = "PGSAGA_TRANSPORT_WORKER"

// runWorker consumes the topic as group "g" until its stdin closes,
// recording each message it handles in the effects table under its tag. A
// worker tagged "stuck" prints "holding" and then hangs in its first
// message's statement, holding its batch, until it is killed; one tagged
// "frozen" prints "holding" and waits, with short deadlines, to be stopped
// (SIGSTOP) while its batch is open.
func runWorker() int {
	parts := strings.Split(os.Getenv(workerEnv), "|")
	if len(parts) != 4 {
		fmt.Fprintln(os.Stderr, "worker: bad", workerEnv)
		return 2
	}
	url, topic, eff, tag := parts[0], parts[1], parts[2], parts[3]
	ctx := context.Background()
	db, err := pgdb.Open(ctx, pgdb.Config{URL: url, MaxConns: 4, ApplicationName: "transport-worker-" + tag})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer db.Close()
	cfg := transport.Config{DB: db.SQL, Logger: testLogger(), BatchSize: 5, IdlePollInterval: testdb.NoSafetyPoll,
		AttemptTimeout: time.Hour, StatementTimeout: time.Hour}
	if tag == "frozen" {
		cfg.BatchTimeout, cfg.AttemptTimeout, cfg.StatementTimeout = 100*time.Millisecond, 500*time.Millisecond, 200*time.Millisecond
	}
	tr, err := transport.New(cfg)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	r, err := tr.NewRouter()
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	if err := r.AddHandler("h", topic, "g", func(msg *message.Message) error {
		tx, _ := transport.TxFromContext(msg.Context())
		pause := "0.002"
		switch tag {
		case "stuck":
			fmt.Println("holding")
			pause = "600"
		case "frozen":
			fmt.Println("holding")
			time.Sleep(time.Hour) // stopped meanwhile
		}
		if _, err := tx.ExecContext(msg.Context(), `SELECT pg_sleep(`+pause+`)`); err != nil {
			return err
		}
		_, err := tx.ExecContext(msg.Context(), `INSERT INTO `+eff+` (msg, part) VALUES ($1, $2)`, msg.UUID, tag)
		return err
	}); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	select {
	case <-r.Running():
	case err := <-done:
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	fmt.Println("ready")
	_, _ = io.Copy(io.Discard, os.Stdin)
	if err := r.Close(); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	if err := <-done; err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	return 0
}

// workerProcess is a worker started by startWorker.
type workerProcess struct {
	cmd    *exec.Cmd
	stdin  io.WriteCloser // closing it stops the worker
	stdout *bufio.Reader  // what it reports, a line at a time
}

// startWorker starts this test binary as a worker process consuming e's
// topic, tagging its effects with tag, and waits until it is ready.
func startWorker(t *testing.T, e *env, tag string) *workerProcess {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), workerEnv+"="+strings.Join([]string{e.db.URL, e.in, e.eff, tag}, "|"))
	cmd.Stderr = os.Stderr
	stdin, err := cmd.StdinPipe()
	require.NoError(t, err)
	stdout, err := cmd.StdoutPipe()
	require.NoError(t, err)
	require.NoError(t, cmd.Start())
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	w := &workerProcess{cmd: cmd, stdin: stdin, stdout: bufio.NewReader(stdout)}
	line, err := w.stdout.ReadString('\n')
	require.NoError(t, err, "worker %s did not start", tag)
	require.Equal(t, "ready\n", line)
	return w
}

// Two worker processes consuming one group share its messages: each handles
// some, none is handled twice, none is lost.
func TestTwoProcessesShareAGroup(t *testing.T) {
	t.Parallel()
	e := newEnvOn(t, testdb.Fresh(t), nil)
	var workers []*workerProcess
	for _, tag := range []string{"p1", "p2"} {
		workers = append(workers, startWorker(t, e, tag))
	}

	const n = 200
	e.publish(n)
	e.drained(e.in, "g", time.Minute)
	for _, w := range workers {
		require.NoError(t, w.stdin.Close())
		require.NoError(t, w.cmd.Wait(), "a worker failed")
	}
	assert.Equal(t, n, e.count(`SELECT count(DISTINCT msg) FROM `+e.eff), "every message handled")
	assert.Equal(t, n, e.count(`SELECT count(*) FROM `+e.eff), "none twice")
	p1 := e.count(`SELECT count(*) FROM ` + e.eff + ` WHERE part = 'p1'`)
	p2 := e.count(`SELECT count(*) FROM ` + e.eff + ` WHERE part = 'p2'`)
	t.Logf("process 1 handled %d, process 2 handled %d", p1, p2)
	assert.Positive(t, p1, "process 1 handled messages of the group")
	assert.Positive(t, p2, "process 2 handled messages of the group")
}

// A worker killed (SIGKILL) while it holds a batch, or frozen (SIGSTOP)
// with its batch open, costs those messages a redelivery, soon: another
// worker that started after it, and so was never told about them, finds
// them once the server has ended the dead or frozen worker's transaction
// (the killed worker's connection is checked while its statement runs; the
// frozen one's sits idle in its transaction past the transport's bound).
func TestKilledOrFrozenWorkerCostsARetry(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		tag    string
		signal syscall.Signal
	}{{"stuck", syscall.SIGKILL}, {"frozen", syscall.SIGSTOP}} {
		t.Run(c.tag, func(t *testing.T) {
			t.Parallel()
			e := newEnvOn(t, testdb.Fresh(t), nil)
			bad := startWorker(t, e, c.tag)
			e.publish(5)
			line, err := bad.stdout.ReadString('\n')
			require.NoError(t, err)
			require.Equal(t, "holding\n", line, "the worker holds the batch")

			healthy := startWorker(t, e, "p2")
			require.NoError(t, bad.cmd.Process.Signal(c.signal))
			e.drained(e.in, "g", 30*time.Second)
			require.NoError(t, healthy.stdin.Close())
			require.NoError(t, healthy.cmd.Wait())
			assert.Equal(t, 5, e.count(`SELECT count(*) FROM `+e.eff+` WHERE part = 'p2'`), "the healthy worker handled them all")
			assert.Equal(t, 5, e.count(`SELECT count(*) FROM `+e.eff), "once each")
		})
	}
}
