-- The relay to a message broker (steps/broker) reads the queue of its
-- consumer group, pgsaga.relay, in the order the messages were queued (id
-- order), one batch at a time from the head. The claim index orders a
-- group by availability first; this one keeps the relay's head a short
-- index scan away however long the queue grows while the broker is down,
-- and costs nothing for the rows of other groups. (Built in the
-- migration's transaction, as indexes were until migration 18: it holds
-- writes to the queue while it reads the queue once.)

-- +goose Up
CREATE INDEX pgsaga_queue_relay_idx ON pgsaga_queue (topic, id) WHERE consumer_group = 'pgsaga.relay';

-- +goose Down
DROP INDEX pgsaga_queue_relay_idx;
