package saga_test

import (
	"context"
	"errors"
	"net/url"
	"strings"
	"testing"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/internal/testdb"
	"github.com/pgsaga/pgsaga/internal/transport"
	"github.com/pgsaga/pgsaga/saga"
	"github.com/pgsaga/pgsaga/saga/delivery"
)

// A worker whose role lacks TEMPORARY on the database (every delivery
// connection's commit guard is a temporary table) or a privilege on a
// table refuses to start, saying which; one that loses a privilege while
// it runs is reported by Health. (It used to start, report healthy and
// deliver nothing.)
func TestAWorkerWithoutThePrivilegesItNeedsRefusesToStart(t *testing.T) {
	t.Parallel()
	_, def, db := newSignupClient(t) // migrates the database
	role := "worker_" + strings.ReplaceAll(uuid.NewString()[:8], "-", "")
	dbName := db.Name
	for _, q := range []string{
		`CREATE ROLE ` + role + ` LOGIN PASSWORD 'pw-` + role + `'`,
		`GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA public TO ` + role,
		`REVOKE TEMPORARY ON DATABASE "` + dbName + `" FROM PUBLIC`,
		`REVOKE DELETE ON pgsaga_queue FROM ` + role,
	} {
		_, err := db.SQL.Exec(q)
		require.NoError(t, err, q)
	}
	t.Cleanup(func() {
		for _, q := range []string{`REVOKE ALL ON ALL TABLES IN SCHEMA public FROM ` + role,
			`REVOKE ALL ON DATABASE "` + dbName + `" FROM ` + role, `DROP ROLE ` + role} {
			_, _ = db.SQL.Exec(q)
		}
	})
	u, err := url.Parse(db.URL)
	require.NoError(t, err)
	u.User = url.UserPassword(role, "pw-"+role)
	pool, err := pgxpool.New(context.Background(), u.String())
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	newClient := func() *saga.Client {
		c, err := saga.NewClient(pool, saga.ClientConfig{Transport: transport.Config{IdlePollInterval: testdb.NoSafetyPoll}, Logger: logger()})
		require.NoError(t, err)
		require.NoError(t, c.Register(def))
		return c
	}

	err = newClient().Start(context.Background())
	require.ErrorIs(t, err, delivery.ErrMissingPrivileges)
	var pe *transport.PrivilegeError
	require.True(t, errors.As(err, &pe))
	assert.Equal(t, role, pe.Role)
	assert.Equal(t, []string{"TEMPORARY on database " + dbName, "DELETE on pgsaga_queue"}, pe.Missing)

	for _, q := range []string{`GRANT TEMPORARY ON DATABASE "` + dbName + `" TO ` + role, `GRANT DELETE ON pgsaga_queue TO ` + role} {
		_, err := db.SQL.Exec(q)
		require.NoError(t, err, q)
	}
	c := newClient()
	startRunning(t, c)
	require.NoError(t, c.Health(context.Background()))
	_, err = db.SQL.Exec(`REVOKE UPDATE ON saga_instances FROM ` + role)
	require.NoError(t, err)
	err = c.Health(context.Background())
	require.ErrorIs(t, err, delivery.ErrMissingPrivileges)
	assert.Contains(t, err.Error(), "UPDATE on saga_instances")
}
