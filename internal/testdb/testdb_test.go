package testdb

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"testing/fstest"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/pgsaga/pgsaga/internal/finddb"
	"github.com/pgsaga/pgsaga/internal/flock"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestMain(m *testing.M) { MainWith(m, Setup{Fallback: finddb.TestServer}) }

// Another checkout with other migrations may be testing on the same server:
// its fresh template survives this one's build; a template older than
// staleAfter, or a half-built one, does not.
func TestOtherCheckoutsTemplateSurvives(t *testing.T) {
	ctx := context.Background()
	admin, err := pgx.Connect(ctx, ServerURL())
	require.NoError(t, err)
	defer admin.Close(ctx)
	tag := randomHex(6)
	fresh := fmt.Sprintf("%sother%s_%d", templatePrefix, tag, time.Now().Unix())
	stale := fmt.Sprintf("%sold%s_%d", templatePrefix, tag, time.Now().Add(-staleAfter-time.Minute).Unix())
	for _, n := range []string{fresh, stale} {
		_, err := admin.Exec(ctx, "CREATE DATABASE "+pgx.Identifier{n}.Sanitize())
		require.NoError(t, err)
		t.Cleanup(func() { _ = dropDatabase(context.Background(), ServerURL(), n) })
	}
	name, err := ensureTemplate(ctx, admin)
	require.NoError(t, err)
	hash, err := migrationsHash(schemas)
	require.NoError(t, err)
	h, _, ok := parseTemplateName(name)
	require.True(t, ok, name)
	assert.Equal(t, hash, h)
	exists := func(n string) bool {
		var e bool
		require.NoError(t, admin.QueryRow(ctx, "SELECT EXISTS (SELECT FROM pg_database WHERE datname = $1)", n).Scan(&e))
		return e
	}
	assert.True(t, exists(fresh), "another checkout's fresh template is kept")
	assert.False(t, exists(stale), "a stale template is dropped")
}

// A template that disappeared under this process (another checkout dropped
// it as stale) is found or built again instead of failing every later
// database.
func TestVanishedTemplateIsFoundAgain(t *testing.T) {
	Fresh(t) // the template is known
	tplMu.Lock()
	template = templatePrefix + "0000000000000000_1" // as if dropped by someone else
	tplMu.Unlock()
	db := Fresh(t)
	var n int
	require.NoError(t, db.SQL.QueryRow(`SELECT count(*) FROM pgsaga_queue`).Scan(&n), "a migrated database")
	tplMu.Lock()
	defer tplMu.Unlock()
	h, _, ok := parseTemplateName(template)
	require.True(t, ok)
	hash, err := migrationsHash(schemas)
	require.NoError(t, err)
	assert.Equal(t, hash, h)
}

// The tests' own connections wait for a slot on a full server instead of
// failing the test: sagabench's runs take most of the shared server's
// connections for a while, and other packages' tests failed in
// Fresh with "sorry, too many clients already". A role's connection limit
// makes the same error (too_many_connections) on demand.
func TestConnectionsWaitForAFreeSlot(t *testing.T) {
	ctx := context.Background()
	url := LimitedRole(t, 1)
	holder, err := pgx.Connect(ctx, url) // the role's one connection
	require.NoError(t, err)
	defer holder.Close(ctx)
	attempts := 0
	conn, err := whenFree(func() (*pgx.Conn, error) {
		attempts++
		c, err := pgx.Connect(ctx, url)
		if attempts == 1 {
			require.Error(t, err, "the role's slot is taken")
			require.NoError(t, holder.Close(ctx)) // freed once the first attempt found none
		}
		return c, err
	})
	require.NoError(t, err)
	defer conn.Close(ctx)
	assert.Greater(t, attempts, 1)
}

// A private server whose process exited without removing it (killed at a
// test timeout) is removed by the next start; one whose process holds its
// lock, or that was just created, is left alone.
func TestOrphanedPrivateServersAreRemoved(t *testing.T) {
	dirAged := func(age time.Duration, held bool) string {
		dir, err := os.MkdirTemp("", privatePrefix)
		require.NoError(t, err)
		t.Cleanup(func() { _ = os.RemoveAll(dir) })
		unlock, err := flock.Lock(filepath.Join(dir, ownerLock))
		require.NoError(t, err)
		if held {
			t.Cleanup(unlock)
		} else {
			unlock()
		}
		old := time.Now().Add(-age)
		require.NoError(t, os.Chtimes(dir, old, old))
		return dir
	}
	orphan := dirAged(time.Hour, false)
	alive := dirAged(time.Hour, true)
	fresh := dirAged(0, false)
	removeOrphans()
	assert.NoDirExists(t, orphan)
	assert.DirExists(t, alive)
	assert.DirExists(t, fresh)
}

// A template is named after every file of every schema, at any depth: a
// change to a migration in a subdirectory builds a new one.
func TestTemplateNameCoversEverySchemaFile(t *testing.T) {
	t.Parallel()
	schema := func(sql string) []Schema {
		return []Schema{{Files: fstest.MapFS{"migrations/00001_app.sql": {Data: []byte(sql)}}, Migrate: nil}}
	}
	a, err := migrationsHash(schema("CREATE TABLE a (x int)"))
	require.NoError(t, err)
	b, err := migrationsHash(schema("CREATE TABLE b (x int)"))
	require.NoError(t, err)
	none, err := migrationsHash(nil)
	require.NoError(t, err)
	assert.NotEqual(t, a, b, "a changed migration names another template")
	assert.NotEqual(t, a, none, "a schema names another template than none")
}
