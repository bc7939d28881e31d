// Package testnats gives tests a NATS server with JetStream, with nothing
// installed: NATS_URL if set (its absence of an answer fails the test),
// else a server of the test's own, embedded in the test's process
// (github.com/nats-io/nats-server/v2) with its storage in the test's
// temporary directory and shut down when the test ends. Private gives a
// server the test can stop, kill and start again: a process of its own,
// the test binary itself in server mode (see init), so that a kill is a
// crash and no nats-server binary is needed.
package testnats

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// URL returns the URL of a NATS server with JetStream for the test: the
// one NATS_URL names, else one of the test's own (the same however often
// the test asks), started in this process.
func URL(t testing.TB) string {
	t.Helper()
	if url := os.Getenv("NATS_URL"); url != "" {
		if _, err := check(url); err != nil {
			t.Fatalf("no NATS server with JetStream answers at %s, which NATS_URL names (%v): start it or unset NATS_URL", url, err)
		}
		return url
	}
	owned.mu.Lock()
	defer owned.mu.Unlock()
	if url, ok := owned.url[t]; ok {
		return url
	}
	url := embedded(t)
	owned.url[t] = url
	t.Cleanup(func() {
		owned.mu.Lock()
		delete(owned.url, t)
		owned.mu.Unlock()
	})
	return url
}

// owned holds the URL of each running test's own server.
var owned = struct {
	mu  sync.Mutex
	url map[testing.TB]string
}{url: map[testing.TB]string{}}

// embedded starts a server in this process, on a port of its own, and
// shuts it down when the test ends.
func embedded(t testing.TB) string {
	t.Helper()
	s, err := server.NewServer(&server.Options{Host: "127.0.0.1", Port: server.RANDOM_PORT, JetStream: true,
		StoreDir: t.TempDir(), NoLog: true, NoSigs: true, ServerName: fmt.Sprintf("pgsaga-test-%d-embedded", os.Getpid())})
	if err != nil {
		t.Fatalf("testnats: an embedded NATS server: %v", err)
	}
	go s.Start()
	if !s.ReadyForConnections(30 * time.Second) {
		s.Shutdown()
		t.Fatal("testnats: the embedded NATS server did not start in 30s")
	}
	t.Cleanup(func() {
		s.Shutdown()
		s.WaitForShutdown()
	})
	return s.ClientURL()
}

// Connect connects to URL(t) and closes the connection when the test ends.
func Connect(t testing.TB) (*nats.Conn, jetstream.JetStream) {
	t.Helper()
	return ConnectTo(t, URL(t))
}

// ConnectTo connects to the NATS server at url and closes the connection
// when the test ends.
func ConnectTo(t testing.TB, url string) (*nats.Conn, jetstream.JetStream) {
	t.Helper()
	nc, err := nats.Connect(url, nats.Timeout(5*time.Second), nats.MaxReconnects(-1), nats.ReconnectWait(100*time.Millisecond))
	if err != nil {
		t.Fatalf("connecting to NATS: %v", err)
	}
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatalf("JetStream: %v", err)
	}
	return nc, js
}

func check(url string) (serverName string, _ error) {
	nc, err := nats.Connect(url, nats.Timeout(2*time.Second), nats.MaxReconnects(0))
	if err != nil {
		return "", err
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return "", err
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	if _, err := js.AccountInfo(ctx); err != nil {
		return "", fmt.Errorf("JetStream: %w", err)
	}
	return nc.ConnectedServerName(), nil
}

// Server is a NATS server with JetStream that a test started for itself,
// on a port and storage directory of its own, in a process of its own, so
// that it can stop, kill and restart it.
type Server struct {
	t    testing.TB
	port int
	dir  string
	name string // the server's, to tell it from another on its port
	cmd  *exec.Cmd
	done chan struct{}
}

// Private starts a NATS server of the test's own, stopped when the test
// ends: the test binary run again in server mode (serveEnv).
func Private(t testing.TB) *Server {
	t.Helper()
	// The port is free when asked for, and may be taken before the server
	// binds it (another test's server, say): then another one is tried.
	for attempt := 1; ; attempt++ {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatalf("testnats: finding a free port: %v", err)
		}
		port := l.Addr().(*net.TCPAddr).Port
		_ = l.Close()
		s := &Server{t: t, port: port, dir: t.TempDir(), name: fmt.Sprintf("pgsaga-test-%d-%d", os.Getpid(), port)}
		err = s.start()
		if errors.Is(err, errPortTaken) && attempt < 5 {
			t.Logf("testnats: %v; trying another port", err)
			continue
		}
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(s.Stop)
		return s
	}
}

// URL is the server's URL; it stays the same across restarts.
func (s *Server) URL() string { return fmt.Sprintf("nats://127.0.0.1:%d", s.port) }

// Start starts the server (again, after Stop or Kill, with the same port
// and storage) and waits until JetStream answers.
func (s *Server) Start() {
	s.t.Helper()
	if err := s.start(); err != nil {
		s.t.Fatal(err)
	}
}

// errPortTaken is start's error when another process holds the port.
var errPortTaken = errors.New("the port is taken")

func (s *Server) start() error {
	self, err := os.Executable()
	if err != nil {
		return fmt.Errorf("testnats: the test binary, to run a server with: %w", err)
	}
	spec, err := json.Marshal(serveSpec{Port: s.port, Name: s.name, Dir: s.dir})
	if err != nil {
		return err
	}
	s.cmd = exec.Command(self)
	s.cmd.Env = append(os.Environ(), serveEnv+"="+string(spec))
	dieWithParent(s.cmd)
	out := &strings.Builder{} // read once the server exited
	s.cmd.Stdout, s.cmd.Stderr = out, out
	if err := s.cmd.Start(); err != nil {
		return fmt.Errorf("testnats: starting a NATS server process: %w", err)
	}
	done := make(chan struct{})
	go func(cmd *exec.Cmd) { _ = cmd.Wait(); close(done) }(s.cmd)
	s.done = done
	deadline := time.Now().Add(30 * time.Second)
	for {
		name, err := check(s.URL())
		select {
		case <-done:
			if strings.Contains(out.String(), "address already in use") {
				return fmt.Errorf("testnats: a NATS server on port %d: %w", s.port, errPortTaken)
			}
			return fmt.Errorf("testnats: the NATS server process exited: %s", out.String())
		default:
		}
		if err == nil && name != s.name { // another's server answered there
			s.Kill()
			return fmt.Errorf("testnats: NATS server %s answers on port %d: %w", name, s.port, errPortTaken)
		}
		if err == nil {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("testnats: the NATS server on port %d does not answer: %w", s.port, err)
		}
		time.Sleep(50 * time.Millisecond) // a server starting, polled for
	}
}

// Stop shuts the server down cleanly (SIGTERM) and waits for it.
func (s *Server) Stop() { s.end(syscall.SIGTERM) }

// Kill kills the server (SIGKILL), as a crash would, and waits for it.
func (s *Server) Kill() { s.end(syscall.SIGKILL) }

func (s *Server) end(sig syscall.Signal) {
	if s.cmd == nil || s.cmd.Process == nil {
		return
	}
	select {
	case <-s.done:
	default:
		_ = s.cmd.Process.Signal(sig)
		select {
		case <-s.done:
		case <-time.After(30 * time.Second):
			_ = s.cmd.Process.Kill()
			<-s.done
		}
	}
	s.cmd = nil
}

// serveEnv, in a process's environment, makes the test binary a NATS
// server (Private's) instead of running its tests: its value is a
// serveSpec, in JSON.
const serveEnv = "PGSAGA_TESTNATS_SERVE"

// serveSpec is what a private server process serves.
type serveSpec struct {
	Port int
	Name string
	Dir  string
}

// init turns the process into a private server when serveEnv says so,
// before any test runs: it serves until SIGTERM (a clean shutdown) or
// SIGKILL, and exits.
func init() {
	if spec := os.Getenv(serveEnv); spec != "" {
		os.Exit(serve(spec))
	}
}

func serve(spec string) int {
	var sp serveSpec
	if err := json.Unmarshal([]byte(spec), &sp); err != nil {
		fmt.Fprintf(os.Stderr, "testnats: %s: %v\n", serveEnv, err)
		return 2
	}
	s, err := server.NewServer(&server.Options{Host: "127.0.0.1", Port: sp.Port, ServerName: sp.Name,
		JetStream: true, StoreDir: sp.Dir})
	if err != nil {
		fmt.Fprintf(os.Stderr, "testnats: %v\n", err)
		return 1
	}
	s.ConfigureLogger() // to stderr: start reads a taken port there
	go s.Start()        // SIGTERM shuts it down (the server's own handler)
	s.WaitForShutdown()
	return 0
}
