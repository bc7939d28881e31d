package events_test

import (
	"context"
	"database/sql"
	"errors"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/internal/testdb"
	"github.com/pgsaga/pgsaga/saga/delivery"
	"github.com/pgsaga/pgsaga/steps/events"
)

// Inline projections get the event messages of an append in the appending
// transaction: what they write there sees the new events and commits with
// them. Without a Publisher nothing is published.
func TestProjectRunsInTheAppendingTransaction(t *testing.T) {
	t.Parallel()
	db := testdb.Shared(t)
	view := "view_" + uuid.NewString()[:8]
	_, err := db.SQL.Exec(`CREATE TABLE ` + view + ` (stream text PRIMARY KEY, version int NOT NULL)`)
	require.NoError(t, err)
	reg := events.NewRegistry()
	events.MustRegister[opened](reg)
	events.MustRegister[deposited](reg)
	var topics []string
	s, err := events.NewStore(events.Config{
		Registry: reg,
		Topic:    func(stream string) string { return "topic-of-" + stream[:4] },
		Project: func(ctx context.Context, tx delivery.DBTX, topic string, msgs []*message.Message) error {
			topics = append(topics, topic)
			for _, m := range msgs {
				// The events are visible to the projection's statements.
				var n int
				if err := tx.QueryRowContext(ctx, `SELECT count(*) FROM domain_events WHERE stream_id = $1`, m.Metadata.Get(events.MetaStreamID)).Scan(&n); err != nil {
					return err
				}
				if _, err := tx.ExecContext(ctx, `INSERT INTO `+view+` VALUES ($1, $2) ON CONFLICT (stream) DO UPDATE SET version = excluded.version`,
					m.Metadata.Get(events.MetaStreamID), n); err != nil {
					return err
				}
			}
			return nil
		},
	})
	require.NoError(t, err)
	stream := "acct-" + uuid.NewString()
	require.NoError(t, inTx(t, db, func(tx *sql.Tx) error {
		_, err := s.AppendTx(context.Background(), tx, stream, 0, events.Metadata{}, opened{Owner: "o"}, deposited{Cents: 5})
		return err
	}))
	var version int
	require.NoError(t, db.SQL.QueryRow(`SELECT version FROM `+view+` WHERE stream = $1`, stream).Scan(&version))
	assert.Equal(t, 2, version)
	assert.Equal(t, []string{"topic-of-acct"}, topics)

	// A rolled-back append takes the projection's writes with it.
	other := "acct-" + uuid.NewString()
	require.Error(t, inTx(t, db, func(tx *sql.Tx) error {
		if _, err := s.AppendTx(context.Background(), tx, other, 0, events.Metadata{}, opened{Owner: "o"}); err != nil {
			return err
		}
		return errors.New("the step failed after appending")
	}))
	var n int
	require.NoError(t, db.SQL.QueryRow(`SELECT count(*) FROM `+view+` WHERE stream = $1`, other).Scan(&n))
	assert.Zero(t, n)
}

// A projection's failure is the append's: the caller gets it and must roll
// back.
func TestProjectFailureFailsTheAppend(t *testing.T) {
	t.Parallel()
	db := testdb.Shared(t)
	reg := events.NewRegistry()
	events.MustRegister[opened](reg)
	boom := errors.New("view is broken")
	s, err := events.NewStore(events.Config{
		Registry: reg,
		Topic:    func(string) string { return "t" },
		Project:  func(context.Context, delivery.DBTX, string, []*message.Message) error { return boom },
	})
	require.NoError(t, err)
	stream := "acct-" + uuid.NewString()
	err = inTx(t, db, func(tx *sql.Tx) error {
		_, err := s.AppendTx(context.Background(), tx, stream, 0, events.Metadata{}, opened{Owner: "o"})
		return err
	})
	require.ErrorIs(t, err, boom)
	v, err := s.VersionTx(context.Background(), db.SQL, stream)
	require.NoError(t, err)
	assert.Zero(t, v)

	_, err = events.NewStore(events.Config{Registry: reg, Project: func(context.Context, delivery.DBTX, string, []*message.Message) error { return nil }})
	require.ErrorContains(t, err, "Topic")
}
