package testdb

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"net"
	"net/url"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgsaga/pgsaga/internal/flock"
	"github.com/pgsaga/pgsaga/internal/pgbin"
)

// PrivateEnv enables tests that need a PostgreSQL of their own.
const PrivateEnv = "PGSAGA_TEST_PRIVATE_PG"

// PrivateServer is a PostgreSQL of one test's own, started from the
// machine's server binaries, that the test may stop and start at will
// without disturbing the server the other tests share. It trusts no
// connection: its superuser's password is random, in a file of its
// directory that only its owner can read, and given by SCRAM.
type PrivateServer struct {
	// URL connects to its postgres database, as postgres, with the
	// password.
	URL string

	bin    string
	dir    string
	port   int
	cred   *syscall.Credential
	unlock func()   // releases the process's lock on dir
	env    []string // added to the server's environment
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
	s, err := startPrivate(bin, nil)
	if err != nil {
		t.Fatalf("testdb: %v", err)
	}
	t.Cleanup(s.remove)
	return s
}

// StartPrivateSkewed is StartPrivate with the server's clock off by skew
// from the machine's (ahead when positive), through libfaketime, for tests
// that a worker's clock plays no part in what pgsaga decides. It needs
// what StartPrivate does and libfaketime (Debian's faketime package;
// .ci/run installs it): without it the test fails, saying so.
func StartPrivateSkewed(t testing.TB, skew time.Duration) *PrivateServer {
	t.Helper()
	if os.Getenv(PrivateEnv) == "" {
		t.Skipf("needs a private PostgreSQL: set %s=1 where the PostgreSQL server binaries are installed", PrivateEnv)
	}
	lib := faketimeLib()
	if lib == "" {
		t.Fatalf("testdb: a server with a skewed clock needs libfaketime (apt-get install faketime); none found under /usr/lib")
	}
	bin := pgbin.Find()
	if bin == "" {
		t.Fatalf("testdb: %s is set but no PostgreSQL server binaries were found", PrivateEnv)
	}
	s, err := startPrivate(bin, []string{"LD_PRELOAD=" + lib, fmt.Sprintf("FAKETIME=%+ds", int(skew.Seconds()))})
	if err != nil {
		t.Fatalf("testdb: %v", err)
	}
	t.Cleanup(s.remove)
	return s
}

// faketimeLib is the path of libfaketime, or "".
func faketimeLib() string {
	found, _ := filepath.Glob("/usr/lib/*/faketime/libfaketime.so.1")
	if len(found) == 0 {
		found, _ = filepath.Glob("/usr/lib/faketime/libfaketime.so.1")
	}
	if len(found) == 0 {
		return ""
	}
	return found[0]
}

// privatePrefix names the directories of private servers, in the
// system's temporary directory.
const privatePrefix = "pgsaga-private-"

// startPrivate creates and starts a private server from the binaries in
// bin; remove stops it and deletes its data. The process holds a lock on
// the server's directory until it exits, so that a later start can tell a
// server whose process was killed (a test timeout) and remove it.
func startPrivate(bin string, env []string) (*PrivateServer, error) {
	removeOrphans()
	dir, err := os.MkdirTemp("", privatePrefix)
	if err != nil {
		return nil, err
	}
	port, err := freePort()
	if err != nil {
		_ = os.RemoveAll(dir)
		return nil, err
	}
	s := &PrivateServer{bin: bin, dir: dir, port: port, env: env}
	if s.unlock, err = flock.Lock(filepath.Join(dir, ownerLock)); err != nil {
		_ = os.RemoveAll(dir)
		return nil, err
	}
	if os.Geteuid() == 0 {
		nobody, err := user.Lookup("nobody")
		if err != nil {
			s.remove()
			return nil, fmt.Errorf("a private PostgreSQL cannot run as root and there is no user nobody: %w", err)
		}
		uid, _ := strconv.Atoi(nobody.Uid)
		gid, _ := strconv.Atoi(nobody.Gid)
		s.cred = &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid)}
		if err := os.Chown(dir, uid, gid); err != nil {
			s.remove()
			return nil, err
		}
	}
	// Its superuser's password is random, in a file only the server's
	// owner can read, and every connection must give it by SCRAM: no
	// other user of the machine can log in while the tests run.
	pwFile := filepath.Join(dir, privatePasswordFile)
	pw := make([]byte, 16)
	if _, err := rand.Read(pw); err != nil {
		s.remove()
		return nil, err
	}
	password := hex.EncodeToString(pw)
	if err := os.WriteFile(pwFile, []byte(password+"\n"), 0o600); err != nil {
		s.remove()
		return nil, err
	}
	if s.cred != nil {
		if err := os.Chown(pwFile, int(s.cred.Uid), int(s.cred.Gid)); err != nil {
			s.remove()
			return nil, err
		}
	}
	if err := s.run(filepath.Join(bin, "initdb"), "-D", s.data(), "-U", "postgres", "-A", "scram-sha-256", "--pwfile", pwFile, "--no-sync", "-E", "UTF8"); err != nil {
		s.remove()
		return nil, fmt.Errorf("initdb: %w", err)
	}
	s.URL = (&url.URL{Scheme: "postgres", User: url.UserPassword("postgres", password), Host: fmt.Sprintf("127.0.0.1:%d", s.port),
		Path: "/postgres", RawQuery: "sslmode=disable"}).String()
	if err := s.Start(); err != nil {
		s.remove()
		return nil, fmt.Errorf("starting a private PostgreSQL: %w", err)
	}
	return s, nil
}

// ownerLock is the file in a private server's directory that its process
// holds locked.
const ownerLock = "owner.lock"

// remove stops the server, as after a crash, and deletes its data.
func (s *PrivateServer) remove() {
	if isFile(filepath.Join(s.data(), "postmaster.pid")) {
		_ = s.pgctl("stop", "-m", "immediate", "-w")
	}
	_ = os.RemoveAll(s.dir)
	if s.unlock != nil {
		s.unlock()
	}
}

// removeOrphans removes the private servers whose processes have exited
// without removing them (killed at a test timeout, say).
func removeOrphans() {
	bin := pgbin.Find()
	dirs, _ := filepath.Glob(filepath.Join(os.TempDir(), privatePrefix+"*"))
	for _, dir := range dirs {
		if st, err := os.Stat(dir); err != nil || time.Since(st.ModTime()) < time.Minute {
			continue // just created: its process may not hold the lock yet
		}
		unlock, ok := flock.TryLock(filepath.Join(dir, ownerLock))
		if !ok {
			continue // its process is alive, or it is not ours to judge
		}
		(&PrivateServer{bin: bin, dir: dir, unlock: unlock}).remove()
	}
}

func isFile(path string) bool {
	st, err := os.Stat(path)
	return err == nil && st.Mode().IsRegular()
}

func (s *PrivateServer) data() string { return filepath.Join(s.dir, "data") }

// Start starts the server and waits until it accepts connections.
func (s *PrivateServer) Start() error {
	opts := fmt.Sprintf("-p %d -k %s -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=200", s.port, s.dir)
	if err := s.pgctl("start", "-w", "-t", "60", "-l", filepath.Join(s.dir, "server.log"), "-o", opts); err != nil {
		return err
	}
	deadline := time.Now().Add(30 * time.Second)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		conn, err := pgx.Connect(ctx, s.URL)
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
	if len(s.env) > 0 {
		cmd.Env = append(os.Environ(), s.env...)
	}
	if s.cred != nil {
		cmd.SysProcAttr = &syscall.SysProcAttr{Credential: s.cred}
	}
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("%s %v: %w\n%s", filepath.Base(name), args, err, out.String())
	}
	return nil
}

func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// privatePasswordFile holds a private server's superuser password, in its
// directory.
const privatePasswordFile = "superuser-password"
