package transport

// Statements the transport runs itself. Topic and consumer-group table
// statements come from watermill-sql's schema and offsets adapters.
const (
	// beginBatchSQL bounds the statements and lock waits of a delivery
	// batch's attempts (SET LOCAL at the top level lasts for the whole
	// transaction) and opens the savepoint of its first attempt; %[1]s and
	// %[2]s are the timeouts in milliseconds, formatted once from the
	// validated Config. One round trip (simple protocol).
	beginBatchSQL = "SET LOCAL statement_timeout = %[1]s; SET LOCAL lock_timeout = %[2]s; SAVEPOINT pgsaga_attempt"

	// openAttemptSQL opens the savepoint of an attempt when none is open.
	openAttemptSQL = "SAVEPOINT pgsaga_attempt"

	// beginOwnSQL bounds a transaction the transport opened itself.
	beginOwnSQL = "SET LOCAL statement_timeout = %[1]s; SET LOCAL lock_timeout = %[2]s"

	// keepAttemptSQL ends a successful attempt, after its deferred
	// statements: it keeps the attempt's work, stores the message's offset
	// for the consumer group in the same transaction, so the work and the
	// ack commit together even if the subscriber never sees the ack (it may
	// stop first when the router closes), and opens the savepoint of the
	// batch's next attempt ahead of time. The offset only moves forward. It
	// runs at the top level of the transaction, which holds the offset row's
	// lock (FOR UPDATE in the batch's poll): an update from inside the
	// savepoint would turn that lock into a MultiXact for every message.
	// %[1]s offsets table, %[2]s offset, %[3]s transaction id, %[4]s quoted
	// consumer group.
	keepAttemptSQL = `RELEASE SAVEPOINT pgsaga_attempt;
UPDATE %[1]s SET offset_acked = %[2]s, last_processed_transaction_id = '%[3]s'::xid8
WHERE consumer_group = %[4]s
  AND (last_processed_transaction_id, offset_acked) < ('%[3]s'::xid8, %[2]s);
SAVEPOINT pgsaga_attempt`

	// notifySQL wakes a topic's subscribers from a deferred publish: the
	// payload is the topic and the transaction's id, as insertNotifySQL's.
	notifySQL = `SELECT pg_notify($1, $2 || ' ' || pg_current_xact_id()::text)`

	// ackBatchSQL is the subscriber's ack of a batch prefix; like
	// ackAttemptSQL it never moves an offset backwards. %s offsets table.
	ackBatchSQL = `INSERT INTO %s AS o (offset_acked, last_processed_transaction_id, consumer_group)
VALUES ($1, $2, $3)
ON CONFLICT (consumer_group) DO UPDATE SET
	offset_acked = excluded.offset_acked,
	last_processed_transaction_id = excluded.last_processed_transaction_id
WHERE (o.last_processed_transaction_id, o.offset_acked) < (excluded.last_processed_transaction_id, excluded.offset_acked)`

	// rollbackAttemptSQL discards the attempt's work and revives the batch
	// transaction if a statement of the attempt failed. The savepoint stays
	// open for the next attempt.
	rollbackAttemptSQL = "ROLLBACK TO SAVEPOINT pgsaga_attempt"

	// doomBatchSQL makes the batch transaction fail for certain, so that the
	// subscriber cannot store its offset and rolls the whole batch back.
	doomBatchSQL = `DO $$BEGIN RAISE EXCEPTION 'pgsaga: delivery batch abandoned; it will be redelivered'; END$$`

	// insertNotifySQL wraps watermill-sql's insert (%[1]s) so that it also
	// notifies the topic's subscribers: channel $%[2]d, payload "<topic>
	// <xid>" with topic $%[3]d. pg_notify is delivered on commit only, and
	// PostgreSQL sends identical notifications of one transaction once.
	insertNotifySQL = `WITH inserted AS (%[1]s RETURNING transaction_id)
SELECT pg_notify($%[2]d, $%[3]d || ' ' || (SELECT transaction_id FROM inserted LIMIT 1)::text)`

	// selectBatchSQL is watermill-sql's batch query (the group's offset row
	// locked FOR UPDATE, messages past it below the visibility fence, in
	// order) with one addition: when there is no message it returns a
	// sentinel row instead, offset -1, whose metadata says whether messages
	// are waiting behind the fence: committed, visible to this snapshot, but
	// not below its xmin because an older transaction is still running.
	// Every such message is unconsumed (a group only ever passes messages
	// below the fence, and the fence only rises). The subscription's backoff
	// polls again soon when there are, and waits for a wake-up otherwise
	// (see pollState). OFFSET 0 keeps the filter apart from the ORDER BY … LIMIT,
	// as watermill-sql's subquery does, so the planner sorts the few rows
	// past the offset instead of walking the index from its start.
	// %[1]s offsets table, %[2]s messages table, %[3]d batch size.
	selectBatchSQL = `WITH last_processed AS (
    SELECT offset_acked, last_processed_transaction_id FROM %[1]s WHERE consumer_group = $1 FOR UPDATE
), batch AS (
    SELECT * FROM (
        SELECT "offset", transaction_id, uuid, payload, metadata FROM %[2]s
        WHERE ((transaction_id = (SELECT last_processed_transaction_id FROM last_processed)
                AND "offset" > (SELECT offset_acked FROM last_processed))
               OR transaction_id > (SELECT last_processed_transaction_id FROM last_processed))
          AND transaction_id < pg_snapshot_xmin(pg_current_snapshot())
        OFFSET 0
    ) AS m
    ORDER BY transaction_id, "offset"
    LIMIT %[3]d
)
SELECT "offset", transaction_id, uuid, payload, metadata FROM (
    SELECT * FROM batch
    UNION ALL
    SELECT -1, coalesce((SELECT last_processed_transaction_id FROM last_processed), '0'::xid8), '', NULL::bytea,
        json_build_object('fenced', EXISTS (
            SELECT FROM %[2]s WHERE transaction_id >= pg_snapshot_xmin(pg_current_snapshot())))
    WHERE NOT EXISTS (SELECT FROM batch)
) AS rows
ORDER BY transaction_id, "offset"`

	// lanesOfTopicSQL reads a topic's recorded lane count, locking it.
	lanesOfTopicSQL = `SELECT lanes FROM pgsaga_topic_lanes WHERE topic = $1 FOR UPDATE`

	// recordLanesSQL records a topic's lane count.
	recordLanesSQL = `INSERT INTO pgsaga_topic_lanes AS l (topic, lanes) VALUES ($1, $2)
ON CONFLICT (topic) DO UPDATE SET lanes = excluded.lanes, updated_at = clock_timestamp()`

	tableExistsSQL = `SELECT to_regclass($1) IS NOT NULL`

	// unconsumedSQL counts the messages of a physical topic that some
	// consumer group has not passed yet; with no consumer group, all of
	// them. %[1]s messages table, %[2]s offsets table.
	unconsumedSQL = `SELECT count(*) FROM %[1]s m
WHERE NOT EXISTS (SELECT FROM %[2]s)
   OR (m.transaction_id, m."offset") > (
        SELECT last_processed_transaction_id, offset_acked FROM %[2]s
        ORDER BY last_processed_transaction_id, offset_acked LIMIT 1)`

	// pruneSQL deletes up to $2 messages of one physical topic that every
	// consumer group has passed and that are older than $1 (an interval),
	// in position order; rows another pruner holds are skipped. With no
	// consumer group, "passed" has no row and nothing is deleted.
	// %[1]s messages table, %[2]s offsets table.
	pruneSQL = `WITH passed AS (
    SELECT last_processed_transaction_id AS xid, offset_acked AS off FROM %[2]s
    ORDER BY last_processed_transaction_id, offset_acked LIMIT 1
), doomed AS (
    SELECT m.ctid FROM %[1]s m, passed p
    WHERE (m.transaction_id, m."offset") <= (p.xid, p.off)
      AND m.created_at < localtimestamp - $1::interval
    ORDER BY m.transaction_id, m."offset"
    LIMIT $2
    FOR UPDATE OF m SKIP LOCKED
)
DELETE FROM %[1]s WHERE ctid IN (SELECT ctid FROM doomed)`

	// recordedTopicsSQL lists the topics CreateTopics recorded.
	recordedTopicsSQL = `SELECT topic, lanes FROM pgsaga_topic_lanes ORDER BY topic`

	// dropGroupSQL forgets a consumer group's position. %s offsets table.
	dropGroupSQL = `DELETE FROM %s WHERE consumer_group = $1`

	// lockTopicsSQL serialises CreateTopics across processes.
	lockTopicsSQL = "SELECT pg_advisory_xact_lock($1)"
)

// topicsLockID is the advisory lock key of CreateTopics ("pgsaga-topics").
const topicsLockID int64 = 0x7067736167610002
