package idempotency

// Statements of the store. Values always travel as parameters.
const (
	// claimSQL inserts a pending claim unless the key exists. Its first CTE
	// reads the transaction's lock_timeout (prev) and then sets the claim's,
	// before the insert can wait on a concurrent claim, so the wait is
	// bounded in the same round trip. The OFFSET 0 keeps the read below the
	// set. It returns one row: prev; attempts and created_at when it
	// inserted; and restored, true when it inserted: the outer SELECT can
	// only project the inserted row once the insert (and any wait of it) is
	// over, and then sets prev back, so a new key costs no statement of
	// restoreLockTimeoutSQL. The key existing, the claim goes on under the
	// claim's lock_timeout (lockRecordSQL waits too) and is restored after.
	claimSQL = `WITH cfg AS MATERIALIZED (
    SELECT prev, set_config('lock_timeout', $4, true) AS claim_timeout
    FROM (SELECT current_setting('lock_timeout') AS prev OFFSET 0) AS p
), claimed AS (
    INSERT INTO idempotency_keys (scope, key, request_hash)
    SELECT $1, $2, $3 FROM cfg
    ON CONFLICT (scope, key) DO NOTHING
    RETURNING attempts, created_at
)
SELECT cfg.prev, claimed.attempts, claimed.created_at,
    CASE WHEN claimed.attempts IS NOT NULL THEN set_config('lock_timeout', cfg.prev, true) IS NOT NULL ELSE false END AS restored
FROM cfg LEFT JOIN claimed ON true`

	// restoreLockTimeoutSQL ends a claim's lock_timeout: it sets back the
	// value claimSQL or claimLeaseSQL read, for the rest of the transaction,
	// when they did not (the key existed).
	restoreLockTimeoutSQL = `SELECT set_config('lock_timeout', $1, true)`

	// rehashSQL stores the request hash of a batch's claim that its
	// attempt takes with another (see dbtx.BatchClaimer).
	rehashSQL = `UPDATE idempotency_keys SET request_hash = $3
WHERE scope = $1 AND key = $2 AND status = 'pending' AND lease_token IS NULL`

	// claimLeaseSQL is claimSQL for the two-phase form: the claim carries a
	// lease that only its token can complete and that others may take over
	// once it expires. It returns prev; attempts, created_at and
	// locked_until when it inserted; and restored, as claimSQL does.
	claimLeaseSQL = `WITH cfg AS MATERIALIZED (
    SELECT prev, set_config('lock_timeout', $4, true) AS claim_timeout
    FROM (SELECT current_setting('lock_timeout') AS prev OFFSET 0) AS p
), claimed AS (
    INSERT INTO idempotency_keys (scope, key, request_hash, lease_token, locked_until)
    SELECT $1, $2, $3, $5, clock_timestamp() + make_interval(secs => $6) FROM cfg
    ON CONFLICT (scope, key) DO NOTHING
    RETURNING attempts, created_at, locked_until
)
SELECT cfg.prev, claimed.attempts, claimed.created_at, claimed.locked_until,
    CASE WHEN claimed.attempts IS NOT NULL THEN set_config('lock_timeout', cfg.prev, true) IS NOT NULL ELSE false END AS restored
FROM cfg LEFT JOIN claimed ON true`

	// lockRecordSQL reads an existing key under a row lock: at READ
	// COMMITTED it sees a concurrent claimer's outcome once that commits.
	lockRecordSQL = `SELECT ` + recordColumns + `,
    coalesce(extract(epoch FROM greatest(locked_until - clock_timestamp(), '0')), 0)::float8
FROM idempotency_keys
WHERE scope = $1 AND key = $2 FOR UPDATE`

	getRecordSQL = `SELECT ` + recordColumns + ` FROM idempotency_keys WHERE scope = $1 AND key = $2`

	recordColumns = `request_hash, status, response_code, response, response_meta, attempts,
lease_token, locked_until, created_at, updated_at, completed_at`

	// takeoverSQL hands an expired lease to a new holder; exactly one of
	// several concurrent takers wins.
	takeoverSQL = `UPDATE idempotency_keys
SET lease_token = $3, locked_until = clock_timestamp() + make_interval(secs => $4),
    attempts = attempts + 1, updated_at = now()
WHERE scope = $1 AND key = $2 AND status = 'pending' AND locked_until < clock_timestamp()
RETURNING attempts, locked_until`

	// completeSQL finishes a single-phase claim (one without a lease).
	completeSQL = `UPDATE idempotency_keys
SET status = $3, response_code = $4, response = $5, response_meta = $6,
    completed_at = now(), updated_at = now()
WHERE scope = $1 AND key = $2 AND status = 'pending' AND lease_token IS NULL`

	// completeManySQL is completeSQL for many claims at once (see
	// completeWrite), with no response code or metadata.
	// Every row must find its pending claim (the attempts claimed them in
	// this transaction): a completion that finds none fails the statement,
	// and so its batch, instead of leaving a step done with no key stored.
	completeManySQL = `WITH done AS (
    UPDATE idempotency_keys k
    SET status = u.status, response_code = 0, response = u.response, response_meta = NULL,
        completed_at = now(), updated_at = now()
    FROM unnest($1::text[], $2::text[], $3::text[], $4::bytea[]) AS u(scope, key, status, response)
    WHERE k.scope = u.scope AND k.key = u.key AND k.status = 'pending' AND k.lease_token IS NULL
    RETURNING 1
)
SELECT CASE WHEN n = cardinality($1::text[]) THEN n
    ELSE ('completing idempotency keys: ' || n || ' of ' || cardinality($1::text[]) || ' found their pending claim')::int END
FROM (SELECT count(*)::int AS n FROM done) AS c`

	// completeLeaseSQL finishes a two-phase claim, fenced on the lease
	// token: a worker whose lease was taken over updates nothing.
	completeLeaseSQL = `UPDATE idempotency_keys
SET status = $3, response_code = $4, response = $5, response_meta = $6,
    completed_at = now(), updated_at = now(), lease_token = NULL, locked_until = NULL
WHERE scope = $1 AND key = $2 AND status = 'pending' AND lease_token = $7`

	// releaseLeaseSQL lets the next attempt take a lease over at once.
	releaseLeaseSQL = `UPDATE idempotency_keys
SET locked_until = clock_timestamp(), updated_at = now()
WHERE scope = $1 AND key = $2 AND status = 'pending' AND lease_token = $3`

	// savepointSQL and rollbackToSavepointSQL bracket an HTTP request's own
	// work (Middleware), so a final failure is stored without the writes
	// that led to it. Do takes none: it rolls a failure back whole.
	savepointSQL           = "SAVEPOINT pgsaga_request"
	rollbackToSavepointSQL = "ROLLBACK TO SAVEPOINT pgsaga_request"

	// reapSQL deletes one batch of finished keys older than the TTL, skipping
	// rows another reaper or a replaying request holds. Pending keys are
	// never touched.
	reapSQL = `DELETE FROM idempotency_keys k
USING (
    SELECT scope, key FROM idempotency_keys
    WHERE status <> 'pending' AND completed_at < now() - make_interval(secs => $1)
    ORDER BY completed_at
    LIMIT $2
    FOR UPDATE SKIP LOCKED
) d
WHERE k.scope = d.scope AND k.key = d.key`
)
