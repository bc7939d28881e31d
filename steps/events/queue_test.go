package events_test

import (
	"context"
	"errors"
	"testing"

	"github.com/google/uuid"
	"github.com/jackc/pgerrcode"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/internal/testdb"
	"github.com/pgsaga/pgsaga/saga/delivery"
	"github.com/pgsaga/pgsaga/steps"
	"github.com/pgsaga/pgsaga/steps/events"
)

// A queued append costs no round trip of its own: on a pgx pool, BEGIN,
// two appends and COMMIT go in one. The events land after the stream's
// head, in order, under the ids it returned.
func TestQueueAppendGoesWithTheCommit(t *testing.T) {
	t.Parallel()
	s, shared := newStore(t)
	db, trips := testdb.RoundTrips(t, shared)
	ctx := context.Background()
	stream := "acct-" + uuid.NewString()
	require.NoError(t, steps.InTx(ctx, db.SQL, func(tx delivery.DBTX) error {
		_, err := s.QueueAppendTx(ctx, tx, stream, events.Metadata{}, opened{Owner: "a"}) // prepares its statement: a round trip of its own
		return err
	}))
	var ids []uuid.UUID
	trips.Store(0)
	require.NoError(t, steps.InTx(ctx, db.SQL, func(tx delivery.DBTX) error {
		first, err := s.QueueAppendTx(ctx, tx, stream, events.Metadata{CorrelationID: "c"}, deposited{Cents: 5}, deposited{Cents: 7})
		if err != nil {
			return err
		}
		second, err := s.QueueAppendTx(ctx, tx, stream, events.Metadata{}, deposited{Cents: 11})
		ids = append(first, second...)
		return err
	}))
	assert.EqualValues(t, 1, trips.Load(), "round trips of a transaction of two queued appends")

	recs, err := s.LoadTx(ctx, db.SQL, stream, 0)
	require.NoError(t, err)
	require.Len(t, recs, 4)
	for i, want := range []int{5, 7, 11} {
		r := recs[i+1]
		assert.Equal(t, i+2, r.Version)
		assert.Equal(t, ids[i], r.ID, "the id QueueAppendTx returned for version %d", r.Version)
		assert.Equal(t, deposited{Cents: want}, r.Data)
	}
	assert.Equal(t, "c", recs[1].Metadata.CorrelationID)
}

// A queued append is never read back, so it must not come back short: a
// writer that appended past its snapshot (committed while it waited)
// makes it fail with a unique violation, where AppendTx at AnyVersion
// skips the taken versions and says so. The race is forced as in
// TestAppendAtAnyVersionConflictsWithARacingAppend.
func TestQueueAppendFailsOnARacingAppend(t *testing.T) {
	t.Parallel()
	s, _ := newStore(t)
	db := testdb.Fresh(t) // its own database: the wait is found by its locks
	ctx := context.Background()
	stream := "acct-" + uuid.NewString()

	err := afterARacingAppend(t, s, db, stream, func() error {
		return steps.InTx(ctx, db.SQL, func(tx delivery.DBTX) error {
			_, err := s.QueueAppendTx(ctx, tx, stream, events.Metadata{}, opened{Owner: "second"})
			return err
		})
	})
	var pgErr *pgconn.PgError
	require.True(t, errors.As(err, &pgErr), "the racing queued append fails: %v", err)
	assert.Equal(t, pgerrcode.UniqueViolation, pgErr.Code)

	recs, err := s.LoadTx(ctx, db.SQL, stream, 0)
	require.NoError(t, err)
	require.Len(t, recs, 1)
	assert.Equal(t, opened{Owner: "first"}, recs[0].Data)
}

// The events of a stream with projections or a publisher are appended at
// once, as AppendTx appends them, for those to see their versions; a
// stream the Topic names no topic for is queued.
func TestQueueAppendOfAPublishedStreamPublishes(t *testing.T) {
	t.Parallel()
	s, pub := publishingStore(t, func(stream string) string {
		if stream[:4] == "acct" {
			return "accounts"
		}
		return ""
	})
	db := testdb.Shared(t)
	ctx := context.Background()
	stream := "acct-" + uuid.NewString()
	var ids []uuid.UUID
	var err error
	require.NoError(t, steps.InTx(ctx, db.SQL, func(tx delivery.DBTX) error {
		ids, err = s.QueueAppendTx(ctx, tx, stream, events.Metadata{}, opened{Owner: "o"})
		return err
	}))
	require.Len(t, pub.msgs, 1)
	assert.Equal(t, ids[0].String(), pub.msgs[0].UUID)
	assert.Equal(t, "1", pub.msgs[0].Metadata.Get(events.MetaVersion))

	other := "user-" + uuid.NewString()
	require.NoError(t, steps.InTx(ctx, db.SQL, func(tx delivery.DBTX) error {
		_, err = s.QueueAppendTx(ctx, tx, other, events.Metadata{}, opened{Owner: "o"})
		return err
	}))
	assert.Len(t, pub.msgs, 1, "a stream without a topic is not published")
	recs, err := s.LoadTx(ctx, db.SQL, other, 0)
	require.NoError(t, err)
	assert.Len(t, recs, 1)
}
