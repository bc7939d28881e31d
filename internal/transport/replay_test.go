package transport_test

import (
	"context"
	"errors"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/internal/transport"
)

// A dead letter replayed goes back to the queue of the group that gave up
// on it, once, with its metadata as published (plus where it came from),
// and is handled like any message; the dead letter keeps the record.
func TestReplayDeadLetterOnce(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	var fixed atomic.Bool
	var got atomic.Pointer[message.Message]
	e.route(t, func(msg *message.Message) error {
		if !fixed.Load() {
			return transport.Permanent(errors.New("a bug, fixed later"))
		}
		got.Store(msg)
		return effect(msg, e.eff, "done")
	})
	m := message.NewMessage("replay-"+e.id, []byte(`{"x":1}`))
	m.Metadata.Set("mine", "kept")
	require.NoError(t, e.tr.Publisher(e.db.SQL).Publish(e.in, m))
	e.drained(e.in, "g", 10*time.Second)
	dl := e.deadLetters(e.in)
	require.Len(t, dl, 1)
	assert.Nil(t, dl[0].ReplayedAt)

	fixed.Store(true)
	ctx := context.Background()
	require.NoError(t, e.tr.Subscribe(ctx, transport.Subscription{Topic: e.in, ConsumerGroup: "other"}))
	n, err := e.tr.ReplayDeadLetter(ctx, dl[0].ID)
	require.NoError(t, err)
	assert.Equal(t, 1, n, "queued for the group that gave up on it")
	assert.Zero(t, e.waiting(e.in, "other"), "not for the topic's other groups, which handled it")
	waitFor(t, 10*time.Second, "the replay handled", func() bool {
		return e.count(`SELECT count(*) FROM `+e.eff+` WHERE msg = $1`, m.UUID) == 1
	})
	require.NotNil(t, got.Load())
	assert.Equal(t, "kept", got.Load().Metadata.Get("mine"))
	assert.Empty(t, got.Load().Metadata.Get(transport.DeadLetterReason), "the dead letter's own entries are not carried back")
	assert.Equal(t, strconv.FormatInt(dl[0].ID, 10), got.Load().Metadata.Get(transport.ReplayedDeadLetter))

	_, err = e.tr.ReplayDeadLetter(ctx, dl[0].ID)
	assert.ErrorIs(t, err, transport.ErrAlreadyReplayed)
	dl = e.deadLetters(e.in)
	require.Len(t, dl, 1, "the dead letter stays, as a record")
	assert.NotNil(t, dl[0].ReplayedAt)
	_, err = e.tr.ReplayDeadLetter(ctx, -5)
	assert.ErrorIs(t, err, transport.ErrNoSuchDeadLetter)
}

// A message that no group read when it was published is replayed to the
// groups that read its topic now; with none still, nothing happens and the
// dead letter stays replayable.
func TestReplayUnroutedDeadLetter(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	topic := "unrouted_" + e.id
	require.NoError(t, e.tr.Publisher(e.db.SQL).Publish(topic, message.NewMessage("u-"+e.id, []byte(`{}`))))
	dl := e.deadLetters(topic)
	require.Len(t, dl, 1)
	ctx := context.Background()
	_, err := e.tr.ReplayDeadLetter(ctx, dl[0].ID)
	require.ErrorIs(t, err, transport.ErrTopicNotSubscribed)
	assert.Nil(t, e.deadLetters(topic)[0].ReplayedAt, "still replayable")

	require.NoError(t, e.tr.Subscribe(ctx, transport.Subscription{Topic: topic, ConsumerGroup: "a"}, transport.Subscription{Topic: topic, ConsumerGroup: "b"}))
	n, err := e.tr.ReplayDeadLetter(ctx, dl[0].ID)
	require.NoError(t, err)
	assert.Equal(t, 2, n)
	assert.Equal(t, 1, e.waiting(topic, "a"))
	assert.Equal(t, 1, e.waiting(topic, "b"))
}

// A dead letter that a message broker's bridge left (a message it received
// but could not queue here: unreadable, or text PostgreSQL cannot keep) is
// no message of this database's queues: replaying it is refused, and says
// so, even when a group of the bridge's name reads the topic here. It stays
// as a record, unreplayed.
func TestReplayRefusesWhatTheBrokerBridgeCouldNotQueue(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	topic := "received_" + e.id
	ctx := context.Background()
	require.NoError(t, e.tr.Subscribe(ctx, transport.Subscription{Topic: topic, ConsumerGroup: "bridge"}))
	m := message.NewMessage("r-"+e.id, []byte("\xff\x00 not json"))
	m.Metadata.Set("k", "nul\x00here")
	require.NoError(t, e.tr.StoreDeadLetter(ctx, topic, "bridge", transport.ReceiveHandler, m, "its metadata holds a NUL character"))
	dl := e.deadLetters(topic)
	require.Len(t, dl, 1)
	_, err := e.tr.ReplayDeadLetter(ctx, dl[0].ID)
	require.ErrorIs(t, err, transport.ErrNotReplayable)
	assert.Contains(t, err.Error(), "sent again")
	assert.Zero(t, e.waiting(topic, "bridge"), "nothing queued")
	assert.Nil(t, e.deadLetters(topic)[0].ReplayedAt, "the record stays as it was")
}

// A listing reads a bounded part of each dead letter, however large: a
// page of them must not load every payload (the relay dead-letters exactly
// the messages too large for a broker); DeadLetter reads one whole.
func TestDeadLettersListsABoundedPartOfEach(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	ctx := context.Background()
	big := strings.Repeat("p", 1<<20)
	reason := strings.Repeat("r", 3*transport.DeadLetterListText)
	md := `{"k":"` + strings.Repeat("m", 2*transport.DeadLetterListText) + `"}`
	var id int64
	require.NoError(t, e.db.SQL.QueryRowContext(ctx, `INSERT INTO pgsaga_dead_letters
        (uuid, topic, consumer_group, handler, payload, metadata, reason, attempts, created_at)
        VALUES ($1, $2, 'g', 'h', $3, $4::jsonb, $5, 1, now()) RETURNING id`,
		"big-"+e.id, e.in, []byte(big), md, reason).Scan(&id))
	small := message.NewMessage("small-"+e.id, []byte(`{"a":1}`))
	require.NoError(t, e.tr.Publisher(e.db.SQL).Publish("nobody_"+e.id, small))

	dl := e.deadLetters(e.in)
	require.Len(t, dl, 1)
	d := dl[0]
	assert.Nil(t, d.Payload, "a listing holds no whole payload")
	assert.Equal(t, []byte(big[:transport.DeadLetterPreviewBytes]), d.PayloadPreview)
	assert.Equal(t, len(big), d.PayloadSize)
	assert.False(t, d.PayloadComplete())
	assert.Len(t, d.Reason, transport.DeadLetterListText)
	assert.Equal(t, len(reason), d.ReasonLength)
	assert.Nil(t, d.Metadata, "metadata over the bound is left out")
	assert.Nil(t, d.RawMetadata)
	assert.Greater(t, d.MetadataSize, transport.DeadLetterListText, "its size is told")

	whole, err := e.tr.DeadLetter(ctx, id)
	require.NoError(t, err)
	assert.Equal(t, []byte(big), whole.Payload)
	assert.Equal(t, reason, whole.Reason)
	assert.Equal(t, strings.Repeat("m", 2*transport.DeadLetterListText), whole.Metadata["k"])
	assert.True(t, whole.PayloadComplete())

	// A small one is listed whole, its metadata with it.
	dl = e.deadLetters("nobody_" + e.id)
	require.Len(t, dl, 1)
	assert.Equal(t, `{"a":1}`, string(dl[0].PayloadPreview))
	assert.True(t, dl[0].PayloadComplete())
	assert.Equal(t, "nobody_"+e.id, dl[0].Metadata[transport.DeadLetterTopic])

	_, err = e.tr.DeadLetter(ctx, -1)
	assert.ErrorIs(t, err, transport.ErrNoSuchDeadLetter)
}

// DeleteDeadLetters deletes the dead letters it names, or those of a topic
// dead for longer than OlderThan, and nothing else; CountDeadLetters counts
// what it would delete. A deletion that selects neither way (or both) is
// refused: it must never mean "all of them".
func TestDeleteDeadLetters(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	ctx := context.Background()
	other := "other_" + e.id
	insert := func(topic string, deadDaysAgo int) int64 {
		var id int64
		require.NoError(t, e.db.SQL.QueryRowContext(ctx, `INSERT INTO pgsaga_dead_letters
            (uuid, topic, consumer_group, handler, payload, metadata, reason, attempts, created_at, dead_at)
            VALUES ('d', $1, 'g', 'h', 'p', '{}', 'r', 1, now(), now() - make_interval(days => $2)) RETURNING id`, topic, deadDaysAgo).Scan(&id))
		return id
	}
	a, b, old, otherOld := insert(e.in, 0), insert(e.in, 0), insert(e.in, 2), insert(other, 2)
	left := func() []int64 {
		var ids []int64
		for _, topic := range []string{e.in, other} {
			for _, d := range e.deadLetters(topic) {
				ids = append(ids, d.ID)
			}
		}
		return ids
	}

	byAge := transport.DeadLetterDeletion{Topic: e.in, OlderThan: 24 * time.Hour}
	n, err := e.tr.CountDeadLetters(ctx, byAge)
	require.NoError(t, err)
	assert.EqualValues(t, 1, n)
	assert.Equal(t, []int64{a, b, old, otherOld}, left(), "counting deletes nothing")
	n, err = e.tr.DeleteDeadLetters(ctx, byAge)
	require.NoError(t, err)
	assert.EqualValues(t, 1, n)
	assert.Equal(t, []int64{a, b, otherOld}, left(), "of that topic, dead for longer")

	byID := transport.DeadLetterDeletion{IDs: []int64{a, -1}}
	n, err = e.tr.CountDeadLetters(ctx, byID)
	require.NoError(t, err)
	assert.EqualValues(t, 1, n)
	n, err = e.tr.DeleteDeadLetters(ctx, byID)
	require.NoError(t, err)
	assert.EqualValues(t, 1, n)
	assert.Equal(t, []int64{b, otherOld}, left())

	for _, d := range []transport.DeadLetterDeletion{
		{}, {Topic: e.in}, {OlderThan: time.Hour}, {IDs: []int64{b}, Topic: e.in, OlderThan: time.Hour}, {Topic: e.in, OlderThan: -time.Hour},
	} {
		_, err := e.tr.DeleteDeadLetters(ctx, d)
		assert.ErrorIs(t, err, transport.ErrInvalidDeletion, "%+v", d)
		_, err = e.tr.CountDeadLetters(ctx, d)
		assert.ErrorIs(t, err, transport.ErrInvalidDeletion, "%+v", d)
	}
	assert.Equal(t, []int64{b, otherOld}, left())
}
