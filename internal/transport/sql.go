package transport

// Statements the transport runs. Values always travel as parameters.
const (
	// publishSQL fans msgs out to every consumer group subscribed to the
	// topic ($1): one queue row per message and group, in message order. A
	// message no group subscribes to is kept as a dead letter saying so,
	// never dropped. With a channel ($5 <> ''), the topic's consumers are
	// woken when (and only if) the transaction commits; PostgreSQL sends
	// identical notifications of one transaction once.
	// $2 uuids, $3 payloads, $4 metadata (JSON objects). $6: groups that
	// handled the messages in process already (see InProcess): they get
	// no row, and a message they handled is routed even if no group is
	// recorded for the topic.
	publishSQL = `WITH msgs AS (
    SELECT * FROM unnest($2::text[], $3::bytea[], $4::jsonb[]) WITH ORDINALITY AS m(uuid, payload, metadata, ord)
), groups AS (
    SELECT consumer_group FROM pgsaga_subscriptions WHERE topic = $1
), queued AS (
    INSERT INTO pgsaga_queue (topic, consumer_group, uuid, payload, metadata)
    SELECT $1, g.consumer_group, m.uuid, m.payload, m.metadata FROM msgs m CROSS JOIN groups g
    WHERE g.consumer_group <> ALL ($6::text[])
    ORDER BY m.ord, g.consumer_group
    RETURNING 1
), unrouted AS (
    INSERT INTO pgsaga_dead_letters (uuid, topic, consumer_group, handler, payload, metadata, reason, attempts, created_at)
    SELECT m.uuid, $1, '', '', m.payload,
        pgsaga_dead_letter_metadata(m.metadata, $1, '', '', 'no consumer group subscribes to topic ' || $1, 0),
        'no consumer group subscribes to topic ' || $1, 0, clock_timestamp()
    FROM msgs m WHERE NOT EXISTS (SELECT FROM groups) AND cardinality($6::text[]) = 0
    ORDER BY m.ord
    RETURNING 1
)
SELECT pg_notify($5, $1) WHERE $5 <> '' AND EXISTS (SELECT FROM queued)`

	// publishManySQL is publishSQL for the messages a delivery batch
	// published, to any topics (see publishWrite): row by row ($1 topic,
	// $2 uuid, $3 payload, $4 metadata, $5 the groups that handled it in
	// process as a JSON array, $6 the wake-up channel), queued in the order
	// they were published for every group of their topic that did not
	// handle them, dead-lettered when no group subscribes to their topic
	// and none handled them; one wake-up a topic.
	publishManySQL = `WITH msgs AS (
    SELECT * FROM unnest($1::text[], $2::text[], $3::bytea[], $4::jsonb[], $5::jsonb[], $6::text[])
        WITH ORDINALITY AS m(topic, uuid, payload, metadata, skip, channel, ord)
), queued AS (
    INSERT INTO pgsaga_queue (topic, consumer_group, uuid, payload, metadata)
    SELECT m.topic, g.consumer_group, m.uuid, m.payload, m.metadata
    FROM msgs m JOIN pgsaga_subscriptions g ON g.topic = m.topic
    WHERE NOT (m.skip ? g.consumer_group)
    ORDER BY m.ord, g.consumer_group
    RETURNING topic
), unrouted AS (
    INSERT INTO pgsaga_dead_letters (uuid, topic, consumer_group, handler, payload, metadata, reason, attempts, created_at)
    SELECT m.uuid, m.topic, '', '', m.payload,
        pgsaga_dead_letter_metadata(m.metadata, m.topic, '', '', 'no consumer group subscribes to topic ' || m.topic, 0),
        'no consumer group subscribes to topic ' || m.topic, 0, clock_timestamp()
    FROM msgs m
    WHERE jsonb_array_length(m.skip) = 0 AND NOT EXISTS (SELECT FROM pgsaga_subscriptions g WHERE g.topic = m.topic)
    ORDER BY m.ord
    RETURNING 1
)
SELECT pg_notify(w.channel, w.topic)
FROM (SELECT DISTINCT q.topic, m.channel FROM queued q JOIN msgs m ON m.topic = q.topic WHERE m.channel <> '') AS w`

	// claimSQL opens a delivery batch: it bounds the transaction's
	// statements, lock waits and idle time (set_config local to the
	// transaction), claims up to $6 available messages of the group ($1
	// topic, $2 group) and, if it claimed any, arms the commit guard (see
	// migrations/00008): the batch cannot commit until the consumer allows
	// it, at its end, knowing that no attempt is open. It skips messages other
	// consumers hold. With none, it returns one sentinel row (id -1) saying
	// how many seconds until the group's next message becomes available, if
	// one waits (next_in: measured by the server's clock, the consumer's
	// may differ), and whether available messages are held by other
	// consumers (held): the consumer sleeps until the next one is due, or
	// looks again soon if others hold some (their transaction may end
	// without handling them, if their process dies), unless woken earlier.
	// Every row carries the server's clock (db_now): the batch's attempts
	// read the database's time from it (DBNow) without a statement of
	// their own. $3, $4, $5: statement, lock and idle timeouts in
	// milliseconds. From
	// PostgreSQL 14 on, the server also checks every second, while a
	// statement runs, that the consumer is still connected, so a killed
	// worker's batch is rolled back, and its messages freed, at once rather
	// than when its running statement ends.
	claimSQL = `WITH settings AS (
    SELECT set_config('statement_timeout', $3, true), set_config('lock_timeout', $4, true),
        set_config('idle_in_transaction_session_timeout', $5, true), set_config('pgsaga.commit_ok', 'off', true),
        CASE WHEN current_setting('server_version_num')::int >= 140000
            THEN set_config('client_connection_check_interval', '1000', true) END
), batch AS (
    SELECT id, uuid, payload, metadata, attempts FROM pgsaga_queue
    WHERE topic = $1 AND consumer_group = $2 AND available_at <= now()
    ORDER BY available_at, id
    LIMIT $6
    FOR UPDATE SKIP LOCKED
), guard AS (
    INSERT INTO pg_temp.pgsaga_commit_guard SELECT 1 FROM settings WHERE EXISTS (SELECT FROM batch)
)
SELECT id, uuid, payload, metadata, attempts, NULL::float8 AS next_in, false AS held, clock_timestamp() AS db_now FROM batch
UNION ALL
SELECT -1, '', NULL, NULL, 0,
    (SELECT extract(epoch FROM min(available_at) - now())::float8 FROM pgsaga_queue
        WHERE topic = $1 AND consumer_group = $2 AND available_at > now()),
    EXISTS (SELECT FROM pgsaga_queue WHERE topic = $1 AND consumer_group = $2 AND available_at <= now()),
    clock_timestamp()
WHERE NOT EXISTS (SELECT FROM batch)`

	// beginOwnSQL opens a transaction of the transport's own (HandleInTx):
	// the same bounds and guard as a delivery batch, no claim; it returns
	// the server's clock (see DBNow).
	beginOwnSQL = `WITH settings AS (
    SELECT set_config('statement_timeout', $1, true), set_config('lock_timeout', $2, true),
        set_config('idle_in_transaction_session_timeout', $3, true), set_config('pgsaga.commit_ok', 'off', true),
        CASE WHEN current_setting('server_version_num')::int >= 140000
            THEN set_config('client_connection_check_interval', '1000', true) END
), guard AS (
    INSERT INTO pg_temp.pgsaga_commit_guard SELECT 1 FROM settings
)
SELECT clock_timestamp()`

	// restoreLockTimeoutSQL sets a delivery transaction's lock timeout back
	// to the transport's after a statement that set its own (a batch's
	// claim of its keys).
	restoreLockTimeoutSQL = `SELECT set_config('lock_timeout', $1, true) AS pgsaga_restore_lock_timeout`

	// boundWaitSQL bounds the lock waits and statements of execWaiting's
	// implicit transaction (its column names tell it apart in
	// pg_stat_statements, which replaces the setting names by parameters).
	boundWaitSQL = `SELECT set_config('lock_timeout', $1, true) AS pgsaga_lock_timeout, set_config('statement_timeout', $2, true) AS pgsaga_statement_timeout`

	// installGuardSQL creates the commit guard of a connection, once: a
	// temporary table emptied at every commit whose deferred constraint
	// trigger (pgsaga_commit_guard, migrations/00008) refuses a commit that
	// pgsaga did not allow.
	installGuardSQL = `DO $$BEGIN
    IF to_regclass('pg_temp.pgsaga_commit_guard') IS NULL THEN
        CREATE TEMPORARY TABLE pgsaga_commit_guard (armed integer) ON COMMIT DELETE ROWS;
        CREATE CONSTRAINT TRIGGER pgsaga_commit_guard AFTER INSERT ON pgsaga_commit_guard
            DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION pgsaga_commit_guard();
    END IF;
END$$`

	// Attempt boundaries. An attempt runs in a savepoint, opened ahead in
	// the pipeline of the step before it where possible. A rollback runs
	// without parameters in one round trip (simple protocol): it must work
	// in a failed transaction, where nothing can be prepared.
	openAttemptSQL     = `SAVEPOINT pgsaga_attempt`
	releaseAttemptSQL  = `RELEASE SAVEPOINT pgsaga_attempt`
	rollbackAttemptSQL = `ROLLBACK TO SAVEPOINT pgsaga_attempt; RELEASE SAVEPOINT pgsaga_attempt`

	// allowCommitSQL lets a delivery transaction commit (see the commit
	// guard); refuseCommitSQL makes it fail for certain. commitSQL allows
	// a batch's commit and runs the deferred checks (constraints declared
	// DEFERRABLE INITIALLY DEFERRED, the guard) at once, so that what
	// would fail the commit fails this statement.
	allowCommitSQL = `SELECT set_config('pgsaga.commit_ok', 'on', true)`
	commitSQL      = allowCommitSQL + `; ` + checkConstraintsSQL
	// checkConstraintsSQL checks the deferred constraints now, so that a
	// violation fails it, where the consumer learns of it.
	checkConstraintsSQL = `SET CONSTRAINTS ALL IMMEDIATE`
	refuseCommitSQL     = `DO $$BEGIN RAISE EXCEPTION 'pgsaga: delivery batch abandoned with an attempt open; it will be delivered again'; END$$`

	// ackSQL removes a handled message ($1) from its queue, with the
	// attempt that handled it.
	ackSQL = `DELETE FROM pgsaga_queue WHERE id = $1`

	// ackManySQL deletes the messages a batch delivered (see ackWrite).
	ackManySQL = `DELETE FROM pgsaga_queue WHERE id = ANY ($1::bigint[])`

	// rescheduleSQL records failed attempt $2 of message $1 and makes it
	// available again after the backoff ($3 seconds); $4 the reason. The
	// attempt count guards against recording one attempt twice (a failure
	// recorded after its batch rolled back, while another consumer has
	// recorded it meanwhile).
	rescheduleSQL = `UPDATE pgsaga_queue SET attempts = $2, available_at = clock_timestamp() + make_interval(secs => $3), last_error = $4
WHERE id = $1 AND attempts < $2`

	// parkManySQL hands messages back while their handlers' calls run (see
	// Await and parkWrite), or untouched (HandBack), a row each of ids $1:
	// available again after $2 seconds, unless woken earlier, with the
	// count ($3) of awaits or hand-backs in the metadata under the key $5
	// and $4 as the last error. No attempt is counted.
	parkManySQL = `UPDATE pgsaga_queue AS q SET available_at = clock_timestamp() + make_interval(secs => p.secs),
    metadata = CASE WHEN jsonb_typeof(q.metadata) = 'object' THEN q.metadata ELSE '{}'::jsonb END
        || jsonb_build_object(p.counter, p.count),
    last_error = p.reason
FROM unnest($1::bigint[], $2::float8[], $3::text[], $4::text[], $5::text[]) AS p(id, secs, count, reason, counter)
WHERE q.id = p.id`

	// wakeSQL makes message $1, parked while its handler's call ran, available
	// at once and wakes its topic's consumers (channel $3, if any), unless
	// an attempt of it has been recorded since it was parked with $2 failed
	// attempts (its park ran out and another consumer took it): that
	// attempt's backoff stands.
	wakeSQL = `WITH woken AS (
    UPDATE pgsaga_queue SET available_at = clock_timestamp()
    WHERE id = $1 AND attempts = $2
    RETURNING topic
)
SELECT w.topic FROM woken w LEFT JOIN LATERAL (SELECT pg_notify($3, w.topic) WHERE $3 <> '') n ON true`

	// wakeTopicSQL wakes the consumers of topic $2 (channel $1, if any).
	wakeTopicSQL = `SELECT pg_notify($1, $2) WHERE $1 <> ''`

	// deadLetterSQL moves message $1 from its queue to the dead letters
	// after attempt $4 (guarded as in rescheduleSQL). $2 handler, $3
	// reason.
	deadLetterSQL = `WITH dead AS (
    DELETE FROM pgsaga_queue WHERE id = $1 AND attempts < $4
    RETURNING *
)
INSERT INTO pgsaga_dead_letters (uuid, topic, consumer_group, handler, payload, metadata, reason, attempts, created_at)
SELECT uuid, topic, consumer_group, $2, payload,
    pgsaga_dead_letter_metadata(metadata, topic, consumer_group, $2, $3, $4), $3, $4, created_at
FROM dead`

	// deadLetterMessageSQL stores a message that was not queued (HandleInTx)
	// as a dead letter. $1 uuid, $2 topic, $3 group, $4 handler, $5
	// payload, $6 metadata, $7 reason, $8 attempts.
	deadLetterMessageSQL = `INSERT INTO pgsaga_dead_letters (uuid, topic, consumer_group, handler, payload, metadata, reason, attempts, created_at)
VALUES ($1, $2, $3, $4, $5, pgsaga_dead_letter_metadata($6::jsonb, $2, $3, $4, $7, $8), $7, $8, clock_timestamp())`

	// agreeSQL records a setting every process must share ($1 name, $2
	// value), unless one is recorded, and returns the recorded value.
	agreeSQL = `WITH recorded AS (
    INSERT INTO pgsaga_settings (name, value) VALUES ($1, $2) ON CONFLICT (name) DO NOTHING RETURNING value
)
SELECT value FROM recorded UNION ALL SELECT value FROM pgsaga_settings WHERE name = $1`

	// subscribeSQL records that a consumer group reads a topic.
	subscribeSQL = `INSERT INTO pgsaga_subscriptions (topic, consumer_group) VALUES ($1, $2)
ON CONFLICT (topic, consumer_group) DO NOTHING`

	// seenSQL records consumer groups ($1 topics, $2 groups, pairwise) as
	// running now: a router's start and heartbeat.
	seenSQL = `INSERT INTO pgsaga_subscriptions AS s (topic, consumer_group, last_seen_at)
SELECT t, g, clock_timestamp() FROM unnest($1::text[], $2::text[]) AS u(t, g)
ON CONFLICT (topic, consumer_group) DO UPDATE SET last_seen_at = excluded.last_seen_at`

	// groupsSQL lists every consumer group of every topic with what waits
	// for it: all its queued messages, those failed before, those not
	// available yet (a backoff, a park), the oldest's publication time.
	groupsSQL = `SELECT s.topic, s.consumer_group, s.created_at, s.last_seen_at,
    count(q.id), count(q.id) FILTER (WHERE q.attempts > 0), count(q.id) FILTER (WHERE q.available_at > now()),
    min(q.created_at), clock_timestamp()
FROM pgsaga_subscriptions s
LEFT JOIN pgsaga_queue q ON q.topic = s.topic AND q.consumer_group = s.consumer_group
GROUP BY s.topic, s.consumer_group, s.created_at, s.last_seen_at
ORDER BY s.topic, s.consumer_group`

	// dropGroupSQL forgets a consumer group of a topic and its queue.
	dropGroupSQL = `WITH gone AS (
    DELETE FROM pgsaga_subscriptions WHERE topic = $1 AND consumer_group = $2
)
DELETE FROM pgsaga_queue WHERE topic = $1 AND consumer_group = $2`

	// deadLettersWaitingSQL counts the dead letters not replayed, by topic.
	deadLettersWaitingSQL = `SELECT topic, count(*) FROM pgsaga_dead_letters WHERE replayed_at IS NULL GROUP BY topic`

	// lockDeadLetterSQL locks dead letter $1 for its replay.
	lockDeadLetterSQL = `SELECT topic, consumer_group, handler, replayed_at FROM pgsaga_dead_letters WHERE id = $1 FOR UPDATE`

	// replayDeadLetterSQL queues dead letter $1 again, for the group that
	// gave up on it if it still reads the topic, or for every group that
	// reads the topic now if none read it when it was published; marks it
	// replayed (the caller rolls back if it went nowhere); wakes the topic (channel $2, if any);
	// and returns how many queues it went to. Its metadata loses the dead
	// letter's entries and gains where it came from.
	replayDeadLetterSQL = `WITH dl AS (
    SELECT * FROM pgsaga_dead_letters WHERE id = $1
), groups AS (
    SELECT s.consumer_group FROM pgsaga_subscriptions s, dl
    WHERE s.topic = dl.topic AND (dl.consumer_group = '' OR s.consumer_group = dl.consumer_group)
), queued AS (
    INSERT INTO pgsaga_queue (topic, consumer_group, uuid, payload, metadata)
    SELECT dl.topic, g.consumer_group, dl.uuid, dl.payload,
        CASE WHEN jsonb_typeof(dl.metadata) = 'object' THEN
            coalesce((SELECT jsonb_object_agg(k, v) FROM jsonb_each(dl.metadata) AS e(k, v) WHERE k NOT LIKE 'dead\_letter\_%'), '{}'::jsonb)
                || jsonb_build_object('` + ReplayedDeadLetter + `', dl.id::text)
        ELSE dl.metadata END
    FROM dl, groups g
    RETURNING topic
), marked AS (
    UPDATE pgsaga_dead_letters SET replayed_at = clock_timestamp()
    WHERE id = $1
)
SELECT count(*)::int FROM queued LEFT JOIN LATERAL (SELECT pg_notify($2, queued.topic) WHERE $2 <> '') n ON true`

	// deadLettersSQL lists dead letters, newest last, optionally of one
	// topic ($1 = '' for all), after id $2, at most $3, reading of each a
	// bounded part: the payload's first $4 bytes and its size, the reason's
	// first $5 characters and its length, and the metadata only if its text
	// is at most $5 bytes (else NULL; its size either way), so that a listing's memory
	// is bounded by its page size whatever the messages hold.
	deadLettersSQL = `SELECT id, uuid, topic, consumer_group, handler,
    substring(payload FROM 1 FOR $4), coalesce(octet_length(payload), 0),
    CASE WHEN coalesce(octet_length(metadata::text), 0) <= $5 THEN coalesce(metadata, 'null'::jsonb) END,
    coalesce(octet_length(metadata::text), 0),
    left(reason, $5), length(reason), attempts, created_at, dead_at, replayed_at, clock_timestamp()
FROM pgsaga_dead_letters
WHERE ($1 = '' OR topic = $1) AND id > $2
ORDER BY id
LIMIT $3`

	// deadLetterByIDSQL reads dead letter $1 whole.
	deadLetterByIDSQL = `SELECT id, uuid, topic, consumer_group, handler, payload, coalesce(octet_length(payload), 0),
    coalesce(metadata, 'null'::jsonb), coalesce(octet_length(metadata::text), 0),
    reason, length(reason), attempts, created_at, dead_at, replayed_at, clock_timestamp()
FROM pgsaga_dead_letters
WHERE id = $1`
)

// waitingHereSQL says whether message $2 of topic $1 still waits in this
// database: queued for the relay to a broker; or, on a topic the relay
// does not read, queued untouched (no attempt recorded, not parked by an
// awaited call) for every local group that reads the topic (at least
// one). Each probe is an index lookup by UUID (pgsaga_queue_uuid_idx).
const waitingHereSQL = `SELECT EXISTS (
        SELECT FROM pgsaga_queue WHERE uuid = $2 AND topic = $1 AND consumer_group = '` + RelayGroup + `')
    OR (NOT EXISTS (SELECT FROM pgsaga_subscriptions WHERE topic = $1 AND consumer_group = '` + RelayGroup + `')
        AND EXISTS (SELECT FROM pgsaga_subscriptions WHERE topic = $1 AND consumer_group <> '` + RelayGroup + `')
        AND NOT EXISTS (
            SELECT FROM pgsaga_subscriptions s
            WHERE s.topic = $1 AND s.consumer_group <> '` + RelayGroup + `'
              AND NOT EXISTS (
                SELECT FROM pgsaga_queue q
                WHERE q.uuid = $2 AND q.topic = $1 AND q.consumer_group = s.consumer_group AND q.attempts = 0
                  AND NOT coalesce(q.metadata ? '` + metaAwaited + `', false))))`
