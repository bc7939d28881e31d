package transport_test

import (
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/internal/testdb"
	"github.com/pgsaga/pgsaga/internal/transport"
)

// A write transaction held open in another database on the same server,
// for as long as the test runs, delays no delivery: messages published
// after it began are handled while it is still open. (watermill-sql's
// offset log would hold every one of them back until it ended.)
func TestLongTransactionInAnotherDatabaseDelaysNothing(t *testing.T) {
	t.Parallel()
	stillOpen := testdb.LongWriteElsewhere(t)

	e := newEnvOn(t, testdb.Fresh(t), nil)
	r, err := e.tr.NewRouter()
	require.NoError(t, err)
	require.NoError(t, r.AddHandler("h", e.in, "g", func(msg *message.Message) error { return effect(msg, e.eff, "row") }))
	startRouter(t, r)
	for range 5 {
		e.publish(4)
	}
	e.drained(e.in, "g", 10*time.Second)
	assert.Equal(t, 20, e.count(`SELECT count(*) FROM `+e.eff))
	assert.True(t, stillOpen(), "the long transaction was open throughout")
}

// A message that fails every time holds up nothing: messages of its topic
// and of other topics are all delivered before its last try, and it ends in
// pgsaga_dead_letters.
func TestPoisonMessageHoldsUpNothing(t *testing.T) {
	t.Parallel()
	e := newEnv(t, func(c *transport.Config) {
		c.Retry = transport.RetryPolicy{MaxAttempts: 3, InitialBackoff: 2 * time.Second, MaxBackoff: 2 * time.Second}
	})
	other := "other_" + e.id
	r, err := e.tr.NewRouter()
	require.NoError(t, err)
	var (
		mu          sync.Mutex
		poisonTries []time.Time
		othersDone  time.Time
		others      int
	)
	require.NoError(t, r.AddHandler("h", e.in, "g", func(msg *message.Message) error {
		mu.Lock()
		defer mu.Unlock()
		if msg.Metadata.Get("poison") == "yes" {
			poisonTries = append(poisonTries, time.Now())
			return errors.New("cannot handle this, ever")
		}
		if others++; others == 9 {
			othersDone = time.Now()
		}
		return effect(msg, e.eff, "row")
	}))
	require.NoError(t, r.AddHandler("o", other, "o", func(msg *message.Message) error {
		mu.Lock()
		defer mu.Unlock()
		if others++; others == 9 {
			othersDone = time.Now()
		}
		return effect(msg, e.eff, "other")
	}))
	startRouter(t, r)

	poison := message.NewMessage("poison-"+e.id, []byte(`{}`))
	poison.Metadata.Set("poison", "yes")
	require.NoError(t, e.tr.Publisher(e.db.SQL).Publish(e.in, poison))
	waitFor(t, 10*time.Second, "the poison's first try", func() bool { mu.Lock(); defer mu.Unlock(); return len(poisonTries) >= 1 })
	for range 3 {
		e.publish(2)
		require.NoError(t, e.tr.Publisher(e.db.SQL).Publish(other, message.NewMessage("o-"+randomID(), nil)))
	}
	e.drained(e.in, "g", 20*time.Second)
	e.drained(other, "o", 10*time.Second)
	mu.Lock()
	defer mu.Unlock()
	require.Len(t, poisonTries, 3)
	assert.True(t, othersDone.Before(poisonTries[2]), "the others did not wait for the poison's retries")
	assert.Equal(t, 9, e.count(`SELECT count(*) FROM `+e.eff))
	dead := e.deadLetters(e.in)
	require.Len(t, dead, 1)
	assert.Equal(t, 3, dead[0].Attempts)
}
