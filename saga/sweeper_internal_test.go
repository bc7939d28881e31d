package saga

import (
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/assert"
)

// A sweep that fails on an instance for a reason that may pass postpones
// it a sweep interval, then twice as long each time in a row, up to a
// minute (it used to be a minute at once), and a sweep that handles it
// starts the count over.
func TestTheSweeperBacksOffFromAFailingInstance(t *testing.T) {
	var p postponements
	id, other := uuid.New(), uuid.New()
	var got []time.Duration
	for range 9 {
		got = append(got, p.next(id, time.Second))
	}
	assert.Equal(t, []time.Duration{time.Second, 2 * time.Second, 4 * time.Second, 8 * time.Second, 16 * time.Second,
		32 * time.Second, time.Minute, time.Minute, time.Minute}, got)
	assert.Equal(t, time.Second, p.next(other, time.Second), "counted per instance")
	p.done(id)
	assert.Equal(t, time.Second, p.next(id, time.Second), "handled: the count starts over")
	assert.Equal(t, 100*time.Millisecond, p.next(uuid.New(), 0), "at least 100ms")
}
