package transport

// Statements the transport runs itself. Topic and consumer-group table
// statements come from watermill-sql's schema and offsets adapters.
const (
	// beginAttemptSQL opens the savepoint of one delivery attempt and bounds
	// its statements and lock waits; %[1]s and %[2]s are the timeouts in
	// milliseconds, formatted once from the validated Config. One round trip
	// (simple protocol).
	beginAttemptSQL = "SAVEPOINT pgsaga_attempt; SET LOCAL statement_timeout = %[1]s; SET LOCAL lock_timeout = %[2]s"

	// beginOwnSQL bounds a transaction the transport opened itself.
	beginOwnSQL = "SET LOCAL statement_timeout = %[1]s; SET LOCAL lock_timeout = %[2]s"

	// ackAttemptSQL ends a successful attempt: it stores the message's
	// offset for the consumer group, in the attempt, so the work and the ack
	// commit together even if the subscriber never sees the ack (it may stop
	// first when the router closes), then keeps the attempt's work. The
	// offset only moves forward. %[1]s offsets table, %[2]s offset, %[3]s
	// transaction id, %[4]s quoted consumer group.
	ackAttemptSQL = `UPDATE %[1]s SET offset_acked = %[2]s, last_processed_transaction_id = '%[3]s'::xid8
WHERE consumer_group = %[4]s
  AND (last_processed_transaction_id, offset_acked) < ('%[3]s'::xid8, %[2]s);
RELEASE SAVEPOINT pgsaga_attempt`

	// ackBatchSQL is the subscriber's ack of a batch prefix; like
	// ackAttemptSQL it never moves an offset backwards. %s offsets table.
	ackBatchSQL = `INSERT INTO %s AS o (offset_acked, last_processed_transaction_id, consumer_group)
VALUES ($1, $2, $3)
ON CONFLICT (consumer_group) DO UPDATE SET
	offset_acked = excluded.offset_acked,
	last_processed_transaction_id = excluded.last_processed_transaction_id
WHERE (o.last_processed_transaction_id, o.offset_acked) < (excluded.last_processed_transaction_id, excluded.offset_acked)`

	// rollbackAttemptSQL discards the attempt's work and revives the batch
	// transaction if a statement of the attempt failed.
	rollbackAttemptSQL = "ROLLBACK TO SAVEPOINT pgsaga_attempt; RELEASE SAVEPOINT pgsaga_attempt"

	// doomBatchSQL makes the batch transaction fail for certain, so that the
	// subscriber cannot store its offset and rolls the whole batch back.
	doomBatchSQL = `DO $$BEGIN RAISE EXCEPTION 'pgsaga: delivery batch abandoned; it will be redelivered'; END$$`

	// lockTopicsSQL serialises CreateTopics across processes.
	lockTopicsSQL = "SELECT pg_advisory_xact_lock($1)"
)

// topicsLockID is the advisory lock key of CreateTopics ("pgsaga-topics").
const topicsLockID int64 = 0x7067736167610002
