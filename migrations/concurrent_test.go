package migrations_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/internal/testdb"
	"github.com/pgsaga/pgsaga/migrations"
)

// The index an upgrade builds on the queue does not hold its writes: while
// the build waits for a transaction that wrote to the queue (as a running
// system always has one), a publish goes through at once. (Migration 16
// built it in its transaction, and a publish waited behind it: 5.7 s on a
// queue of 2M rows.) The indexes end up valid.
func TestAnUpgradeBuildsItsIndexesWithoutHoldingWrites(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.Empty(t)
	require.NoError(t, migrations.ApplyTo(ctx, db.SQL, 15))

	holder, err := db.SQL.BeginTx(ctx, nil)
	require.NoError(t, err)
	defer holder.Rollback() //nolint:errcheck
	_, err = holder.Exec(`INSERT INTO pgsaga_queue (topic, consumer_group, uuid) VALUES ('t', 'g', 'held')`)
	require.NoError(t, err)

	done := make(chan error, 1)
	go func() {
		_, err := migrations.Apply(ctx, db.SQL)
		done <- err
	}()
	deadline := time.Now().Add(30 * time.Second)
	for {
		var waiting bool
		require.NoError(t, db.SQL.QueryRow(`SELECT EXISTS (SELECT FROM pg_stat_activity WHERE datname = current_database()
			AND query LIKE 'CREATE INDEX%pgsaga_queue_uuid_idx%' AND wait_event_type = 'Lock')`).Scan(&waiting))
		if waiting {
			break
		}
		select {
		case err := <-done:
			t.Fatalf("the upgrade ended before its index build waited for the open transaction: %v", err)
		default:
		}
		require.True(t, time.Now().Before(deadline), "the index build never waited for the open transaction")
		time.Sleep(10 * time.Millisecond)
	}

	conn, err := db.SQL.Conn(ctx)
	require.NoError(t, err)
	defer conn.Close()
	_, err = conn.ExecContext(ctx, `SET lock_timeout = '2s'`)
	require.NoError(t, err)
	_, err = conn.ExecContext(ctx, `INSERT INTO pgsaga_queue (topic, consumer_group, uuid) VALUES ('t', 'g', 'during')`)
	require.NoError(t, err, "a publish during the index build goes through")

	require.NoError(t, holder.Commit())
	require.NoError(t, <-done)
	var valid int
	require.NoError(t, db.SQL.QueryRow(`SELECT count(*) FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
		WHERE c.relname IN ('pgsaga_queue_uuid_idx', 'saga_requests_done_idx') AND i.indisvalid`).Scan(&valid))
	assert.Equal(t, 2, valid)
}
