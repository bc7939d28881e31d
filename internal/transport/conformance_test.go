package transport_test

import (
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/tests"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/internal/testdb"
	"github.com/pgsaga/pgsaga/internal/transport"
)

// Watermill's pub/sub conformance suite, in full mode, run against the
// Transport's publisher (autocommitting on the database) and Subscriber.
//
// A message awaiting its ack holds a connection (its consumer's batch),
// and TestConcurrentSubscribe runs fifty subscribers of one topic, each of
// whose first message is read only once all have subscribed: the suite
// gets a pool of its own of 70 connections, and takes a server-wide turn
// for them. TestContinueAfterErrors nacks 300 times among 50 messages and
// expects every one delivered afterwards: a nack costs an attempt here,
// so its transport allows 1,000 (RetryPolicy.MaxAttempts) before the dead
// letter.
//
// Not parallel: the suite's tests run in parallel with one another.
func TestPubSub(t *testing.T) {
	testdb.ServerWide(t)
	newPubSub, group := conformancePubSub(t)
	tests.TestPubSub(t, tests.Features{
		ConsumerGroups: true,
		// An acked message leaves its queue when its consumer's batch
		// commits; a batch that fails to commit delivers it again.
		ExactlyOnceDelivery: false,
		// Not even for one consumer: a failed (nacked) message is retried
		// after its backoff, behind the messages published after it, which
		// go on meanwhile; and a group's consumers claim batches in
		// parallel.
		GuaranteedOrder: false,
		Persistent:      true,
		// Handled messages are deleted, and a group gets only what is
		// published once it is subscribed.
		NewSubscriberReceivesOldMessages: false,
		// A message keeps no context across the database.
		ContextPreserved: false,
	}, func(t *testing.T) (message.Publisher, message.Subscriber) {
		return newPubSub(t, group)
	}, newPubSub)
}

// The suite runs TestNoAck only for pub/subs that guarantee order, which
// the transport does not (see TestPubSub); what it checks holds all the
// same: a Subscriber of one consumer hands out a topic's next message only
// once the previous one is acked.
func TestSubscriberHandsOutOneMessageAtATime(t *testing.T) {
	t.Parallel()
	newPubSub, group := conformancePubSub(t)
	tests.TestNoAck(t, tests.TestContext{
		TestID:   tests.NewTestID(),
		Features: tests.Features{ConsumerGroups: true, GuaranteedOrder: true, Persistent: true},
	}, func(t *testing.T) (message.Publisher, message.Subscriber) {
		return newPubSub(t, group)
	})
}

// conformancePubSub returns the suite's constructor of pub/sub instances
// of a consumer group, and the group of those it makes without one.
func conformancePubSub(t *testing.T) (newPubSub tests.ConsumerGroupPubSubConstructor, group string) {
	shared := testdb.Shared(t)
	pool := testdb.Open(t, shared.URL, 70)
	db := &testdb.DB{Name: shared.Name, URL: shared.URL, Pool: pool.Pool, SQL: pool.SQL}
	// One Transport serves every instance of the pub/sub, as it does the
	// subscribers of one process. (A Transport per instance would hold a
	// LISTEN connection each; the suite's instances, many alive at once,
	// would starve the pool.) Each instance is a Subscriber of its own.
	cfg := fastConfig(db)
	cfg.Retry.MaxAttempts = 1000 // see TestPubSub
	tr, err := transport.New(cfg)
	require.NoError(t, err)
	newPubSub = func(t *testing.T, consumerGroup string) (message.Publisher, message.Subscriber) {
		sub, err := tr.NewSubscriber(consumerGroup)
		require.NoError(t, err)
		// A suite test that fails leaves its subscribers open; their
		// consumers would hold connections, and the package's end, which
		// closes the pool, would wait for them forever.
		t.Cleanup(func() { assert.NoError(t, sub.Close()) })
		return tr.Publisher(db.SQL), sub
	}
	// The suite's instances without a consumer group share one queue: a
	// new one continues where a closed one stopped, several split the
	// messages between them. Its topics are new in every test, so one group
	// serves all.
	return newPubSub, "conformance_" + randomID()
}
