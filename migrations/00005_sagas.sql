-- Saga instances (docs/DESIGN.md, "Schema contract") and their timelines.

-- +goose Up
CREATE TABLE saga_instances (
    id                 uuid        PRIMARY KEY,
    saga_type          text        NOT NULL,
    -- The definition version the instance started with; a process that does
    -- not know it reports the instance instead of driving it.
    definition_version integer     NOT NULL,
    status             text        NOT NULL,
    -- The saga's data, JSON, as the definition's type encodes it.
    data               jsonb       NOT NULL,
    -- The step whose command is in flight, and whether that command is the
    -- step's action or its compensation.
    current_step       integer     NOT NULL,
    phase              text        NOT NULL DEFAULT 'action',
    -- Sends of the in-flight command (re-sends on deadline use the same key).
    attempt            integer     NOT NULL DEFAULT 0,
    -- Bumped by operator retries: part of command keys after a retry, so a
    -- command whose failure was stored can be sent afresh.
    generation         integer     NOT NULL DEFAULT 0,
    -- Optimistic concurrency: bumped by every change.
    version            integer     NOT NULL DEFAULT 1,
    correlation_id     text,
    -- Why the saga compensated or failed.
    failure_reason     text,
    -- When the in-flight command is overdue; NULL when nothing is in flight.
    deadline_at        timestamptz,
    created_at         timestamptz NOT NULL DEFAULT clock_timestamp(),
    updated_at         timestamptz NOT NULL DEFAULT clock_timestamp(),
    finished_at        timestamptz,
    CONSTRAINT saga_instances_status_check
        CHECK (status IN ('running', 'compensating', 'completed', 'compensated', 'failed')),
    CONSTRAINT saga_instances_phase_check CHECK (phase IN ('action', 'compensation')),
    CONSTRAINT saga_instances_finished_check
        CHECK ((status IN ('completed', 'compensated', 'failed')) = (finished_at IS NOT NULL))
);

-- The sweeper looks for overdue commands.
CREATE INDEX saga_instances_deadline_idx ON saga_instances (deadline_at)
    WHERE status IN ('running', 'compensating');

-- Operators list instances by status and age.
CREATE INDEX saga_instances_status_idx ON saga_instances (status, updated_at);

-- Each instance's timeline: what was sent when, what came back, what was
-- compensated.
CREATE TABLE saga_history (
    saga_id    uuid        NOT NULL REFERENCES saga_instances ON DELETE CASCADE,
    seq        integer     NOT NULL,
    at         timestamptz NOT NULL DEFAULT clock_timestamp(),
    kind       text        NOT NULL,
    step       text,
    phase      text,
    attempt    integer,
    message_id text,
    detail     text,
    PRIMARY KEY (saga_id, seq)
);

-- +goose Down
DROP TABLE saga_history;
DROP TABLE saga_instances;
