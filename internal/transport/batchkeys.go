package transport

import (
	"bytes"
	"context"
	"fmt"
	"strings"
	"sync"
	"unicode/utf8"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgerrcode"
	"github.com/jackc/pgx/v5"

	"github.com/pgsaga/pgsaga/internal/dbtx"
	"github.com/pgsaga/pgsaga/internal/pgerr"
)

// KeyOf returns the idempotency key a handler claims for msg: its scope,
// the key and the request's hash; ok false when it claims none.
type KeyOf func(msg *message.Message) (scope, key string, hash []byte, ok bool)

// ClaimKeysPerBatch makes the handler's consumers claim the idempotency
// keys of all the messages of a batch in one statement, before the batch's
// first attempt, instead of one claim per attempt (the statements are
// claims' own, see idempotency.Store.BatchKeyClaims); an attempt then finds
// its message's key claimed with no statement (dbtx.BatchClaimer). A claim
// whose attempt fails, or whose message is handed back, is free for a copy
// of the message later in the batch, and the claims no attempt completed
// are given back when the batch ends, with its other writes. A batch of one
// message claims as its attempt does. Router handlers only.
func ClaimKeysPerBatch(keyOf KeyOf, claims dbtx.KeyClaims) HandlerOption {
	return func(o *handlerOptions) { o.keys = &batchKeys{keyOf: keyOf, claims: claims} }
}

// batchKeys is a route's ClaimKeysPerBatch.
type batchKeys struct {
	keyOf  KeyOf
	claims dbtx.KeyClaims
}

// claimRequest is the key a message of a batch claims.
type claimRequest struct {
	id         int64 // its queue row
	scope, key string
	hash       []byte
}

// batchClaims are the keys a batch claimed up front.
type batchClaims struct {
	mu     sync.Mutex
	owner  map[string]int64 // scope NUL key: the queue id of the message holding it; 0 free
	hash   map[string][]byte
	scopes []string // every key claimed, for the give-back
	keys   []string
	// asked: every key the claim asked for, given back should the claim
	// fail after it took effect.
	asked struct{ scopes, keys []string }
}

func claimKey(scope, key string) string { return scope + "\x00" + key }

var _ dbtx.BatchClaimer = (*attemptTx)(nil)

// ClaimedInBatch reports whether the batch claimed key for the attempt's
// message; see dbtx.BatchClaimer.
func (a *attemptTx) ClaimedInBatch(scope, key string, hash []byte) (claimed, rehash bool) {
	if a.d == nil || a.d.claims == nil || a.queueID == 0 {
		return false, false
	}
	// a.mu, then the claims' lock: an attempt cut off meanwhile (its
	// handler goroutine may go on) takes nothing back that deliver freed.
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.over {
		return false, false
	}
	cl := a.d.claims
	cl.mu.Lock()
	defer cl.mu.Unlock()
	k := claimKey(scope, key)
	owner, ok := cl.owner[k]
	if !ok || (owner != 0 && owner != a.queueID) {
		return false, false
	}
	cl.owner[k] = a.queueID
	// The batch's hash is kept: an attempt that stored its own and then
	// failed took that with it, so its next run must store it again.
	return true, !bytes.Equal(cl.hash[k], hash)
}

// free frees the claims the message with queue id holds: its attempt
// failed or it was handed back.
func (cl *batchClaims) free(id int64) {
	if cl == nil {
		return
	}
	cl.mu.Lock()
	defer cl.mu.Unlock()
	for k, owner := range cl.owner {
		if owner == id {
			cl.owner[k] = 0
		}
	}
}

// giveBack is the statement that deletes the batch's claims no attempt
// completed, or none.
func (cl *batchClaims) giveBack(bk *batchKeys) []stmt {
	if cl == nil || len(cl.keys) == 0 {
		return nil
	}
	q, args := bk.claims.GiveBack(cl.scopes, cl.keys)
	return []stmt{{name: "giving back unused idempotency claims", query: q, args: args}}
}

// preludeSavepoint brackets the batch's claim and load, so that a claim
// that fails (a lock held longer than lock_timeout by another batch's
// claim of the same key) leaves the batch usable: its attempts then claim
// and read one by one.
const (
	openPreludeSQL     = "SAVEPOINT pgsaga_prelude"
	releasePreludeSQL  = "RELEASE SAVEPOINT pgsaga_prelude"
	rollbackPreludeSQL = "ROLLBACK TO SAVEPOINT pgsaga_prelude; RELEASE SAVEPOINT pgsaga_prelude"
)

// prelude claims the keys of the batch's messages (see
// ClaimKeysPerBatch) and loads what their handlers read (see
// LoadPerBatch), once, before its first attempt, in one round trip.
func (c *consumer) prelude(b *batch) {
	if b.d.preluded {
		return
	}
	b.d.preluded = true
	b.mu.Lock()
	keys, loads := b.keys, b.loads
	b.mu.Unlock()
	claim, claimRead, claims := c.claimStatement(keys)
	load, loadRead, loaded, loading := c.loadStatement(loads)
	b.d.claims = claims
	if claimRead == nil && !loading {
		return
	}
	// The claim belongs to the transaction: a savepoint opened ahead for
	// an attempt (after a message whose handler was never reached) is
	// released first, or a failure of that attempt would take the claim
	// with it.
	var stmts []stmt
	if b.d.spOpen {
		stmts = append(stmts, stmt{name: "closing the unused attempt", query: releaseAttemptSQL})
		b.d.spOpen = false
	}
	stmts = append(stmts, stmt{name: "opening the batch's prelude", query: openPreludeSQL})
	readers := map[int]func(pgx.Rows) error{}
	if claimRead != nil {
		readers[len(stmts)] = claimRead
		// The claim bounds its own lock waits (the idempotency store's
		// lock timeout); the attempts' are the transport's again after it.
		stmts = append(stmts, claim, stmt{name: "ending the claim's lock timeout", query: restoreLockTimeoutSQL, args: []any{c.t.lockTimeout}})
	}
	if loading {
		readers[len(stmts)] = loadRead
		stmts = append(stmts, load)
	}
	stmts = append(stmts, stmt{name: "closing the batch's prelude", query: releasePreludeSQL})
	err := b.d.c.sendReading(context.Background(), stmts, readers)
	if err == nil {
		b.d.loads = loaded
		return
	}
	// Nobody holds a claim, nothing is loaded: the attempts claim and read
	// one by one. Whatever the claim did, should it have taken effect (its
	// savepoint released before the failure), is given back when the batch
	// ends.
	if claims != nil {
		b.d.claims = &batchClaims{owner: map[string]int64{}, hash: map[string][]byte{}, scopes: claims.asked.scopes, keys: claims.asked.keys}
	}
	if !b.d.c.aborted() {
		// The server ran the prelude to its end (its reader failed in
		// the client): the transaction is fine, and rolling back to a
		// released savepoint would abort it. The claims it made are given
		// back now, for the attempts to claim their keys themselves.
		if gb := b.d.claims.giveBack(c.rt.keys); len(gb) > 0 {
			if gerr := b.d.c.send(context.Background(), gb...); gerr != nil {
				c.log.Warn("transport: giving back a batch's claims after reading them failed", "err", gerr, "cause", err)
				return
			}
			b.d.claims = &batchClaims{owner: map[string]int64{}, hash: map[string][]byte{}}
		}
		c.log.Debug("transport: reading a batch's prelude failed; its attempts claim and read one by one", "err", err)
		return
	}
	rerr := b.d.c.rollbackTo(context.Background(), "rolling back the batch's prelude", rollbackPreludeSQL)
	if rerr != nil && !pgerr.Is(rerr, pgerrcode.InvalidSavepointSpecification) {
		c.log.Warn("transport: rolling back a batch's prelude (its claim of its keys, its load) failed", "err", rerr, "cause", err)
		return
	}
	c.log.Debug("transport: a batch's prelude failed; its attempts claim and read one by one", "err", err)
}

// claimStatement is the statement that claims the keys of reqs, the
// reader of its rows and the claims it fills in; no reader when there is
// nothing worth claiming (one claim costs what its attempt's would), the
// claims then empty, or nil without ClaimKeysPerBatch.
func (c *consumer) claimStatement(reqs []claimRequest) (stmt, func(pgx.Rows) error, *batchClaims) {
	bk := c.rt.keys
	if bk == nil {
		return stmt{}, nil, nil
	}
	cl := &batchClaims{owner: map[string]int64{}, hash: map[string][]byte{}}
	var (
		scopes, keys []string
		hashes       [][]byte
		ids          []int64
		seen         = map[string]bool{}
	)
	for _, r := range reqs {
		if !claimable(r.scope, 200) || !claimable(r.key, 255) || len(r.hash) == 0 || seen[claimKey(r.scope, r.key)] {
			continue
		}
		seen[claimKey(r.scope, r.key)] = true
		scopes, keys, hashes, ids = append(scopes, r.scope), append(keys, r.key), append(hashes, r.hash), append(ids, r.id)
	}
	if len(keys) < 2 {
		return stmt{}, nil, cl
	}
	cl.asked.scopes, cl.asked.keys = scopes, keys
	q, args := bk.claims.Claim(scopes, keys, hashes)
	byKey := map[string]int{}
	for i := range keys {
		byKey[claimKey(scopes[i], keys[i])] = i
	}
	read := func(rows pgx.Rows) error {
		for rows.Next() {
			var scope, key string
			if err := rows.Scan(&scope, &key); err != nil {
				return err
			}
			k := claimKey(scope, key)
			i, ok := byKey[k]
			if !ok {
				return fmt.Errorf("transport: the batch's claim returned a key it did not ask for")
			}
			cl.owner[k], cl.hash[k] = ids[i], hashes[i]
			cl.scopes, cl.keys = append(cl.scopes, scope), append(cl.keys, key)
		}
		return rows.Err()
	}
	return stmt{name: "claiming the batch's keys", query: q, args: args}, read, cl
}

// claimable reports whether s is text PostgreSQL stores, at most max
// bytes long (idempotency_keys' checks count characters, which are no
// more): a key that is not is left to its attempt, which fails it.
func claimable(s string, max int) bool {
	return s != "" && len(s) <= max && utf8.ValidString(s) && !strings.ContainsRune(s, 0)
}
