-- Outages delay sagas; they do not give up on them (docs/DESIGN.md, "Deadlines
-- from departure"). A step's reply deadline runs from when its command left
-- this database, not from when it was queued: the sweeper asks the queue
-- whether the command in flight is still waiting here (for the relay to a
-- broker, or for every local consumer group of its topic) before it counts
-- the deadline as passed. What bounds a saga's whole wait is its own
-- deadline (expires_at).

-- +goose Up
ALTER TABLE saga_instances
    -- The command in flight: its topic and the message UUID of its latest
    -- send; NULL when nothing is in flight or for instances of earlier
    -- releases (their deadlines count from the send, as they did).
    ADD COLUMN command_topic   text,
    ADD COLUMN command_id      text,
    -- The sweeper found that command still waiting in this database when
    -- its deadline passed; once it has left, its deadline starts again.
    ADD COLUMN command_waiting boolean NOT NULL DEFAULT false,
    -- The saga's own deadline: a running saga still running then gives up
    -- on the action in flight and compensates. NULL: none.
    ADD COLUMN expires_at      timestamptz,
    -- The fingerprint of the step list the instance was started with
    -- (saga_definitions.fingerprint): a process whose definition of its
    -- version has other steps leaves it alone. NULL for instances of
    -- earlier releases.
    ADD COLUMN definition_fingerprint text;

-- The sweeper looks a command up by its UUID in the queues: the index,
-- pgsaga_queue_uuid_idx, is built CONCURRENTLY by migration 18 (it was
-- built here, holding every publish while it read the queue).

-- The step list each version of each saga definition was first started
-- with: a definition whose steps change without a new version would
-- misread the instances started by the old one, so a process that brings
-- it is refused at start while such instances are unfinished.
CREATE TABLE saga_definitions (
    saga_type   text        NOT NULL,
    version     integer     NOT NULL,
    -- sha256 of the step list (names, and which have an action and a
    -- compensation), hex.
    fingerprint text        NOT NULL,
    -- The step list itself, for the refusal to quote.
    steps       jsonb       NOT NULL,
    recorded_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (saga_type, version)
);

-- +goose Down
DROP TABLE saga_definitions;
DROP INDEX IF EXISTS pgsaga_queue_uuid_idx;
ALTER TABLE saga_instances
    DROP COLUMN command_topic,
    DROP COLUMN command_id,
    DROP COLUMN command_waiting,
    DROP COLUMN expires_at,
    DROP COLUMN definition_fingerprint;
