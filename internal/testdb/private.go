package testdb

import (
	"bytes"
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgsaga/pgsaga/internal/pgbin"
)

// PrivateEnv enables tests that need a PostgreSQL of their own.
const PrivateEnv = "PGSAGA_TEST_PRIVATE_PG"

// PrivateServer is a PostgreSQL of one test's own, started from the
// machine's server binaries, that the test may stop and start at will
// without disturbing the server the other tests share.
type PrivateServer struct {
	// URL connects to its postgres database.
	URL string

	t    testing.TB
	bin  string
	dir  string
	port int
	cred *syscall.Credential
}

// StartPrivate starts a private server. It needs PGSAGA_TEST_PRIVATE_PG=1
// and the PostgreSQL server binaries (pg_ctl, initdb); PostgreSQL refuses to
// run as root, so as root it runs the server as the user nobody. Without
// PGSAGA_TEST_PRIVATE_PG the test is skipped, saying how to run it.
func StartPrivate(t testing.TB) *PrivateServer {
	t.Helper()
	if os.Getenv(PrivateEnv) == "" {
		t.Skipf("needs a private PostgreSQL: set %s=1 where the PostgreSQL server binaries are installed (pg_ctl, initdb; as root, a user nobody must exist)", PrivateEnv)
	}
	bin := pgbin.Find()
	if bin == "" {
		t.Fatalf("testdb: %s is set but no PostgreSQL server binaries were found (pg_config --bindir, /usr/lib/postgresql/*/bin)", PrivateEnv)
	}
	dir, err := os.MkdirTemp("", "pgsaga-private-")
	if err != nil {
		t.Fatalf("testdb: %v", err)
	}
	s := &PrivateServer{t: t, bin: bin, dir: dir, port: freePort(t)}
	t.Cleanup(func() {
		_ = s.pgctl("stop", "-m", "immediate", "-w")
		_ = os.RemoveAll(dir)
	})
	if os.Geteuid() == 0 {
		nobody, err := user.Lookup("nobody")
		if err != nil {
			t.Fatalf("testdb: a private PostgreSQL cannot run as root and there is no user nobody: %v", err)
		}
		uid, _ := strconv.Atoi(nobody.Uid)
		gid, _ := strconv.Atoi(nobody.Gid)
		s.cred = &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid)}
		if err := os.Chown(dir, uid, gid); err != nil {
			t.Fatalf("testdb: %v", err)
		}
	}
	if err := s.run(filepath.Join(bin, "initdb"), "-D", s.data(), "-U", "postgres", "-A", "trust", "--no-sync", "-E", "UTF8"); err != nil {
		t.Fatalf("testdb: initdb: %v", err)
	}
	if err := s.Start(); err != nil {
		t.Fatalf("testdb: starting a private PostgreSQL: %v", err)
	}
	s.URL = fmt.Sprintf("postgres://postgres@127.0.0.1:%d/postgres?sslmode=disable", s.port)
	return s
}

func (s *PrivateServer) data() string { return filepath.Join(s.dir, "data") }

// Start starts the server and waits until it accepts connections.
func (s *PrivateServer) Start() error {
	opts := fmt.Sprintf("-p %d -k %s -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=200", s.port, s.dir)
	if err := s.pgctl("start", "-w", "-t", "60", "-l", filepath.Join(s.dir, "server.log"), "-o", opts); err != nil {
		return err
	}
	url := fmt.Sprintf("postgres://postgres@127.0.0.1:%d/postgres?sslmode=disable", s.port)
	deadline := time.Now().Add(30 * time.Second)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		conn, err := pgx.Connect(ctx, url)
		cancel()
		if err == nil {
			return conn.Close(context.Background())
		}
		if time.Now().After(deadline) {
			return err
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// Stop stops the server: mode "fast" (clients are disconnected, a clean
// shutdown) or "immediate" (as after a crash).
func (s *PrivateServer) Stop(mode string) error {
	return s.pgctl("stop", "-m", mode, "-w", "-t", "60")
}

func (s *PrivateServer) pgctl(args ...string) error {
	return s.run(filepath.Join(s.bin, "pg_ctl"), append([]string{"-D", s.data()}, args...)...)
}

func (s *PrivateServer) run(name string, args ...string) error {
	cmd := exec.Command(name, args...)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	cmd.Dir = s.dir
	if s.cred != nil {
		cmd.SysProcAttr = &syscall.SysProcAttr{Credential: s.cred}
	}
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("%s %v: %w\n%s", filepath.Base(name), args, err, out.String())
	}
	return nil
}

func freePort(t testing.TB) int {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatalf("testdb: %v", err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}
