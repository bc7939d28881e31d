package finddb

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"time"

	"github.com/pgsaga/pgsaga/internal/pgdb"
)

// The embedded server is its user's alone: its superuser's password is
// random, made when its data directory is, and kept in a file only the
// user can read (passwordFile, 0600, in the data directory, itself 0700);
// every connection, by TCP or socket, must give it by SCRAM (pg_hba.conf
// says scram-sha-256 throughout). A well-known password would let any
// other user of the machine log in as superuser while the server runs,
// and run commands as its user (COPY … TO PROGRAM).
//
// A password made for a data directory initdb has yet to create waits in
// pendingPasswordFile, beside it, and moves into the data directory once
// the server runs with it. Data of an earlier release (password
// "postgres") gets a random password the first time it is started.

const (
	passwordFile        = "pgsaga-superuser-password"
	pendingPasswordFile = "superuser-password.pending"
	// legacyPassword is the embedded server's password in earlier releases.
	legacyPassword = "postgres"
)

// ErrPasswordUnreadable is returned when the embedded server's password
// file exists but cannot be read: it is another user's server.
var ErrPasswordUnreadable = errors.New("the embedded PostgreSQL's password file cannot be read")

var hexPassword = regexp.MustCompile(`^[0-9a-f]{32}$`)

// readPassword reads a password file; ok is false if there is none.
func readPassword(path string) (pw string, ok bool, err error) {
	b, err := os.ReadFile(path)
	if os.IsNotExist(err) {
		return "", false, nil
	}
	if err != nil {
		return "", false, fmt.Errorf("%w (%s): %w", ErrPasswordUnreadable, path, err)
	}
	pw = strings.TrimSpace(string(b))
	if !hexPassword.MatchString(pw) {
		return "", false, fmt.Errorf("%w: %s does not hold a password of 32 hex digits; remove it and the data directory to start afresh", ErrPasswordUnreadable, path)
	}
	return pw, true, nil
}

// embeddedPassword is the password of the embedded server in dir:
// the data directory's, else a pending one (made by a run that did not get
// to move it), else a new pending one. settled says it was the data
// directory's; fresh that it was made now.
func embeddedPassword(dir string) (pw string, settled, fresh bool, err error) {
	if pw, ok, err := readPassword(filepath.Join(dir, "data", passwordFile)); err != nil || ok {
		return pw, ok, false, err
	}
	pending := filepath.Join(dir, pendingPasswordFile)
	if pw, ok, err := readPassword(pending); err != nil || ok {
		return pw, false, false, err
	}
	b := make([]byte, 16)
	if _, err := rand.Read(b); err != nil {
		return "", false, false, fmt.Errorf("finddb: making a password: %w", err)
	}
	pw = hex.EncodeToString(b)
	if err := writeFileSync(pending, pw+"\n"); err != nil {
		return "", false, false, err
	}
	return pw, false, true, nil
}

// settlePassword moves the pending password into the data directory.
func settlePassword(dir string) error {
	pending := filepath.Join(dir, pendingPasswordFile)
	final := filepath.Join(dir, "data", passwordFile)
	if err := os.Rename(pending, final); err != nil {
		return fmt.Errorf("finddb: moving %s to %s: %w", pending, final, err)
	}
	return nil
}

// writeFileSync writes a file only its owner can read, durably.
func writeFileSync(path, content string) error {
	f, err := os.OpenFile(path, os.O_CREATE|os.O_TRUNC|os.O_WRONLY, 0o600)
	if err != nil {
		return fmt.Errorf("finddb: writing %s: %w", path, err)
	}
	_, err = f.WriteString(content)
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return fmt.Errorf("finddb: writing %s: %w", path, err)
	}
	return nil
}

// hbaConf is the embedded server's pg_hba.conf: a password, by SCRAM,
// from everyone, by socket or TCP.
const hbaConf = `# Written by pgsaga: every connection gives the superuser's password
# (in ` + passwordFile + `) by SCRAM; no trust, no cleartext.
# TYPE  DATABASE        USER            ADDRESS                 METHOD
local   all             all                                     scram-sha-256
host    all             all             127.0.0.1/32            scram-sha-256
host    all             all             ::1/128                 scram-sha-256
local   replication     all                                     scram-sha-256
host    replication     all             127.0.0.1/32            scram-sha-256
host    replication     all             ::1/128                 scram-sha-256
`

// writeHBA writes hbaConf into dataDir unless it is there already, and
// makes dataDir its owner's alone; changed says it wrote it.
func writeHBA(dataDir string) (changed bool, err error) {
	if err := os.Chmod(dataDir, 0o700); err != nil {
		return false, fmt.Errorf("finddb: restricting %s: %w", dataDir, err)
	}
	path := filepath.Join(dataDir, "pg_hba.conf")
	if old, err := os.ReadFile(path); err == nil && string(old) == hbaConf {
		return false, nil
	}
	if err := writeFileSync(path, hbaConf); err != nil {
		return false, err
	}
	return true, nil
}

// embeddedURL connects to database db of the embedded server on port.
func embeddedURL(pw string, port uint32, db string) string {
	return fmt.Sprintf("postgres://postgres:%s@127.0.0.1:%d/%s?sslmode=disable", pw, port, db)
}

// secure makes the running embedded server on port, whose superuser's
// password is current, its user's alone: the superuser's password pw,
// stored as SCRAM, and pg_hba.conf as hbaConf, in effect before it returns.
func secure(ctx context.Context, port uint32, current, pw, dataDir string, timeout time.Duration) error {
	if !hexPassword.MatchString(pw) {
		return errors.New("finddb: refusing a password that is not 32 hex digits")
	}
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	conn, err := pgdb.Connect(ctx, embeddedURL(current, port, "postgres"))
	if err != nil {
		return fmt.Errorf("finddb: connecting to the embedded PostgreSQL: %w", err)
	}
	defer conn.Close(context.WithoutCancel(ctx))
	var scram bool
	if err := conn.QueryRow(ctx, `SELECT coalesce(rolpassword LIKE 'SCRAM-SHA-256$%', false) FROM pg_authid WHERE rolname = current_user`).Scan(&scram); err != nil {
		return fmt.Errorf("finddb: reading the superuser's password kind: %w", err)
	}
	if !scram || current != pw {
		// Hex digits only (checked above): nothing to quote. The
		// statement is not logged (log_statement is none by default).
		if _, err := conn.Exec(ctx, "SET password_encryption = 'scram-sha-256'; ALTER ROLE CURRENT_USER PASSWORD '"+pw+"'"); err != nil {
			return fmt.Errorf("finddb: setting the superuser's password: %w", err)
		}
	}
	changed, err := writeHBA(dataDir)
	if err != nil {
		return err
	}
	if changed {
		if _, err := conn.Exec(ctx, "SELECT pg_reload_conf()"); err != nil {
			return fmt.Errorf("finddb: reloading pg_hba.conf: %w", err)
		}
	}
	// The reload is asynchronous: wait until the server asks for SCRAM.
	scramURL := embeddedURL(pw, port, "postgres") + "&require_auth=scram-sha-256"
	for {
		c, err := pgdb.Connect(ctx, scramURL)
		if err == nil {
			return c.Close(ctx)
		}
		if ctx.Err() != nil {
			return fmt.Errorf("finddb: the embedded PostgreSQL does not ask for a SCRAM password after reloading pg_hba.conf: %w", err)
		}
		time.Sleep(20 * time.Millisecond) // the postmaster's reload, not work of ours
	}
}
