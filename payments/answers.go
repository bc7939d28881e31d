package payments

import (
	"bytes"
	"sync"
	"time"
)

// answers are the outcomes of gateway calls this process recorded, kept
// for the charge's run after its awaited call, which answers from them
// instead of reading the gateway key's record back (one statement less a
// charge). They are a shortcut only: an answer is kept once its record has
// committed, for answerAge at most, and a run that finds none (another
// process awaited the call, this one restarted, it came too late) reads
// the record.
type answers struct {
	mu    sync.Mutex
	m     map[string]answer
	order []keptAt // keys in the order kept, oldest first
	off   bool     // tests: keep nothing
}

// answer is a recorded gateway charge: its id, or declined; hash is the
// gateway request's, which the run that takes it must match.
type answer struct {
	chargeID string
	declined bool
	hash     []byte
	at       time.Time
}

type keptAt struct {
	key string
	at  time.Time
}

// answersKept bounds the answers kept; answerAge is how long one is.
const (
	answersKept = 10_000
	answerAge   = time.Minute
)

// keep keeps req's answer, once its record has committed. The oldest go
// first: those past answerAge, and the oldest of all when answersKept
// are kept.
func (a *answers) keep(req keyHash, ans answer) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.off {
		return
	}
	if a.m == nil {
		a.m = map[string]answer{}
	}
	now := time.Now()
	for len(a.order) > 0 && (now.Sub(a.order[0].at) > answerAge || len(a.m) >= answersKept) {
		a.drop(a.order[0])
		a.order = a.order[1:]
	}
	ans.hash, ans.at = req.hash, now
	a.m[req.key] = ans
	a.order = append(a.order, keptAt{key: req.key, at: now})
}

// drop forgets k's answer, unless it was kept again since.
func (a *answers) drop(k keptAt) {
	if ans, ok := a.m[k.key]; ok && ans.at.Equal(k.at) {
		delete(a.m, k.key)
	}
}

// take returns req's answer, if one is kept for the same request and not
// older than answerAge, and forgets it.
func (a *answers) take(req keyHash) (answer, bool) {
	a.mu.Lock()
	defer a.mu.Unlock()
	ans, ok := a.m[req.key]
	delete(a.m, req.key)
	if !ok || !bytes.Equal(ans.hash, req.hash) || time.Since(ans.at) > answerAge {
		return answer{}, false
	}
	return ans, true
}

// keyHash is what an answer is kept under: a gateway request's key and
// hash.
type keyHash struct {
	key  string
	hash []byte
}
