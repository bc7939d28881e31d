// Package keysql holds the statements with which pgsaga's delivery claims
// the idempotency keys of a whole batch of messages in one statement,
// before their attempts, and gives back, when the batch ends, the claims
// no attempt completed: plumbing of the step runtime, which sets them on
// each step's consumer (transport.ClaimKeysPerBatch). An attempt's
// idempotency.Store.ClaimTx then finds its key claimed, with no statement
// of its own (dbtx.BatchClaimer). They write the rows of package
// idempotency's table, idempotency_keys, as its single-phase claims do.
package keysql

import (
	"strconv"
	"time"

	"github.com/pgsaga/pgsaga/internal/dbtx"
)

const (
	// claimManySQL claims many keys at once, for a delivery batch, in key
	// order (batches claiming the same keys
	// wait for each other rather than deadlock), and returns those it
	// claimed.
	claimManySQL = `INSERT INTO idempotency_keys (scope, key, request_hash)
SELECT u.scope, u.key, u.hash
FROM (SELECT set_config('lock_timeout', $4, true)) AS cfg,
    unnest($1::text[], $2::text[], $3::bytea[]) AS u(scope, key, hash)
ORDER BY u.scope, u.key
ON CONFLICT (scope, key) DO NOTHING
RETURNING scope, key`

	// giveBackSQL deletes the claims among ($1, $2) that no attempt
	// completed: single-phase claims still pending.
	giveBackSQL = `DELETE FROM idempotency_keys k
USING unnest($1::text[], $2::text[]) AS u(scope, key)
WHERE k.scope = u.scope AND k.key = u.key AND k.status = 'pending' AND k.lease_token IS NULL`
)

// Claims returns the batch claims, each claim waiting at most lockTimeout
// for a concurrent claimer of one of its keys (as Store.ClaimTx waits).
func Claims(lockTimeout time.Duration) dbtx.KeyClaims {
	ms := strconv.FormatInt(max(lockTimeout.Milliseconds(), 1), 10)
	return dbtx.KeyClaims{
		Claim: func(scopes, keys []string, hashes [][]byte) (string, []any) {
			return claimManySQL, []any{scopes, keys, hashes, ms}
		},
		GiveBack: func(scopes, keys []string) (string, []any) {
			return giveBackSQL, []any{scopes, keys}
		},
	}
}
