package migrations_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/internal/testdb"
	"github.com/pgsaga/pgsaga/migrations"
)

// Upgrading from the offset-log topics of earlier releases moves what each
// consumer group had not consumed yet into its queue, in order, and the old
// dead-letter topic into pgsaga_dead_letters; what was consumed stays
// behind; nothing in flight is lost.
func TestUpgradeMovesMessagesInFlight(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.Empty(t)
	require.NoError(t, migrations.ApplyTo(ctx, db.SQL, 7))
	exec := func(q string, args ...any) {
		t.Helper()
		_, err := db.SQL.ExecContext(ctx, q, args...)
		require.NoError(t, err)
	}
	// What watermill-sql v3 and the transport of earlier releases kept: a
	// topic with one lane read by two groups, a topic with two lanes, and the
	// dead-letter topic.
	exec(`INSERT INTO pgsaga_topic_lanes (topic, lanes) VALUES ('cmds', 1), ('events', 2), ('pgsaga_dead_letters', 1)`)
	for _, lane := range []string{"cmds", "events.0", "events.1", "pgsaga_dead_letters"} {
		exec(`CREATE TABLE "watermill_` + lane + `" ("offset" BIGSERIAL, uuid VARCHAR(36) NOT NULL, created_at TIMESTAMP NOT NULL DEFAULT CURRENT_TIMESTAMP,
			payload BYTEA, metadata JSON, transaction_id xid8 NOT NULL, PRIMARY KEY (transaction_id, "offset"))`)
		exec(`CREATE TABLE "watermill_offsets_` + lane + `" (consumer_group VARCHAR(255) NOT NULL, offset_acked BIGINT,
			last_processed_transaction_id xid8 NOT NULL, PRIMARY KEY (consumer_group))`)
	}
	for i, uuid := range []string{"c1", "c2", "c3", "c4"} {
		exec(`INSERT INTO "watermill_cmds" (uuid, payload, metadata, transaction_id) VALUES ($1, $2, '{"idempotency_key": "k"}', '100')`, uuid, []byte{byte(i)})
	}
	// "step" consumed c1 and c2; "audit" consumed nothing yet.
	exec(`INSERT INTO "watermill_offsets_cmds" VALUES ('step', 2, '100'), ('audit', 0, '0')`)
	exec(`INSERT INTO "watermill_events.0" (uuid, payload, metadata, transaction_id) VALUES ('e1', '\x01', '{}', '200'), ('e2', '\x02', '{"note": "\u0000"}', '201')`)
	exec(`INSERT INTO "watermill_offsets_events.0" VALUES ('projection', 1, '200')`)
	exec(`INSERT INTO "watermill_events.1" (uuid, payload, metadata, transaction_id) VALUES ('e3', '\x03', NULL, '300')`)
	exec(`INSERT INTO "watermill_offsets_events.1" VALUES ('projection', 0, '0')`)
	exec(`INSERT INTO "watermill_pgsaga_dead_letters" (uuid, payload, metadata, transaction_id) VALUES ('d1', 'x',
		'{"dead_letter_reason": "bad", "dead_letter_attempts": "3", "dead_letter_topic": "cmds", "dead_letter_handler": "step", "dead_letter_group": "step"}', '50')`)

	_, err := migrations.Apply(ctx, db.SQL)
	require.NoError(t, err)

	queued := func(group string) []string {
		rows, err := db.SQL.QueryContext(ctx, `SELECT topic || ':' || uuid FROM pgsaga_queue WHERE consumer_group = $1 ORDER BY id`, group)
		require.NoError(t, err)
		defer rows.Close()
		var out []string
		for rows.Next() {
			var s string
			require.NoError(t, rows.Scan(&s))
			out = append(out, s)
		}
		return out
	}
	assert.Equal(t, []string{"cmds:c3", "cmds:c4"}, queued("step"), "what step had not consumed, in order")
	assert.Equal(t, []string{"cmds:c1", "cmds:c2", "cmds:c3", "cmds:c4"}, queued("audit"))
	assert.Equal(t, []string{"events:e2", "events:e3"}, queued("projection"), "every lane of a laned topic")
	var payload []byte
	var md string
	require.NoError(t, db.SQL.QueryRowContext(ctx, `SELECT payload, metadata::text FROM pgsaga_queue WHERE uuid = 'c3' AND consumer_group = 'step'`).Scan(&payload, &md))
	assert.Equal(t, []byte{2}, payload, "payloads byte for byte")
	assert.JSONEq(t, `{"idempotency_key": "k"}`, md)
	require.NoError(t, db.SQL.QueryRowContext(ctx, `SELECT metadata::text FROM pgsaga_queue WHERE uuid = 'e2'`).Scan(&md))
	assert.JSONEq(t, `{"_pgsaga_unreadable_metadata": true}`, md, "metadata jsonb cannot hold is marked, not lost with its message")

	var subs int
	require.NoError(t, db.SQL.QueryRowContext(ctx, `SELECT count(*) FROM pgsaga_subscriptions WHERE (topic, consumer_group) IN (('cmds', 'step'), ('cmds', 'audit'), ('events', 'projection'))`).Scan(&subs))
	assert.Equal(t, 3, subs, "the groups are subscribed")

	var reason, topic, group string
	var attempts int
	require.NoError(t, db.SQL.QueryRowContext(ctx, `SELECT reason, attempts, topic, consumer_group FROM pgsaga_dead_letters WHERE uuid = 'd1'`).Scan(&reason, &attempts, &topic, &group))
	assert.Equal(t, []any{"bad", 3, "cmds", "step"}, []any{reason, attempts, topic, group})

	var lanes bool
	require.NoError(t, db.SQL.QueryRowContext(ctx, `SELECT to_regclass('pgsaga_topic_lanes') IS NOT NULL`).Scan(&lanes))
	assert.False(t, lanes, "the lane table is gone")
}
