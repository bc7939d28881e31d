package transport

import (
	"runtime"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// goroutineID is the id runtime.Stack prints for the calling goroutine.
func goroutineID() string {
	buf := make([]byte, 64)
	buf = buf[:runtime.Stack(buf, false)]
	var id []byte
	for _, c := range buf[len("goroutine "):] {
		if c < '0' || c > '9' {
			break
		}
		id = append(id, c)
	}
	return string(id)
}

// A function started once another's then has run runs on the same
// goroutine, whose stack has grown already; one started while the first
// still runs gets a goroutine of its own; an idle goroutine ends.
func TestWorkersKeepTheirGoroutines(t *testing.T) {
	w := &workers{idleFor: time.Hour}
	ran := make(chan string, 1)
	done := make(chan struct{})
	record := func() { ran <- goroutineID() }
	signal := func() { done <- struct{}{} }
	w.Go(record, signal)
	first := <-ran
	<-done
	w.Go(record, signal)
	assert.Equal(t, first, <-ran, "the second function ran on the first one's goroutine")
	<-done

	block := make(chan struct{})
	w.Go(func() { record(); <-block }, signal)
	busy := <-ran
	w.Go(record, nil)
	assert.NotEqual(t, busy, <-ran, "a busy goroutine is not handed more")
	assert.EqualValues(t, 2, w.started.Load())
	close(block)
	<-done

	short := &workers{idleFor: time.Millisecond}
	short.Go(func() {}, signal)
	<-done // idle now: back in the list before then ran
	require.Eventually(t, func() bool {
		short.mu.Lock()
		defer short.mu.Unlock()
		return len(short.idle) == 0
	}, 10*time.Second, time.Millisecond, "an idle goroutine ends")
	short.Go(func() {}, signal)
	<-done
	assert.EqualValues(t, 2, short.started.Load(), "a function after the idle one ended gets a new goroutine")
}
