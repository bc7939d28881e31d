package cmdlog_test

import (
	"bytes"
	"strings"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"

	"github.com/pgsaga/pgsaga/internal/cmdlog"
)

// Writers that share one Synced writer (a program's progress and its
// workers' logs on a test's buffer) take turns: the race detector sees no
// race, and every line arrives whole.
func TestSyncedSerializesWrites(t *testing.T) {
	var buf bytes.Buffer
	w := cmdlog.Synced(&buf)
	assert.Same(t, w, cmdlog.Synced(w), "wrapping twice changes nothing")
	var wg sync.WaitGroup
	for g := range 8 {
		wg.Go(func() {
			for range 200 {
				_, _ = w.Write([]byte(strings.Repeat(string(rune('a'+g)), 20) + "\n"))
			}
		})
	}
	wg.Wait()
	lines := strings.Split(strings.TrimSpace(buf.String()), "\n")
	assert.Len(t, lines, 8*200)
	for _, l := range lines {
		assert.Equal(t, strings.Repeat(l[:1], 20), l)
	}
}
