package saga_test

import (
	"context"
	"encoding/json"
	"errors"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/internal/testdb"
	"github.com/pgsaga/pgsaga/saga"
	"github.com/pgsaga/pgsaga/saga/delivery"
	"github.com/pgsaga/pgsaga/steps/events"
)

type noted struct {
	Text string `json:"text"`
}

func (noted) EventType() string { return "test.noted" }

// newNotesClient is a client whose events have the topic "notes",
// published or not, on a database of its own with a notes_view table.
func newNotesClient(t *testing.T, notPublished bool) (*saga.Client, *testdb.DB) {
	t.Helper()
	db := testdb.Fresh(t)
	_, err := db.SQL.Exec(`CREATE TABLE notes_view (stream text PRIMARY KEY, text text NOT NULL, version int NOT NULL)`)
	require.NoError(t, err)
	c, err := saga.NewClient(db.Pool, saga.ClientConfig{
		Transport:          delivery.Config{IdlePollInterval: testdb.NoSafetyPoll},
		RegisterEvents:     []func(*events.Registry) error{events.Register[noted]},
		EventsTopic:        func(string) string { return "notes" },
		EventsNotPublished: notPublished,
		Logger:             logger(),
	})
	require.NoError(t, err)
	return c, db
}

// projectNote is the notes_view projection.
func projectNote(ctx context.Context, tx delivery.DBTX, msg *message.Message) error {
	var ev noted
	if err := json.Unmarshal(msg.Payload, &ev); err != nil {
		return err
	}
	_, err := tx.ExecContext(ctx, `INSERT INTO notes_view VALUES ($1, $2, $3)
ON CONFLICT (stream) DO UPDATE SET text = excluded.text, version = excluded.version`,
		msg.Metadata.Get(events.MetaStreamID), ev.Text, msg.Metadata.Get(events.MetaVersion))
	return err
}

func appendNote(t *testing.T, c *saga.Client, db *testdb.DB, stream string, expected int, text string) error {
	t.Helper()
	tx, err := db.SQL.Begin()
	require.NoError(t, err)
	defer tx.Rollback() //nolint:errcheck
	if _, err := c.Events().AppendTx(context.Background(), tx, stream, expected, events.Metadata{}, noted{Text: text}); err != nil {
		return err
	}
	return tx.Commit()
}

// An inline projection keeps its view in the transaction that appends the
// event: the view is current when the append commits, with no worker
// running and no message sent; with EventsNotPublished nothing reaches the
// queue or the dead letters.
func TestInlineProjectionWritesInTheAppendingTransaction(t *testing.T) {
	t.Parallel()
	c, db := newNotesClient(t, true)
	require.NoError(t, c.AddProjections(events.Projection{Name: "notes.view", Topic: "notes", Handle: projectNote, Inline: true}))
	assert.Empty(t, c.Subscriptions(), "an inline projection consumes nothing")

	require.NoError(t, appendNote(t, c, db, "note-1", 0, "first"))
	require.NoError(t, appendNote(t, c, db, "note-1", 1, "second"))
	var text string
	var version int
	require.NoError(t, db.SQL.QueryRow(`SELECT text, version FROM notes_view WHERE stream = 'note-1'`).Scan(&text, &version))
	assert.Equal(t, "second", text)
	assert.Equal(t, 2, version)
	var queued, dead int
	require.NoError(t, db.SQL.QueryRow(`SELECT (SELECT count(*) FROM pgsaga_queue), (SELECT count(*) FROM pgsaga_dead_letters)`).Scan(&queued, &dead))
	assert.Zero(t, queued)
	assert.Zero(t, dead, "nothing published, so nothing unrouted")
}

// A failing inline projection fails the append: the event is not
// recorded, and the view does not move.
func TestInlineProjectionFailureFailsTheAppend(t *testing.T) {
	t.Parallel()
	c, db := newNotesClient(t, true)
	boom := errors.New("view refused")
	require.NoError(t, c.AddProjections(events.Projection{Name: "notes.view", Topic: "notes", Inline: true,
		Handle: func(ctx context.Context, tx delivery.DBTX, msg *message.Message) error {
			if err := projectNote(ctx, tx, msg); err != nil {
				return err
			}
			return boom
		}}))
	require.ErrorIs(t, appendNote(t, c, db, "note-1", 0, "first"), boom)
	var n int
	require.NoError(t, db.SQL.QueryRow(`SELECT (SELECT count(*) FROM notes_view) + (SELECT count(*) FROM domain_events)`).Scan(&n))
	assert.Zero(t, n)
}

// Events stay published for the topic's consumers unless
// EventsNotPublished: an inline projection does not change that. Inline
// projections of other topics are not called.
func TestInlineProjectionBesideConsumers(t *testing.T) {
	t.Parallel()
	c, db := newNotesClient(t, false)
	other := 0
	require.NoError(t, c.AddProjections(
		events.Projection{Name: "notes.view", Topic: "notes", Handle: projectNote, Inline: true},
		events.Projection{Name: "other.view", Topic: "other", Inline: true, Handle: func(context.Context, delivery.DBTX, *message.Message) error { other++; return nil }},
		events.Projection{Name: "notes.search", Topic: "notes", Handle: func(context.Context, delivery.DBTX, *message.Message) error { return nil }},
	))
	require.NoError(t, c.Setup(context.Background()))
	require.NoError(t, appendNote(t, c, db, "note-1", 0, "first"))
	var viewed, queued int
	require.NoError(t, db.SQL.QueryRow(`SELECT (SELECT count(*) FROM notes_view),
    (SELECT count(*) FROM pgsaga_queue WHERE consumer_group = 'notes.search')`).Scan(&viewed, &queued))
	assert.Equal(t, 1, viewed)
	assert.Equal(t, 1, queued, "the asynchronous projection gets the event")
	assert.Zero(t, other)
}

// An inline projection needs the events to have a topic.
func TestInlineProjectionNeedsEventsTopic(t *testing.T) {
	t.Parallel()
	db := testdb.Shared(t)
	c, err := saga.NewClientFromDB(db.SQL, saga.ClientConfig{Logger: logger()})
	require.NoError(t, err)
	err = c.AddProjections(events.Projection{Name: "notes.view", Topic: "notes", Handle: projectNote, Inline: true})
	require.ErrorContains(t, err, "EventsTopic")
	_, err = saga.NewClientFromDB(db.SQL, saga.ClientConfig{EventsNotPublished: true, Logger: logger()})
	require.ErrorContains(t, err, "EventsTopic")
}

// An asynchronous projection of events that are not published would wait
// forever: the client refuses it.
func TestAsyncProjectionOfUnpublishedEventsIsRefused(t *testing.T) {
	t.Parallel()
	c, _ := newNotesClient(t, true)
	err := c.AddProjections(events.Projection{Name: "notes.search", Topic: "notes", Handle: projectNote})
	require.ErrorContains(t, err, "would receive nothing")
	assert.Empty(t, c.Subscriptions())
}
