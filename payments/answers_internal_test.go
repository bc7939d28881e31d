package payments

import (
	"strconv"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// An answer is taken once, only by the request it was kept for, and not
// past answerAge.
func TestAnAnswerIsTakenOnceByItsRequest(t *testing.T) {
	var a answers
	req := keyHash{"k", []byte{1}}
	a.keep(req, answer{chargeID: "ch_1"})
	_, ok := a.take(keyHash{"k", []byte{2}})
	assert.False(t, ok, "another request under the key")
	a.keep(req, answer{chargeID: "ch_1"})
	got, ok := a.take(req)
	require.True(t, ok)
	assert.Equal(t, "ch_1", got.chargeID)
	_, ok = a.take(req)
	assert.False(t, ok, "taken once")

	a.keep(req, answer{chargeID: "ch_1"})
	a.mu.Lock()
	old := a.m["k"]
	old.at = time.Now().Add(-2 * answerAge)
	a.m["k"] = old
	a.mu.Unlock()
	_, ok = a.take(req)
	assert.False(t, ok, "too old")
}

// The answers kept are bounded: past answerAge they go as others are
// kept, and the oldest go first once answersKept are, each keep at a cost
// that does not grow with them.
func TestAnswersAreBounded(t *testing.T) {
	var a answers
	for i := range answersKept + 10 {
		a.keep(keyHash{strconv.Itoa(i), nil}, answer{chargeID: "ch"})
	}
	assert.Len(t, a.m, answersKept)
	_, ok := a.take(keyHash{"0", nil})
	assert.False(t, ok, "the oldest went first")
	_, ok = a.take(keyHash{strconv.Itoa(answersKept + 9), nil})
	assert.True(t, ok, "the newest is kept")

	a.mu.Lock()
	for i := range a.order {
		a.order[i].at = a.order[i].at.Add(-2 * answerAge)
		if ans, ok := a.m[a.order[i].key]; ok {
			ans.at = a.order[i].at
			a.m[a.order[i].key] = ans
		}
	}
	a.mu.Unlock()
	a.keep(keyHash{"new", nil}, answer{chargeID: "ch"})
	assert.Len(t, a.m, 1, "the aged went with the next keep")
	assert.Len(t, a.order, 1)
}
