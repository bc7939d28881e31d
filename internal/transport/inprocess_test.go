package transport_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/internal/pgdb"
	"github.com/pgsaga/pgsaga/internal/testdb"
	"github.com/pgsaga/pgsaga/internal/transport"
)

// localEnv is an env on a database of its own, whose queue inserts are
// logged (queued_log: topic, group), so a test can tell a message handled
// in process (no row for its group, ever) from one handled through the
// queue. The group "local" subscribes to the output topic.
func newLocalEnv(t *testing.T, mutate func(*transport.Config)) *env {
	t.Helper()
	e := newEnvOn(t, testdb.Fresh(t), mutate)
	_, err := e.db.SQL.Exec(`
CREATE TABLE queued_log (topic text NOT NULL, grp text NOT NULL, uuid text NOT NULL);
CREATE TABLE txids (handler text NOT NULL, msg text NOT NULL, txid bigint NOT NULL, attempt int NOT NULL);
CREATE FUNCTION log_queued() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO queued_log VALUES (NEW.topic, NEW.consumer_group, NEW.uuid);
    RETURN NEW;
END$$;
CREATE TRIGGER log_queued AFTER INSERT ON pgsaga_queue FOR EACH ROW EXECUTE FUNCTION log_queued()`)
	require.NoError(t, err)
	require.NoError(t, e.tr.Subscribe(context.Background(), transport.Subscription{Topic: e.out, ConsumerGroup: "local"}))
	return e
}

// noteTx records which transaction handler runs msg in, and as which
// attempt.
func noteTx(msg *message.Message, handler string) error {
	tx, ok := transport.TxFromContext(msg.Context())
	if !ok {
		return errors.New("no transaction in context")
	}
	_, err := tx.ExecContext(msg.Context(), `INSERT INTO txids (handler, msg, txid, attempt) VALUES ($1, $2, txid_current(), $3)`,
		handler, msg.UUID, transport.AttemptFromContext(msg.Context()))
	return err
}

// forward is the publishing handler: it notes its transaction, writes
// part "a" and publishes the reply to the env's output topic.
func forward(e *env) transport.HandlerFunc {
	return func(msg *message.Message) error {
		if err := noteTx(msg, "h"); err != nil {
			return err
		}
		if err := effect(msg, e.eff, "a"); err != nil {
			return err
		}
		tx, _ := transport.TxFromContext(msg.Context())
		reply := message.NewMessage(replyID(msg), []byte(`{"reply":true}`))
		reply.Metadata.Set("origin", msg.UUID)
		return e.tr.Publisher(tx).Publish(e.out, reply)
	}
}

// drainCutsOff configures a transport whose Close cuts attempts off after
// closeTimeout, long before they would time out themselves.
func drainCutsOff(closeTimeout time.Duration) func(*transport.Config) {
	return func(c *transport.Config) {
		c.AttemptTimeout, c.BatchTimeout, c.CloseTimeout = 20*time.Second, 10*time.Second, closeTimeout
	}
}

// queuedFor counts the queue rows ever inserted for group on topic.
func (e *env) queuedFor(topic, group string) int {
	return e.count(`SELECT count(*) FROM queued_log WHERE topic = $1 AND grp = $2`, topic, group)
}

// routeLocal runs h on the input topic and l on the output topic, in
// process, on one router.
func (e *env) routeLocal(t *testing.T, h, l transport.HandlerFunc) *transport.Router {
	t.Helper()
	r, err := e.tr.NewRouter()
	require.NoError(t, err)
	require.NoError(t, r.AddHandler("h", e.in, "g", h))
	require.NoError(t, r.AddHandler("l", e.out, "local", l, transport.InProcess()))
	startRouter(t, r)
	return r
}

// A message published from an attempt to a handler that takes in-process
// deliveries is handled in the publisher's transaction, as attempt 1, with
// its metadata; its group gets no queue row, and the topic's other groups
// get theirs.
func TestInProcessDeliveryRunsInThePublishersTransaction(t *testing.T) {
	t.Parallel()
	e := newLocalEnv(t, nil)
	var got atomic.Pointer[message.Message]
	e.routeLocal(t, forward(e), func(msg *message.Message) error {
		got.Store(msg)
		if err := noteTx(msg, "l"); err != nil {
			return err
		}
		return effect(msg, e.eff, "l")
	})
	ids := e.publish(1)
	e.drained(e.in, "g", 10*time.Second)

	require.NotNil(t, got.Load(), "the in-process handler ran when the publisher committed")
	assert.Equal(t, replyID(message.NewMessage(ids[0], nil)), got.Load().UUID)
	assert.Equal(t, ids[0], got.Load().Metadata.Get("origin"))
	assert.Equal(t, e.out, transport.TopicFromContext(got.Load().Context()), "the handler can tell its topic")
	assert.Equal(t, 1, e.count(`SELECT count(*) FROM txids l JOIN txids h ON h.txid = l.txid WHERE l.handler = 'l' AND h.handler = 'h' AND l.attempt = 1`),
		"the in-process handler ran once, as attempt 1, in the publisher's transaction")
	assert.Equal(t, 1, e.count(`SELECT count(*) FROM txids WHERE handler = 'l'`))
	assert.Zero(t, e.queuedFor(e.out, "local"), "no queue row for the group that handled it in process")
	assert.Equal(t, 1, e.queuedFor(e.out, "archive"), "the topic's other groups get the message")
	assert.Equal(t, 1, e.count(`SELECT count(*) FROM `+e.eff+` WHERE part = 'l'`))
}

// An in-process delivery that fails in any way leaves nothing behind, does
// not fail its publisher, and is queued for its group, which then handles
// it like any message (a permanent failure in process is not
// dead-lettered). One that asks for Instead runs the replacement in
// process.
func TestInProcessFailureIsQueued(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name  string
		fail  func(msg *message.Message) error // the in-process try, after its write
		queue bool                             // the message then goes through the queue
	}{
		{"error", func(*message.Message) error { return errors.New("boom") }, true},
		{"panic", func(*message.Message) error { panic("boom") }, true},
		{"permanent", func(*message.Message) error { return transport.Permanent(errors.New("boom")) }, true},
		{"statement error", func(msg *message.Message) error {
			tx, _ := transport.TxFromContext(msg.Context())
			_, err := tx.ExecContext(msg.Context(), `SELECT 1/0`)
			return err
		}, true},
		{"instead", nil, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			e := newLocalEnv(t, nil)
			var calls atomic.Int32
			e.routeLocal(t, forward(e), func(msg *message.Message) error {
				n := calls.Add(1)
				if err := effect(msg, e.eff, "l"); err != nil {
					return err
				}
				if n > 1 {
					return nil
				}
				if tc.fail == nil {
					return transport.Instead(func(msg *message.Message) error { return effect(msg, e.eff, "instead") }, errors.New("refused"))
				}
				return tc.fail(msg)
			})
			ids := e.publish(1)
			e.drained(e.in, "g", 10*time.Second)
			if tc.queue {
				e.drained(e.out, "local", 10*time.Second)
				assert.Equal(t, 1, e.queuedFor(e.out, "local"), "queued once the in-process try failed")
				assert.Equal(t, int32(2), calls.Load())
				assert.Equal(t, 1, e.count(`SELECT count(*) FROM `+e.eff+` WHERE part = 'l'`), "the failed try's write was rolled back")
			} else {
				assert.Zero(t, e.queuedFor(e.out, "local"))
				assert.Equal(t, int32(1), calls.Load())
				assert.Zero(t, e.count(`SELECT count(*) FROM `+e.eff+` WHERE part = 'l'`), "the refused try's write was rolled back")
				assert.Equal(t, 1, e.count(`SELECT count(*) FROM `+e.eff+` WHERE part = 'instead'`))
			}
			assert.Equal(t, 1, e.count(`SELECT count(*) FROM txids WHERE handler = 'h'`), "the publisher ran once")
			assert.Equal(t, 1, e.count(`SELECT count(*) FROM `+e.eff+` WHERE msg = $1 AND part = 'a'`, ids[0]))
			assert.Equal(t, 1, e.queuedFor(e.out, "archive"))
			assert.Empty(t, e.deadLetters(e.out))
		})
	}
}

// A slow in-process handler is cut off (it may take half of what its
// publisher has left, at most BatchTimeout), its work is rolled back and
// the message is queued; the publisher's attempt is kept.
func TestInProcessSlowHandlerIsCutOffAndQueued(t *testing.T) {
	t.Parallel()
	e := newLocalEnv(t, func(c *transport.Config) { c.BatchTimeout = 200 * time.Millisecond })
	var (
		calls    atomic.Int32
		release  = make(chan struct{})
		afterCut = make(chan error, 1)
	)
	e.routeLocal(t, forward(e), func(msg *message.Message) error {
		if err := effect(msg, e.eff, "l"); err != nil {
			return err
		}
		if calls.Add(1) > 1 {
			return nil
		}
		<-release // deaf to its context: the transport cuts it off
		err := effect(msg, e.eff, "after")
		afterCut <- err
		return err
	})
	e.publish(1)
	e.drained(e.in, "g", 10*time.Second)
	e.drained(e.out, "local", 10*time.Second)
	close(release)
	require.ErrorIs(t, <-afterCut, transport.ErrAttemptOver, "a cut-off in-process handler can run no more statements")
	assert.Equal(t, 1, e.count(`SELECT count(*) FROM txids WHERE handler = 'h'`), "the publisher's attempt was kept")
	assert.Equal(t, 1, e.queuedFor(e.out, "local"))
	assert.Equal(t, 1, e.count(`SELECT count(*) FROM `+e.eff+` WHERE part = 'l'`), "the cut-off try's write was rolled back")
	assert.Zero(t, e.count(`SELECT count(*) FROM `+e.eff+` WHERE part = 'after'`))
}

// When the publisher's attempt fails after an in-process delivery, the
// delivery's work goes with it; the retry queues the message instead.
func TestInProcessWorkGoesWithItsPublisher(t *testing.T) {
	t.Parallel()
	e := newLocalEnv(t, nil)
	var hCalls, lCalls atomic.Int32
	pub := forward(e)
	e.routeLocal(t, func(msg *message.Message) error {
		if err := pub(msg); err != nil {
			return err
		}
		if hCalls.Add(1) == 1 {
			return errors.New("fails after publishing")
		}
		return nil
	}, func(msg *message.Message) error {
		lCalls.Add(1)
		return effect(msg, e.eff, "l")
	})
	e.publish(1)
	e.drained(e.in, "g", 10*time.Second)
	e.drained(e.out, "local", 10*time.Second)
	assert.Equal(t, int32(2), hCalls.Load())
	assert.Equal(t, int32(2), lCalls.Load())
	assert.Equal(t, 1, e.count(`SELECT count(*) FROM `+e.eff+` WHERE part = 'l'`), "the first in-process delivery was rolled back with its publisher")
	assert.Equal(t, 1, e.queuedFor(e.out, "local"), "the retried publisher queued the message")
}

// An in-process handler that ends its publisher's transaction breaks the
// publisher's batch once: the retry queues the message, the publisher's
// message is handled, and the bad handler's message alone is
// dead-lettered.
func TestInProcessHandlerThatBreaksItsPublisherCostsOneAttempt(t *testing.T) {
	t.Parallel()
	e := newLocalEnv(t, nil)
	var hCalls atomic.Int32
	pub := forward(e)
	e.routeLocal(t, func(msg *message.Message) error {
		hCalls.Add(1)
		return pub(msg)
	}, func(msg *message.Message) error {
		tx, _ := transport.TxFromContext(msg.Context())
		_, err := tx.ExecContext(msg.Context(), `COMMIT`)
		return err
	})
	ids := e.publish(1)
	e.drained(e.in, "g", 10*time.Second)
	e.drained(e.out, "local", 10*time.Second)
	assert.Equal(t, int32(2), hCalls.Load(), "the broken batch cost the publisher one attempt")
	assert.Equal(t, 1, e.count(`SELECT count(*) FROM `+e.eff+` WHERE msg = $1 AND part = 'a'`, ids[0]))
	assert.Empty(t, e.deadLetters(e.in))
	dead := e.deadLetters(e.out)
	require.Len(t, dead, 1)
	assert.Equal(t, "local", dead[0].ConsumerGroup)
}

// Cutting the publisher off (here: the router closes and its drain times
// out) cuts off the in-process delivery running inside it: its statements
// are refused from then on and nothing of either commits.
func TestInProcessDeliveryIsCutOffWithItsPublisher(t *testing.T) {
	t.Parallel()
	e := newLocalEnv(t, drainCutsOff(100*time.Millisecond))
	started, release := make(chan struct{}), make(chan struct{})
	after := make(chan error, 1)
	var once sync.Once
	r := e.routeLocal(t, forward(e), func(msg *message.Message) error {
		if err := effect(msg, e.eff, "l"); err != nil {
			return err
		}
		first := false
		once.Do(func() { first = true })
		if !first {
			return nil
		}
		close(started)
		<-release // deaf to its context
		err := effect(msg, e.eff, "after")
		after <- err
		return err
	})
	e.publish(1)
	<-started
	require.NoError(t, r.Stop())
	close(release)
	require.ErrorIs(t, <-after, transport.ErrAttemptOver)
	assert.Equal(t, 1, e.waiting(e.in, "g"), "the publisher's message is still queued")
	assert.Zero(t, e.count(`SELECT count(*) FROM `+e.eff), "nothing of the publisher or of the in-process delivery committed")
	assert.Zero(t, e.queuedFor(e.out, "archive"))
}

// In-process deliveries nest four deep; the fifth is queued.
func TestInProcessDeliveriesNestFourDeep(t *testing.T) {
	t.Parallel()
	e := newLocalEnv(t, nil)
	const hops = 6
	topic := e.routeHops(t, hops)
	e.publish(1)
	waitFor(t, 10*time.Second, "the last hop", func() bool {
		return e.count(`SELECT count(*) FROM txids WHERE handler = $1`, fmt.Sprint(hops)) == 1
	})
	assert.Equal(t, 5, e.count(`SELECT count(*) FROM txids WHERE txid = (SELECT txid FROM txids WHERE handler = '0')`),
		"the publisher and four nested deliveries share a transaction")
	for i := 1; i <= hops; i++ {
		want := 0
		if i == 5 {
			want = 1
		}
		assert.Equal(t, want, e.queuedFor(topic(i), "hop"), "queue rows of hop %d", i)
	}
}

// routeHops runs a chain of hops handlers on one router: hop 0 on the
// input topic (queued), then hop i on topic(i) in process, each noting its
// transaction (txids) and publishing to the next. It returns topic.
func (e *env) routeHops(t *testing.T, hops int) (topic func(int) string) {
	t.Helper()
	topic = func(i int) string { return fmt.Sprintf("%s_hop%d", e.out, i) }
	for i := 1; i <= hops; i++ {
		require.NoError(t, e.tr.Subscribe(context.Background(), transport.Subscription{Topic: topic(i), ConsumerGroup: "hop"}))
	}
	r, err := e.tr.NewRouter()
	require.NoError(t, err)
	hop := func(i int) transport.HandlerFunc {
		return func(msg *message.Message) error {
			if err := noteTx(msg, fmt.Sprint(i)); err != nil {
				return err
			}
			if i == hops {
				return nil
			}
			tx, _ := transport.TxFromContext(msg.Context())
			return e.tr.Publisher(tx).Publish(topic(i+1), message.NewMessage(fmt.Sprintf("%s-%d", msg.UUID, i+1), nil))
		}
	}
	require.NoError(t, r.AddHandler("hop0", e.in, "g", hop(0)))
	for i := 1; i <= hops; i++ {
		require.NoError(t, r.AddHandler(fmt.Sprintf("hop%d", i), topic(i), "hop", hop(i), transport.InProcess()))
	}
	startRouter(t, r)
	return topic
}

// InProcess is a Router handler option: a Subscriber and HandleInTx refuse
// it.
func TestInProcessIsForRouterHandlers(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	_, err := e.tr.NewSubscriber("g", transport.InProcess())
	require.ErrorContains(t, err, "InProcess applies to Router handlers only")
	err = e.tr.HandleInTx(context.Background(), "h", e.in, message.NewMessage("m-"+e.id, nil),
		func(*message.Message) error { return nil }, transport.InProcess())
	require.ErrorContains(t, err, "InProcess applies to Router handlers only")
}

// A message handled in process is routed, even when no consumer group of
// its topic is recorded: it is not dead-lettered as unrouted.
func TestInProcessMessageIsNotUnrouted(t *testing.T) {
	t.Parallel()
	e := newLocalEnv(t, nil)
	e.routeLocal(t, forward(e), func(msg *message.Message) error { return effect(msg, e.eff, "l") })
	for _, g := range []string{"local", "archive"} {
		_, err := e.tr.DropConsumerGroup(context.Background(), e.out, g)
		require.NoError(t, err)
	}
	e.publish(1)
	e.drained(e.in, "g", 10*time.Second)
	assert.Equal(t, 1, e.count(`SELECT count(*) FROM `+e.eff+` WHERE part = 'l'`))
	assert.Empty(t, e.deadLetters(e.out), "handled in process, so not unrouted")
}

// A publisher whose own queued write fails as the in-process delivery
// starts fails for its own reason: bytes PostgreSQL cannot store are
// permanent, dead-lettered in one attempt, not taken for the in-process
// handler's fault.
func TestInProcessPublishersOwnFailureStaysItsOwn(t *testing.T) {
	t.Parallel()
	e := newLocalEnv(t, nil)
	var lCalls atomic.Int32
	pubErr := make(chan error, 1)
	e.routeLocal(t, func(msg *message.Message) error {
		tx, _ := transport.TxFromContext(msg.Context())
		// queued: sent with the round trip that opens the in-process delivery
		if err := transport.Queue(msg.Context(), tx, "the bad write", `INSERT INTO `+e.eff+` (msg, part) VALUES ($1, $2)`, msg.UUID, "nul \x00 byte"); err != nil {
			return err
		}
		err := e.tr.Publisher(tx).Publish(e.out, message.NewMessage(replyID(msg), nil)) // sends it
		pubErr <- err
		return err
	}, func(msg *message.Message) error {
		lCalls.Add(1)
		return nil
	})
	ids := e.publish(1)
	e.drained(e.in, "g", 10*time.Second)
	dead := e.deadLetters(e.in)
	require.Len(t, dead, 1)
	assert.Equal(t, ids[0], dead[0].UUID)
	assert.Equal(t, 1, dead[0].Attempts, "permanent at once")
	assert.Zero(t, lCalls.Load())
	err := <-pubErr
	assert.NotErrorIs(t, err, transport.ErrInProcessBroke, "the publisher is told its own failure")
	assert.ErrorContains(t, err, "the bad write")
	assert.ErrorContains(t, err, "22021")
}

// The publisher is cut off (the router closes and its drain times out)
// while the round trip that opens an in-process delivery is under way: the
// delivery that starts meanwhile is cut off too, and nothing of it commits
// with the batch.
func TestInProcessDeliveryStartingAsItsPublisherIsCutOff(t *testing.T) {
	t.Parallel()
	e := newLocalEnv(t, drainCutsOff(100*time.Millisecond))
	started, childDone := make(chan struct{}), make(chan struct{})
	var first atomic.Bool
	r, err := e.tr.NewRouter()
	require.NoError(t, err)
	require.NoError(t, r.AddHandler("h", e.in, "g", func(msg *message.Message) error {
		tx, _ := transport.TxFromContext(msg.Context())
		if first.CompareAndSwap(false, true) {
			close(started)
			// Sent in the round trip that opens the in-process delivery:
			// the drain's cut-off lands while it runs.
			if err := transport.Queue(msg.Context(), tx, "slow", `SELECT pg_sleep(0.6)`); err != nil {
				return err
			}
		}
		return e.tr.Publisher(tx).Publish(e.out, message.NewMessage(replyID(msg), nil))
	}))
	var once sync.Once
	require.NoError(t, r.AddHandler("l", e.out, "local", func(msg *message.Message) error {
		defer once.Do(func() { close(childDone) })
		tx, _ := transport.TxFromContext(msg.Context())
		for end := time.Now().Add(1500 * time.Millisecond); time.Now().Before(end); { // deaf to its context
			if _, err := tx.ExecContext(context.Background(), `INSERT INTO `+e.eff+` (msg, part) SELECT $1, 'l' FROM pg_sleep(0.002)`, msg.UUID); err != nil {
				return err
			}
		}
		return nil
	}, transport.InProcess()))
	startRouter(t, r)
	e.publish(1)
	<-started
	require.NoError(t, r.Stop())
	<-childDone
	assert.Equal(t, 1, e.waiting(e.in, "g"), "the publisher's message is still queued: its attempt was cut off")
	assert.Zero(t, e.count(`SELECT count(*) FROM `+e.eff), "nothing of the cut-off in-process delivery committed")
}

// An in-process handler that ends the transaction and is still running
// when its publisher is cut off is the one at fault: the publisher is not
// dead-lettered (ErrTransactionEnded is permanent), it stays queued.
func TestInProcessHandlerEndingTheTransactionAsItsPublisherIsCutOff(t *testing.T) {
	t.Parallel()
	e := newLocalEnv(t, drainCutsOff(200*time.Millisecond))
	committed, release := make(chan struct{}), make(chan struct{})
	var once sync.Once
	r := e.routeLocal(t, forward(e), func(msg *message.Message) error {
		tx, _ := transport.TxFromContext(msg.Context())
		_, err := tx.ExecContext(msg.Context(), `COMMIT`)
		once.Do(func() { close(committed) })
		<-release // deaf to its context
		return err
	})
	e.publish(1)
	<-committed
	require.NoError(t, r.Stop())
	close(release)
	assert.Empty(t, e.deadLetters(e.in), "the publisher is not dead-lettered for its in-process handler's fault")
	assert.Equal(t, 1, e.waiting(e.in, "g"), "the publisher's message is still queued, to be retried")
}

// A handler that publishes while it iterates rows of its own query (the
// connection is busy with them) has its messages queued, not delivered in
// process, and loses no attempt.
func TestInProcessPublishWhileIteratingRowsIsQueued(t *testing.T) {
	t.Parallel()
	e := newLocalEnv(t, nil)
	var hCalls, lCalls atomic.Int32
	e.routeLocal(t, func(msg *message.Message) error {
		hCalls.Add(1)
		tx, _ := transport.TxFromContext(msg.Context())
		rows, err := tx.QueryContext(msg.Context(), `SELECT generate_series(1, 3)`)
		if err != nil {
			return err
		}
		defer rows.Close()
		for rows.Next() {
			var i int
			if err := rows.Scan(&i); err != nil {
				return err
			}
			if err := e.tr.Publisher(tx).Publish(e.out, message.NewMessage(fmt.Sprintf("%s-%d", msg.UUID, i), nil)); err != nil {
				return err
			}
		}
		return rows.Err()
	}, func(msg *message.Message) error {
		lCalls.Add(1)
		return nil
	})
	e.publish(1)
	e.drained(e.in, "g", 10*time.Second)
	e.drained(e.out, "local", 10*time.Second)
	assert.Equal(t, int32(1), hCalls.Load(), "the publisher needed one attempt")
	assert.Equal(t, 3, e.queuedFor(e.out, "local"))
	assert.Equal(t, int32(3), lCalls.Load())
}

// An in-process handler gets its own copy of the payload: what it changes
// in place does not change what the topic's other groups get.
func TestInProcessHandlerGetsItsOwnPayload(t *testing.T) {
	t.Parallel()
	e := newLocalEnv(t, nil)
	e.routeLocal(t, forward(e), func(msg *message.Message) error {
		msg.Payload[2] = 'X' // {"reply":true} → {"Xeply":true}
		return nil
	})
	e.publish(1)
	e.drained(e.in, "g", 10*time.Second)
	var payload string
	require.NoError(t, e.db.SQL.QueryRow(`SELECT convert_from(payload, 'UTF8') FROM pgsaga_queue WHERE topic = $1 AND consumer_group = 'archive'`, e.out).Scan(&payload))
	assert.Equal(t, `{"reply":true}`, payload)
}

// QueuedPublisher queues every message, also for a group whose handler
// takes in-process deliveries: it is handled later, in a transaction of
// its own. A queued delivery's handler can tell its topic too.
func TestQueuedPublisherNeverDeliversInProcess(t *testing.T) {
	t.Parallel()
	e := newLocalEnv(t, nil)
	topics := make(chan string, 1)
	e.routeLocal(t, func(msg *message.Message) error {
		if err := noteTx(msg, "h"); err != nil {
			return err
		}
		tx, _ := transport.TxFromContext(msg.Context())
		return e.tr.QueuedPublisher(tx).Publish(e.out, message.NewMessage(replyID(msg), nil))
	}, func(msg *message.Message) error {
		topics <- transport.TopicFromContext(msg.Context())
		return noteTx(msg, "l")
	})
	e.publish(1)
	assert.Equal(t, e.out, <-topics)
	e.drained(e.out, "local", 10*time.Second)
	assert.Equal(t, 1, e.queuedFor(e.out, "local"))
	assert.Zero(t, e.count(`SELECT count(*) FROM txids l JOIN txids h ON h.txid = l.txid WHERE l.handler = 'l' AND h.handler = 'h'`),
		"handled in a transaction of its own")
}

// In-process deliveries take no savepoint of their own: the four nested in
// the publisher's attempt send no SAVEPOINT or RELEASE (they sent two
// each), and their queued writes go with the publisher's next statement
// instead of a round trip of their own. Failures are rare; one that wrote
// is undone with its publisher's attempt (see the test below).
func TestInProcessDeliveriesTakeNoSavepointOfTheirOwn(t *testing.T) {
	t.Parallel()
	fresh := testdb.Fresh(t)
	var mu sync.Mutex
	var local []string
	pool, err := pgdb.Open(context.Background(), pgdb.Config{URL: fresh.URL, MaxConns: 8, Tracer: testdb.Tracer(func(sql string, _ []any) {
		if strings.Contains(sql, "pgsaga_local") {
			mu.Lock()
			local = append(local, sql)
			mu.Unlock()
		}
	})})
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	e := newEnvOn(t, &testdb.DB{Name: fresh.Name, URL: fresh.URL, Pool: pool.Pool, SQL: pool.SQL}, nil)
	_, err = e.db.SQL.Exec(`CREATE TABLE txids (handler text NOT NULL, msg text NOT NULL, txid bigint NOT NULL, attempt int NOT NULL)`)
	require.NoError(t, err)
	const hops = 4
	e.routeHops(t, hops)
	e.publish(1)
	waitFor(t, 10*time.Second, "the last hop", func() bool {
		return e.count(`SELECT count(*) FROM txids WHERE handler = $1`, fmt.Sprint(hops)) == 1
	})
	assert.Equal(t, hops+1, e.count(`SELECT count(*) FROM txids WHERE txid = (SELECT txid FROM txids WHERE handler = '0')`),
		"the publisher and its nested deliveries share a transaction")
	mu.Lock()
	defer mu.Unlock()
	assert.Empty(t, local, "statements of in-process deliveries' own savepoints")
}

// An in-process delivery that fails after writing, inside a publisher that
// ignores its Publish's error and succeeds, leaves nothing of its writes:
// the publisher's attempt is taken back and run again at once, its messages
// queued; it costs no attempt. The failed delivery is queued and handled
// once.
func TestAFailedInProcessDeliveryLeavesNothingEvenIfItsPublisherCarriesOn(t *testing.T) {
	t.Parallel()
	e := newLocalEnv(t, nil)
	var calls atomic.Int32
	r, err := e.tr.NewRouter()
	require.NoError(t, err)
	require.NoError(t, r.AddHandler("h", e.in, "g", func(msg *message.Message) error {
		if err := noteTx(msg, "h"); err != nil {
			return err
		}
		if err := effect(msg, e.eff, "a"); err != nil {
			return err
		}
		tx, _ := transport.TxFromContext(msg.Context())
		_ = e.tr.Publisher(tx).Publish(e.out, message.NewMessage(replyID(msg), nil)) // its error ignored
		return effect(msg, e.eff, "b")
	}))
	require.NoError(t, r.AddHandler("l", e.out, "local", func(msg *message.Message) error {
		if err := effect(msg, e.eff, "l"); err != nil {
			return err
		}
		if calls.Add(1) == 1 {
			return errors.New("boom")
		}
		return nil
	}, transport.InProcess()))
	startRouter(t, r)
	e.publish(1)
	e.drained(e.in, "g", 10*time.Second)
	e.drained(e.out, "local", 10*time.Second)
	assert.Equal(t, 1, e.count(`SELECT count(*) FROM `+e.eff+` WHERE part = 'l'`), "the failed try's write is gone; the queued one's stays")
	assert.Equal(t, 1, e.count(`SELECT count(*) FROM `+e.eff+` WHERE part = 'a'`))
	assert.Equal(t, 1, e.count(`SELECT count(*) FROM `+e.eff+` WHERE part = 'b'`))
	assert.Equal(t, 1, e.count(`SELECT count(*) FROM txids WHERE handler = 'h' AND attempt = 1`), "kept as its first attempt")
	assert.Equal(t, 1, e.queuedFor(e.out, "local"))
	assert.Equal(t, int32(2), calls.Load())
	assert.Empty(t, e.deadLetters(e.out))
}

// A publisher whose only work is an in-process delivery that wrote, and
// which then fails, takes the delivery's writes back with its own: with no
// savepoint of the delivery's, its writes are the publisher's (the
// publisher, having sent nothing itself, was taken as untouched and its
// savepoint kept, writes and all).
func TestAFailingPublisherTakesBackTheWritesOfItsInProcessDelivery(t *testing.T) {
	t.Parallel()
	e := newLocalEnv(t, nil)
	var failedOnce atomic.Bool
	r, err := e.tr.NewRouter()
	require.NoError(t, err)
	require.NoError(t, r.AddHandler("h", e.in, "g", func(msg *message.Message) error {
		tx, _ := transport.TxFromContext(msg.Context())
		if err := e.tr.Publisher(tx).Publish(e.out, message.NewMessage(replyID(msg), nil)); err != nil {
			return err
		}
		if failedOnce.CompareAndSwap(false, true) {
			return errors.New("the publisher fails after its in-process delivery")
		}
		return nil
	}))
	require.NoError(t, r.AddHandler("l", e.out, "local", func(msg *message.Message) error {
		return effect(msg, e.eff, "l")
	}, transport.InProcess()))
	startRouter(t, r)
	e.publish(1)
	e.drained(e.in, "g", 10*time.Second)
	e.drained(e.out, "local", 10*time.Second)
	assert.Equal(t, 1, e.count(`SELECT count(*) FROM `+e.eff+` WHERE part = 'l'`), "the first try's write went with its failed publisher")
}

// A nested in-process delivery that asks for Instead after writing unwinds
// the publisher of its publisher; on the run again its replacement runs in
// its place, in process, with its own message, and the delivery between
// them runs in process again: the replacement is not taken for the middle
// one's own (a saga's reply was once answered with its step's failure).
func TestANestedInsteadRunsInPlaceOfItsOwnDeliveryOnly(t *testing.T) {
	t.Parallel()
	e := newLocalEnv(t, nil)
	mid := e.out + "_mid"
	require.NoError(t, e.tr.Subscribe(context.Background(), transport.Subscription{Topic: mid, ConsumerGroup: "mid"}))
	var tries atomic.Int32
	var replaced sync.Map
	r, err := e.tr.NewRouter()
	require.NoError(t, err)
	require.NoError(t, r.AddHandler("h", e.in, "g", func(msg *message.Message) error {
		tx, _ := transport.TxFromContext(msg.Context())
		return e.tr.Publisher(tx).Publish(mid, message.NewMessage("mid-"+msg.UUID, nil))
	}))
	require.NoError(t, r.AddHandler("m", mid, "mid", func(msg *message.Message) error {
		if err := effect(msg, e.eff, "m"); err != nil {
			return err
		}
		tx, _ := transport.TxFromContext(msg.Context())
		return e.tr.Publisher(tx).Publish(e.out, message.NewMessage("out-"+msg.UUID, nil))
	}, transport.InProcess()))
	require.NoError(t, r.AddHandler("l", e.out, "local", func(msg *message.Message) error {
		tries.Add(1)
		if err := effect(msg, e.eff, "l"); err != nil {
			return err
		}
		return transport.Instead(func(rm *message.Message) error {
			replaced.Store(rm.UUID, true)
			return effect(rm, e.eff, "instead")
		}, errors.New("refused"))
	}, transport.InProcess()))
	startRouter(t, r)
	ids := e.publish(1)
	e.drained(e.in, "g", 10*time.Second)
	var got []string
	replaced.Range(func(k, _ any) bool { got = append(got, k.(string)); return true })
	assert.Equal(t, []string{"out-mid-" + ids[0]}, got, "the replacement ran with its own delivery's message only")
	assert.Equal(t, 1, e.count(`SELECT count(*) FROM `+e.eff+` WHERE part = 'instead'`))
	assert.Equal(t, 1, e.count(`SELECT count(*) FROM `+e.eff+` WHERE part = 'm'`), "the middle delivery ran again in process, kept once")
	assert.Zero(t, e.count(`SELECT count(*) FROM `+e.eff+` WHERE part = 'l'`), "the refused try's write was taken back")
	assert.Zero(t, e.queuedFor(mid, "mid"))
	assert.Zero(t, e.queuedFor(e.out, "local"))
	assert.Equal(t, int32(1), tries.Load())
}
