package testout

import (
	"os"
	"strconv"
	"testing"
	"time"
)

// ChaosSeed is PGSAGA_CHAOS_SEED, or a fresh seed; it logs the seed, with
// how to run the test again with it.
func ChaosSeed(t testing.TB) uint64 {
	t.Helper()
	seed := uint64(time.Now().UnixNano())
	if s := os.Getenv("PGSAGA_CHAOS_SEED"); s != "" {
		var err error
		if seed, err = strconv.ParseUint(s, 10, 64); err != nil {
			t.Fatalf("PGSAGA_CHAOS_SEED: %v", err)
		}
	}
	t.Logf("chaos seed %d (run again with PGSAGA_CHAOS_SEED=%d)", seed, seed)
	return seed
}
