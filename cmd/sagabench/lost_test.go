package main

import (
	"bytes"
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"os"
	"os/exec"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/internal/pgdb"
	"github.com/pgsaga/pgsaga/internal/testdb"
	"github.com/pgsaga/pgsaga/internal/testout"
)

// benchName is the benchmark database a run's output names.
var benchName = regexp.MustCompile(`pgsaga_bench_[0-9a-f]{8}`)

func databaseExists(t *testing.T, name string) bool {
	t.Helper()
	conn, err := pgx.Connect(context.Background(), testdb.ServerURL())
	require.NoError(t, err)
	defer conn.Close(context.Background())
	var exists bool
	require.NoError(t, conn.QueryRow(context.Background(), `SELECT EXISTS (SELECT FROM pg_database WHERE datname = $1)`, name).Scan(&exists))
	return exists
}

// The server restarts while an order is being placed: every session ends
// (FATAL 57P01), and for a while new ones are refused ("the database
// system is starting up"). The run rides it out, and drops its database.
// It used to end with exit 1 (the placement failed), and once left its
// database behind.
func TestServerRestartMidRun(t *testing.T) {
	args := strings.Fields("-sagas 200 -inflight 16 -consumers 1 -rate 0 -baseline 0 -idle 0 -timeout 2m")
	takeTurn(t, args)
	p := startProxy(t, testdb.Shared(t).URL)
	t.Setenv("DATABASE_URL", p.url)
	p.restartOn("orders.place:", 40) // in the first order's transaction
	var stdout, stderr testout.Buffer
	code := run(context.Background(), args, &stdout, &stderr)
	require.NoError(t, p.restartErr())
	name := benchName.FindString(stderr.String())
	require.NotEmpty(t, name, stderr.String())
	assert.False(t, databaseExists(t, name), "the benchmark database is dropped")
	require.Equal(t, exitOK, code, "stdout:\n%s\nstderr:\n%s", stdout.String(), testout.Tail(stderr.String(), 20))
	assert.Positive(t, p.refusedCount(), "the restart refused connections")
	lines := strings.Split(strings.TrimSpace(stdout.String()), "\n")
	var r result
	require.NoError(t, json.Unmarshal([]byte(lines[len(lines)-1]), &r))
	assert.True(t, r.OK)
	assert.Equal(t, 200, r.Completed+r.Compensated)
}

// The server restarts as the run drops its database at the end: the drop
// waits for it to come back.
func TestDropRidesOutARestart(t *testing.T) {
	args := strings.Fields("-sagas 5 -inflight 4 -consumers 1 -rate 0 -baseline 0 -idle 0 -timeout 2m")
	takeTurn(t, args)
	p := startProxy(t, testdb.Shared(t).URL)
	t.Setenv("DATABASE_URL", p.url)
	p.restartOn("DROP DATABASE", 3)
	var stdout, stderr testout.Buffer
	code := run(context.Background(), args, &stdout, &stderr)
	require.NoError(t, p.restartErr())
	assert.Equal(t, exitOK, code, "stdout:\n%s\nstderr:\n%s", stdout.String(), testout.Tail(stderr.String(), 20))
	name := benchName.FindString(stderr.String())
	require.NotEmpty(t, name, stderr.String())
	assert.False(t, databaseExists(t, name), "dropped once the server was back:\n%s", testout.Tail(stderr.String(), 5))
	assert.NotContains(t, stderr.String(), "could not drop")
}

// The connection is lost as the server creates the run's database, its
// answer with it (and database/sql sends CREATE DATABASE again): the run
// goes on with the database the server created, and drops it. It used to
// stop there ("already exists", exit 3) and leave the database behind.
func TestCreateRidesOutALostAnswer(t *testing.T) {
	args := strings.Fields("-sagas 5 -inflight 4 -consumers 1 -rate 0 -baseline 0 -idle 0 -timeout 2m")
	takeTurn(t, args)
	p := startProxy(t, testdb.Shared(t).URL)
	t.Setenv("DATABASE_URL", p.url)
	p.loseAnswerTo("CREATE DATABASE")
	var stdout, stderr testout.Buffer
	code := run(context.Background(), args, &stdout, &stderr)
	require.NoError(t, p.restartErr())
	assert.Equal(t, exitOK, code, "stderr:\n%s", stderr.String())
	name := benchName.FindString(stderr.String())
	require.NotEmpty(t, name, "the database is named:\n%s", stderr.String())
	assert.False(t, databaseExists(t, name), "dropped:\n%s", stderr.String())
}

// The database stops taking the run's connections mid-run (here its role
// may no longer log in: as for a server that stays down), so the run
// fails and cannot drop its database: it says so, with the command that
// drops it, and that command does once connections are taken again.
// The run waits out its -timeout for sagas that cannot end, so that is
// short: at 2m it held the server-wide turn, and every other package's
// tests at the gate, for two minutes.
func TestServerGoneMidRunSaysHowToDrop(t *testing.T) {
	args := strings.Fields("-sagas 100000 -inflight 16 -consumers 1 -rate 0 -baseline 0 -idle 0 -timeout 10s")
	takeTurn(t, args)
	url := testdb.Role(t, -1, "s3cr3t")
	cfg, err := pgx.ParseConfig(url)
	require.NoError(t, err)
	role := pgx.Identifier{cfg.User}.Sanitize()
	admin, err := pgx.Connect(context.Background(), testdb.ServerURL())
	require.NoError(t, err)
	defer admin.Close(context.Background())
	t.Setenv("DATABASE_URL", url)
	var stdout testout.Buffer
	stderr := &testout.DoOn{Want: "placed ", Do: func() {
		_, err := admin.Exec(context.Background(), `ALTER ROLE `+role+` NOLOGIN`)
		require.NoError(t, err)
		_, err = admin.Exec(context.Background(), `SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = $1`, cfg.User)
		require.NoError(t, err)
	}}
	code := run(context.Background(), args, &stdout, stderr)
	assert.Equal(t, exitFailed, code, "stdout:\n%s\nstderr:\n%s", stdout.String(), testout.Tail(stderr.String(), 20))
	name := benchName.FindString(stderr.String())
	require.NotEmpty(t, name, stderr.String())
	require.True(t, databaseExists(t, name), "the database cannot have been dropped")
	command := "go run ./cmd/sagabench -drop " + name + " (with DATABASE_URL as for this run)"
	assert.Regexp(t, `(?m)^sagabench: could not drop the benchmark database `+name+` \(.+\); drop it with: `+regexp.QuoteMeta(command)+`$`, stderr.String())

	// Connections are taken again: the command drops it.
	_, err = admin.Exec(context.Background(), `ALTER ROLE `+role+` LOGIN`)
	require.NoError(t, err)
	var out bytes.Buffer
	require.Equal(t, exitOK, run(context.Background(), []string{"-drop", name}, &out, &out), out.String())
	assert.Contains(t, out.String(), "dropped database "+name)
	assert.False(t, databaseExists(t, name), "dropped")
}

// -drop takes only benchmark databases.
func TestDropTakesOnlyBenchmarkDatabases(t *testing.T) {
	t.Parallel()
	for _, name := range []string{"pgsaga", "postgres", "pgsaga_bench_", "pgsaga_bench_0123456z", "pgsaga_bench_01234567x", "x pgsaga_bench_01234567"} {
		var stdout, stderr bytes.Buffer
		assert.Equal(t, exitUsage, run(context.Background(), []string{"-drop", name}, &stdout, &stderr), name)
		assert.Contains(t, stderr.String(), "-drop takes the benchmark's databases only", name)
	}
}

// panicEnv makes a copy of the test binary start a bench over the database
// it names (DATABASE_URL's server) whose goroutine then panics.
const panicEnv = "SAGABENCH_TEST_PANIC_DB"

// panicInGoroutine is that copy: a goroutine of the bench panics.
func panicInGoroutine(name string) {
	admin, err := pgdb.Open(context.Background(), pgdb.Config{MaxConns: 2})
	if err != nil {
		panic(err)
	}
	b := &bench{admin: admin, dbName: name, status: os.Stderr}
	go func() {
		defer b.dropOnPanic()
		panic("a bug in a goroutine of sagabench")
	}()
	select {}
}

// A panic in a goroutine of the benchmark's own ends the process, as any
// panic does, but drops its database first (one in run's own goroutine
// unwinds through close, which drops it).
func TestPanicInAGoroutineDropsTheDatabase(t *testing.T) {
	db := testdb.Shared(t)
	name := fmt.Sprintf("pgsaga_bench_%08x", rand.Uint32())
	_, err := db.SQL.Exec(`CREATE DATABASE ` + name)
	require.NoError(t, err)
	t.Cleanup(func() { _, _ = db.SQL.Exec(`DROP DATABASE IF EXISTS ` + name) })
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), panicEnv+"="+name, "DATABASE_URL="+db.URL)
	out, err := cmd.CombinedOutput()
	var exit *exec.ExitError
	require.ErrorAs(t, err, &exit, "%s", out)
	assert.Equal(t, 2, exit.ExitCode(), "a panic's exit status")
	assert.Contains(t, string(out), "a bug in a goroutine of sagabench")
	assert.False(t, databaseExists(t, name), "dropped before the process ended")
}

// proxy stands between the runs and the database server, and restarts
// it, or loses its answer, as far as the clients can tell.
type proxy struct {
	url    string
	ln     net.Listener
	target string

	mu      sync.Mutex
	conns   map[net.Conn]bool // true: a connection to the server
	refuse  int               // connections still to refuse
	refused int
	// on: a client sends this (then nil): lose the server's answer
	// (onLose), or restart the server, refusing onRefuse connections.
	on         []byte
	onLose     bool
	onRefuse   int
	restarted  error
	restarting bool
}

// startProxy starts a proxy to the server of url; its url names the same
// database through it.
func startProxy(t *testing.T, url string) *proxy {
	t.Helper()
	cfg, err := pgx.ParseConfig(url)
	require.NoError(t, err)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	p := &proxy{ln: ln, target: net.JoinHostPort(cfg.Host, itoa(cfg.Port)), conns: map[net.Conn]bool{}}
	addr := ln.Addr().(*net.TCPAddr)
	p.url = strings.Replace(url, net.JoinHostPort(cfg.Host, itoa(cfg.Port)), addr.String(), 1)
	require.NotEqual(t, url, p.url, "the proxy's url")
	go p.serve()
	t.Cleanup(func() {
		_ = ln.Close()
		p.mu.Lock()
		defer p.mu.Unlock()
		for c := range p.conns {
			_ = c.Close()
		}
	})
	return p
}

func itoa(port uint16) string { return strconv.Itoa(int(port)) }

func (p *proxy) serve() {
	for {
		c, err := p.ln.Accept()
		if err != nil {
			return
		}
		p.mu.Lock()
		refuse := p.refuse > 0
		if refuse {
			p.refuse--
			p.refused++
		}
		p.mu.Unlock()
		if refuse {
			go startingUp(c)
			continue
		}
		go p.forward(c)
	}
}

// startingUp answers a connection as a server that is starting up does.
func startingUp(c net.Conn) {
	defer c.Close()
	var n uint32
	if binary.Read(c, binary.BigEndian, &n) != nil || n < 4 {
		return
	}
	if _, err := io.CopyN(io.Discard, c, int64(n)-4); err != nil {
		return
	}
	var body []byte
	for _, f := range []string{"SFATAL", "VFATAL", "C57P03", "Mthe database system is starting up"} {
		body = append(append(body, f...), 0)
	}
	body = append(body, 0)
	msg := append([]byte{'E'}, binary.BigEndian.AppendUint32(nil, uint32(len(body)+4))...)
	_, _ = c.Write(append(msg, body...))
}

func (p *proxy) forward(c net.Conn) {
	s, err := net.Dial("tcp", p.target)
	if err != nil {
		_ = c.Close()
		return
	}
	p.mu.Lock()
	p.conns[c], p.conns[s] = false, true // true: to the server
	p.mu.Unlock()
	done := make(chan struct{}, 2)
	var lose atomic.Bool
	go func() { // to the server, watching for the cue
		buf := make([]byte, 64<<10)
		for {
			n, err := c.Read(buf)
			if n > 0 {
				if p.cue(buf[:n]) {
					lose.Store(true)
				}
				if _, werr := s.Write(buf[:n]); werr != nil {
					break
				}
			}
			if err != nil {
				break
			}
		}
		done <- struct{}{}
	}()
	go func() { // to the client, unless the answer is to be lost
		buf := make([]byte, 64<<10)
		for {
			n, err := s.Read(buf)
			if n > 0 {
				if lose.Load() {
					break
				}
				if _, werr := c.Write(buf[:n]); werr != nil {
					break
				}
			}
			if err != nil {
				break
			}
		}
		done <- struct{}{}
	}()
	<-done
	_ = c.Close()
	_ = s.Close()
	p.mu.Lock()
	delete(p.conns, c)
	delete(p.conns, s)
	p.mu.Unlock()
}

// restartOn arms a restart: once a client sends cue, every session ends,
// as a server shutting down ends them (FATAL 57P01), before the server
// gets what the client sent; then the next n connections are refused.
func (p *proxy) restartOn(cue string, n int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.on, p.onLose, p.onRefuse = []byte(cue), false, n
}

// loseAnswerTo arms a lost answer: once a client sends cue, the server gets
// it and carries it out, and the connection ends with its answer.
func (p *proxy) loseAnswerTo(cue string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.on, p.onLose = []byte(cue), true
}

// cue acts on b if it holds the armed cue: it restarts the server before
// returning, or reports that the answer to b is to be lost.
func (p *proxy) cue(b []byte) (loseAnswer bool) {
	p.mu.Lock()
	if p.on == nil || !bytes.Contains(b, p.on) {
		p.mu.Unlock()
		return false
	}
	if p.onLose {
		p.on = nil
		p.mu.Unlock()
		return true
	}
	p.on, p.refuse, p.restarting = nil, p.onRefuse, true
	var ports []int
	for c, server := range p.conns {
		if server {
			ports = append(ports, c.LocalAddr().(*net.TCPAddr).Port)
		}
	}
	p.mu.Unlock()
	err := terminatePorts(ports)
	p.mu.Lock()
	p.restarted, p.restarting = err, false
	p.mu.Unlock()
	return false
}

// terminatePorts ends the sessions of the connections from ports, and
// waits until they are gone.
func terminatePorts(ports []int) error {
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, testdb.ServerURL())
	if err != nil {
		return err
	}
	defer conn.Close(ctx)
	const sessions = `FROM pg_stat_activity WHERE client_addr = '127.0.0.1' AND client_port = ANY ($1)`
	if _, err := conn.Exec(ctx, `SELECT pg_terminate_backend(pid) `+sessions, ports); err != nil {
		return err
	}
	for {
		var left int
		if err := conn.QueryRow(ctx, `SELECT count(*) `+sessions, ports).Scan(&left); err != nil || left == 0 {
			return err
		}
	}
}

// restartErr says whether the armed cue came, and a restart worked, once
// it is over.
func (p *proxy) restartErr() error {
	deadline := time.Now().Add(30 * time.Second)
	for {
		p.mu.Lock()
		on, restarting, err := p.on, p.restarting, p.restarted
		p.mu.Unlock()
		switch {
		case on != nil:
			return errors.New("the cue never came")
		case !restarting:
			return err
		case time.Now().After(deadline):
			return errors.New("still restarting after 30s")
		}
		time.Sleep(10 * time.Millisecond) // the proxy's goroutine ends the sessions
	}
}

func (p *proxy) refusedCount() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.refused
}
