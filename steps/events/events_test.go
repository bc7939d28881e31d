package events_test

import (
	"context"
	"database/sql"
	"errors"
	"sync"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/internal/testdb"
	"github.com/pgsaga/pgsaga/internal/testpg"
	"github.com/pgsaga/pgsaga/saga/delivery"
	"github.com/pgsaga/pgsaga/steps/events"
)

func TestMain(m *testing.M) { testpg.Main(m) }

type opened struct {
	Owner string `json:"owner"`
}

func (opened) EventType() string { return "test.opened" }

type deposited struct {
	Cents int `json:"cents"`
}

func (deposited) EventType() string { return "test.deposited" }

type unregistered struct{}

func (unregistered) EventType() string { return "test.unregistered" }

// account folds the test events.
type account struct {
	owner   string
	balance int
	seen    []int
}

func (a *account) Apply(r events.Recorded) error {
	switch e := r.Data.(type) {
	case opened:
		a.owner = e.Owner
	case deposited:
		a.balance += e.Cents
	default:
		return errors.New("unexpected event")
	}
	a.seen = append(a.seen, r.Version)
	return nil
}

func newStore(t *testing.T) (*events.Store, *testdb.DB) {
	t.Helper()
	reg := events.NewRegistry()
	require.NoError(t, events.Register[opened](reg))
	require.NoError(t, events.Register[deposited](reg))
	s, err := events.NewStore(events.Config{Registry: reg})
	require.NoError(t, err)
	return s, testdb.Shared(t)
}

func inTx(t *testing.T, db *testdb.DB, fn func(tx *sql.Tx) error) error {
	t.Helper()
	tx, err := db.SQL.Begin()
	require.NoError(t, err)
	defer tx.Rollback() //nolint:errcheck
	if err := fn(tx); err != nil {
		return err
	}
	return tx.Commit()
}

func TestAppendLoadFold(t *testing.T) {
	t.Parallel()
	s, db := newStore(t)
	ctx := context.Background()
	stream := "acct-" + uuid.NewString()
	md := events.Metadata{CorrelationID: "c1", SagaID: "s1", IdempotencyKey: "k1"}
	require.NoError(t, inTx(t, db, func(tx *sql.Tx) error {
		recs, err := s.AppendTx(ctx, tx, stream, 0, md, opened{Owner: "ann"}, deposited{Cents: 500})
		if err == nil {
			assert.Equal(t, []int{1, 2}, []int{recs[0].Version, recs[1].Version})
			assert.Less(t, recs[0].Position, recs[1].Position)
		}
		return err
	}))
	require.NoError(t, inTx(t, db, func(tx *sql.Tx) error {
		_, err := s.AppendTx(ctx, tx, stream, 2, md, deposited{Cents: 250})
		return err
	}))

	var a account
	v, err := s.FoldTx(ctx, db.SQL, stream, 0, &a)
	require.NoError(t, err)
	assert.Equal(t, 3, v)
	assert.Equal(t, account{owner: "ann", balance: 750, seen: []int{1, 2, 3}}, a)

	var upTo2 account
	v, err = s.FoldTx(ctx, db.SQL, stream, 2, &upTo2)
	require.NoError(t, err)
	assert.Equal(t, 2, v)
	assert.Equal(t, 500, upTo2.balance)

	recs, err := s.LoadTx(ctx, db.SQL, stream, 0)
	require.NoError(t, err)
	require.Len(t, recs, 3)
	assert.Equal(t, md, recs[2].Metadata)
	assert.Equal(t, "test.deposited", recs[2].Type)

	var empty account
	v, err = s.FoldTx(ctx, db.SQL, "no-such-stream", 0, &empty)
	require.NoError(t, err)
	assert.Zero(t, v)
}

// A stale expected version appends nothing and does not abort the
// transaction; an expected version past the end cannot leave a gap.
func TestAppendConflicts(t *testing.T) {
	t.Parallel()
	s, db := newStore(t)
	ctx := context.Background()
	stream := "acct-" + uuid.NewString()
	require.NoError(t, inTx(t, db, func(tx *sql.Tx) error {
		_, err := s.AppendTx(ctx, tx, stream, 0, events.Metadata{}, opened{Owner: "a"})
		return err
	}))
	for _, expected := range []int{0, 5} {
		err := inTx(t, db, func(tx *sql.Tx) error {
			_, err := s.AppendTx(ctx, tx, stream, expected, events.Metadata{}, deposited{Cents: 1})
			require.ErrorIs(t, err, events.ErrVersionConflict, "expected %d", expected)
			var vce *events.VersionConflictError
			require.ErrorAs(t, err, &vce)
			assert.Equal(t, stream, vce.Stream)
			// The transaction is still usable.
			_, err = tx.Exec(`SELECT 1`)
			return err
		})
		require.NoError(t, err)
	}
	var n int
	require.NoError(t, db.SQL.QueryRow(`SELECT count(*) FROM domain_events WHERE stream_id = $1`, stream).Scan(&n))
	assert.Equal(t, 1, n)
}

// Many writers race on one stream, each retrying on conflict with fresh
// state: every write lands, versions are gapless.
func TestConcurrentWritersAreGapless(t *testing.T) {
	t.Parallel()
	s, db := newStore(t)
	ctx := context.Background()
	stream := "acct-" + uuid.NewString()
	const writers = 16
	var (
		wg        sync.WaitGroup
		conflicts sync.Map
	)
	for w := range writers {
		wg.Go(func() {
			for {
				err := inTx(t, db, func(tx *sql.Tx) error {
					var a account
					v, err := s.FoldTx(ctx, tx, stream, 0, &a)
					if err != nil {
						return err
					}
					_, err = s.AppendTx(ctx, tx, stream, v, events.Metadata{}, deposited{Cents: w})
					return err
				})
				if errors.Is(err, events.ErrVersionConflict) {
					conflicts.Store(w, true)
					continue
				}
				assert.NoError(t, err)
				return
			}
		})
	}
	wg.Wait()
	var a account
	v, err := s.FoldTx(ctx, db.SQL, stream, 0, &a)
	require.NoError(t, err)
	assert.Equal(t, writers, v)
	assert.Equal(t, writers*(writers-1)/2, a.balance, "every write landed once")
	for i, seen := range a.seen {
		assert.Equal(t, i+1, seen, "gapless")
	}
}

// AnyVersion appends after the stream's last event, whatever its version,
// reading it in the append's own statement: on a new stream from 1, on one
// with events after them, each recorded event with its own version.
func TestAppendAtAnyVersionGoesAfterTheLastEvent(t *testing.T) {
	t.Parallel()
	s, db := newStore(t)
	ctx := context.Background()
	stream := "acct-" + uuid.NewString()
	var recs []events.Recorded
	require.NoError(t, inTx(t, db, func(tx *sql.Tx) error {
		var err error
		recs, err = s.AppendTx(ctx, tx, stream, events.AnyVersion, events.Metadata{}, opened{Owner: "a"})
		return err
	}))
	require.Len(t, recs, 1)
	assert.Equal(t, 1, recs[0].Version)
	require.NoError(t, inTx(t, db, func(tx *sql.Tx) error {
		var err error
		recs, err = s.AppendTx(ctx, tx, stream, events.AnyVersion, events.Metadata{}, deposited{Cents: 5}, deposited{Cents: 7})
		return err
	}))
	require.Len(t, recs, 2)
	for i, want := range []int{5, 7} {
		assert.Equal(t, i+2, recs[i].Version)
		assert.Equal(t, deposited{Cents: want}, recs[i].Data, "recorded event %d is the one appended as version %d", i, recs[i].Version)
		assert.Equal(t, stream, recs[i].StreamID)
	}
	var a account
	v, err := s.FoldTx(ctx, db.SQL, stream, 0, &a)
	require.NoError(t, err)
	assert.Equal(t, 3, v)
	assert.Equal(t, "a", a.owner)
	assert.Equal(t, 12, a.balance)
}

// AnyVersion checks nothing against the caller's view of the stream, yet
// it never writes over or beside a racing append: a writer that appended
// after the statement's snapshot (committed while it waited) makes it
// append nothing and return ErrVersionConflict, with the transaction still
// usable. The race is forced: the second append is started while the
// first is uncommitted and waits for it on the stream's unique version.
func TestAppendAtAnyVersionConflictsWithARacingAppend(t *testing.T) {
	t.Parallel()
	s, _ := newStore(t)
	db := testdb.Fresh(t) // its own database: the wait is found by its locks
	ctx := context.Background()
	stream := "acct-" + uuid.NewString()

	second, err := db.SQL.BeginTx(ctx, nil)
	require.NoError(t, err)
	defer second.Rollback() //nolint:errcheck
	err = afterARacingAppend(t, s, db, stream, func() error {
		_, err := s.AppendTx(ctx, second, stream, events.AnyVersion, events.Metadata{}, opened{Owner: "second"})
		return err
	})
	require.ErrorIs(t, err, events.ErrVersionConflict)
	_, err = second.Exec(`SELECT 1`)
	require.NoError(t, err, "the transaction is still usable")
	require.NoError(t, second.Commit())

	var a account
	v, err := s.FoldTx(ctx, db.SQL, stream, 0, &a)
	require.NoError(t, err)
	assert.Equal(t, 1, v)
	assert.Equal(t, "first", a.owner)
}

// afterARacingAppend starts append while another transaction of db holds
// an uncommitted first event of stream, owned by "first", and commits
// that once append waits for it; it returns append's error.
func afterARacingAppend(t *testing.T, s *events.Store, db *testdb.DB, stream string, append func() error) error {
	t.Helper()
	ctx := context.Background()
	first, err := db.SQL.BeginTx(ctx, nil)
	require.NoError(t, err)
	defer first.Rollback() //nolint:errcheck // no-op after Commit
	_, err = s.AppendTx(ctx, first, stream, events.AnyVersion, events.Metadata{}, opened{Owner: "first"})
	require.NoError(t, err)
	done := make(chan error, 1)
	go func() { done <- append() }()
	db.WaitForLockWait(t)
	require.NoError(t, first.Commit())
	return <-done
}

func TestUnknownEventTypeIsAClearError(t *testing.T) {
	t.Parallel()
	s, db := newStore(t)
	ctx := context.Background()
	stream := "acct-" + uuid.NewString()
	require.NoError(t, inTx(t, db, func(tx *sql.Tx) error {
		_, err := s.AppendTx(ctx, tx, stream, 0, events.Metadata{}, unregistered{})
		return err
	}))
	_, err := s.LoadTx(ctx, db.SQL, stream, 0)
	require.ErrorIs(t, err, events.ErrUnknownEventType)
	assert.Contains(t, err.Error(), `"test.unregistered"`)
	assert.Contains(t, err.Error(), stream)
}

func TestRegistry(t *testing.T) {
	t.Parallel()
	reg := events.NewRegistry()
	require.NoError(t, events.Register[opened](reg))
	require.NoError(t, events.Register[opened](reg), "registering the same type twice is fine")
	ev, err := reg.Decode("test.opened", []byte(`{"owner":"zed"}`))
	require.NoError(t, err)
	assert.Equal(t, opened{Owner: "zed"}, ev)
	_, err = reg.Decode("test.opened", []byte(`{bad`))
	require.Error(t, err)
	require.Error(t, events.Register[*opened](reg), "pointer types are refused")
}

func TestInvalidAppends(t *testing.T) {
	t.Parallel()
	s, db := newStore(t)
	ctx := context.Background()
	_, err := s.AppendTx(ctx, db.SQL, "", 0, events.Metadata{}, opened{})
	require.ErrorIs(t, err, events.ErrInvalidAppend)
	_, err = s.AppendTx(ctx, db.SQL, "x", -2, events.Metadata{}, opened{})
	require.ErrorIs(t, err, events.ErrInvalidAppend)
	_, err = s.AppendTx(ctx, db.SQL, "x", 0, events.Metadata{}, nil)
	require.ErrorIs(t, err, events.ErrInvalidAppend)
	recs, err := s.AppendTx(ctx, db.SQL, "x", 0, events.Metadata{})
	require.NoError(t, err)
	assert.Empty(t, recs)
}

// Events of streams with a topic are published through the appending
// transaction, with their stream and version.
func TestAppendPublishesThroughTransaction(t *testing.T) {
	t.Parallel()
	s, pub := publishingStore(t, func(stream string) string { return "topic-of-" + stream[:4] })
	db := testdb.Shared(t)
	stream := "acct-" + uuid.NewString()
	var recs []events.Recorded
	require.NoError(t, inTx(t, db, func(tx *sql.Tx) error {
		var err error
		recs, err = s.AppendTx(context.Background(), tx, stream, 0, events.Metadata{SagaID: "s"}, opened{Owner: "o"})
		return err
	}))
	require.Len(t, pub.msgs, 1)
	m := pub.msgs[0]
	assert.Equal(t, "topic-of-acct", pub.topic)
	assert.Equal(t, recs[0].ID.String(), m.UUID)
	assert.Equal(t, stream, m.Metadata.Get(events.MetaStreamID))
	assert.Equal(t, "1", m.Metadata.Get(events.MetaVersion))
	assert.Equal(t, "test.opened", m.Metadata.Get("type"))
	assert.Equal(t, "s", m.Metadata.Get("saga_id"))
	assert.JSONEq(t, `{"owner":"o"}`, string(m.Payload))
}

// publishingStore is a Store that publishes to pub the events of the
// streams topic names a topic for.
func publishingStore(t *testing.T, topic func(stream string) string) (*events.Store, *recorder) {
	t.Helper()
	reg := events.NewRegistry()
	events.MustRegister[opened](reg)
	pub := &recorder{}
	s, err := events.NewStore(events.Config{
		Registry:  reg,
		Topic:     topic,
		Publisher: func(delivery.DBTX) message.Publisher { return pub },
	})
	require.NoError(t, err)
	return s, pub
}

type recorder struct {
	topic string
	msgs  []*message.Message
}

func (r *recorder) Publish(topic string, msgs ...*message.Message) error {
	r.topic = topic
	r.msgs = append(r.msgs, msgs...)
	return nil
}

func (r *recorder) Close() error { return nil }
