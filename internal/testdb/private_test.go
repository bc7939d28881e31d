package testdb

import (
	"context"
	"net/url"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// A private server is its test's alone: another user of the machine who
// finds its port cannot log in, as postgres or anyone, without the random
// password kept in a file only the server's owner can read; and no
// connection is trusted, by TCP or by the server's socket. It used to
// trust every local connection (initdb -A trust): any local user could
// be its superuser while the tests ran, and run commands as the user the
// server runs as (COPY … TO PROGRAM).
func TestAPrivateServerTrustsNobody(t *testing.T) {
	s := StartPrivate(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()

	conn, err := pgx.Connect(ctx, s.URL)
	require.NoError(t, err, "its URL logs in")
	var method string
	require.NoError(t, conn.QueryRow(ctx, `SELECT coalesce(string_agg(DISTINCT auth_method, ','), '') FROM pg_hba_file_rules`).Scan(&method))
	assert.Equal(t, "scram-sha-256", method, "every rule asks for a password by SCRAM")
	require.NoError(t, conn.Close(ctx))

	u, err := url.Parse(s.URL)
	require.NoError(t, err)
	require.NotEmpty(t, u.User.String(), "the URL carries the password")
	pw, _ := u.User.Password()
	assert.Len(t, pw, 32, "a random password")
	for name, other := range map[string]string{
		"no password":      "postgres://postgres@" + u.Host + "/postgres?sslmode=disable",
		"a well-known one": "postgres://postgres:postgres@" + u.Host + "/postgres?sslmode=disable",
		"another role":     "postgres://nobody@" + u.Host + "/postgres?sslmode=disable",
		"by its socket":    "postgres:///postgres?host=" + url.QueryEscape(s.dir) + "&port=" + u.Port() + "&user=postgres",
	} {
		c, err := pgx.Connect(ctx, other)
		if err == nil {
			_ = c.Close(ctx)
		}
		assert.Error(t, err, "%s: refused", name)
	}

	st, err := os.Stat(filepath.Join(s.dir, privatePasswordFile))
	require.NoError(t, err)
	assert.Equal(t, os.FileMode(0o600), st.Mode().Perm(), "the password file is its owner's alone")
}
