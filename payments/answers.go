package payments

import (
	"sync"
	"time"
)

// answers are the outcomes of gateway calls this process recorded, kept
// for the charge's run after its awaited call, which answers from them
// instead of reading the gateway key's record back (one statement less a
// charge). They are a shortcut only: the record is committed before its
// answer is kept, and a run that finds none (another process awaited the
// call, this one restarted) reads the record.
type answers struct {
	mu  sync.Mutex
	m   map[string]answer
	off bool // tests: keep nothing
}

// answer is a recorded gateway charge: its id, or declined.
type answer struct {
	chargeID string
	declined bool
	at       time.Time
}

// answersKept bounds the answers kept; past it, those older than
// answerAge go (their runs happened elsewhere, or failed before).
const (
	answersKept = 10_000
	answerAge   = time.Minute
)

// keep keeps key's answer, once its record has committed.
func (a *answers) keep(key string, ans answer) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.off {
		return
	}
	if a.m == nil {
		a.m = map[string]answer{}
	}
	if len(a.m) >= answersKept {
		for k, v := range a.m {
			if time.Since(v.at) > answerAge {
				delete(a.m, k)
			}
		}
		if len(a.m) >= answersKept {
			return
		}
	}
	ans.at = time.Now()
	a.m[key] = ans
}

// take returns key's answer, if one is kept, and forgets it.
func (a *answers) take(key string) (answer, bool) {
	a.mu.Lock()
	defer a.mu.Unlock()
	ans, ok := a.m[key]
	delete(a.m, key)
	return ans, ok
}
