// Package testnats finds a NATS server with JetStream for tests, the way
// internal/testdb finds PostgreSQL: NATS_URL, else 127.0.0.1:4222. With
// none reachable a test skips, saying so in one sentence, except under CI
// (CI set), where .ci/run starts one and its absence is a failure.
package testnats

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// DefaultURL is where tests look for NATS when NATS_URL is unset.
const DefaultURL = "nats://127.0.0.1:4222"

// URL returns the URL of a NATS server with JetStream enabled, or skips
// (fails under CI) when there is none.
func URL(t testing.TB) string {
	t.Helper()
	url := os.Getenv("NATS_URL")
	if url == "" {
		url = DefaultURL
	}
	if _, err := check(url); err != nil {
		msg := fmt.Sprintf("no NATS server with JetStream at %s (%v): start one with `nats-server -js` or set NATS_URL", url, err)
		if os.Getenv("CI") != "" {
			t.Fatal(msg + "; .ci/run starts one where nats-server is installed")
		}
		t.Skip(msg)
	}
	return url
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
// on a port and storage directory of its own, so that it can stop and
// restart it (never the machine's shared server).
type Server struct {
	t    testing.TB
	bin  string
	port int
	dir  string
	name string // the server's, to tell it from another on its port
	cmd  *exec.Cmd
	done chan struct{}
}

// Private starts a NATS server of the test's own from the nats-server
// binary (PATH, then /usr/sbin), stopped when the test ends. Without the
// binary the test skips, saying so (fails under CI).
func Private(t testing.TB) *Server {
	t.Helper()
	bin, err := exec.LookPath("nats-server")
	if err != nil {
		if _, serr := os.Stat("/usr/sbin/nats-server"); serr == nil {
			bin, err = "/usr/sbin/nats-server", nil
		}
	}
	if err != nil {
		msg := "no nats-server binary to start a private NATS server with (install the nats-server package)"
		if os.Getenv("CI") != "" {
			t.Fatal(msg)
		}
		t.Skip(msg)
	}
	// The port is free when asked for, and may be taken before the server
	// binds it (another test's server, say): then another one is tried.
	for attempt := 1; ; attempt++ {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatalf("testnats: finding a free port: %v", err)
		}
		port := l.Addr().(*net.TCPAddr).Port
		_ = l.Close()
		s := &Server{t: t, bin: bin, port: port, dir: t.TempDir(), name: fmt.Sprintf("pgsaga-test-%d-%d", os.Getpid(), port)}
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
	s.cmd = exec.Command(s.bin, "-a", "127.0.0.1", "-p", strconv.Itoa(s.port), "-n", s.name, "-js", "-sd", s.dir)
	out := &strings.Builder{} // read once the server exited
	s.cmd.Stdout, s.cmd.Stderr = out, out
	if err := s.cmd.Start(); err != nil {
		return fmt.Errorf("testnats: starting nats-server: %w", err)
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
				return fmt.Errorf("testnats: nats-server on port %d: %w", s.port, errPortTaken)
			}
			return fmt.Errorf("testnats: nats-server exited: %s", out.String())
		default:
		}
		if err == nil && name != s.name { // another's server answered there
			s.Kill()
			return fmt.Errorf("testnats: nats-server %s answers on port %d: %w", name, s.port, errPortTaken)
		}
		if err == nil {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("testnats: nats-server on port %d does not answer: %w", s.port, err)
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
