-- The idempotency key store (docs/DESIGN.md, "Schema contract"). One row per (scope, key): the first
-- request to insert it executes; every later one replays what it stored.

-- +goose Up
CREATE TABLE idempotency_keys (
    scope          text        NOT NULL,
    key            text        NOT NULL,
    -- SHA-256 of the request the key was first used with; a different request
    -- under the same key is rejected, never replayed.
    request_hash   bytea       NOT NULL,
    status         text        NOT NULL DEFAULT 'pending',
    -- The stored outcome: a code (an HTTP status, or a reply kind) and a body,
    -- plus metadata needed to replay it faithfully (headers, reply message id).
    response_code  integer,
    response       bytea,
    response_meta  jsonb,
    -- How many executions were started under this key (first claim + takeovers).
    attempts       integer     NOT NULL DEFAULT 1,
    -- Lease of a two-phase step whose pending claim was committed before an
    -- external call: only the holder of lease_token may complete it, and only
    -- after locked_until may another worker take it over.
    locked_until   timestamptz,
    lease_token    uuid,
    created_at     timestamptz NOT NULL DEFAULT now(),
    updated_at     timestamptz NOT NULL DEFAULT now(),
    completed_at   timestamptz,
    PRIMARY KEY (scope, key),
    CONSTRAINT idempotency_keys_status_check
        CHECK (status IN ('pending', 'completed', 'failed')),
    CONSTRAINT idempotency_keys_finished_check
        CHECK ((status = 'pending') = (completed_at IS NULL)),
    CONSTRAINT idempotency_keys_scope_check CHECK (length(scope) BETWEEN 1 AND 200),
    CONSTRAINT idempotency_keys_key_check CHECK (length(key) BETWEEN 1 AND 255)
);

-- The retention reaper walks finished keys by age.
CREATE INDEX idempotency_keys_finished_idx
    ON idempotency_keys (completed_at)
    WHERE status <> 'pending';

-- Operators and sweepers look for pending keys whose lease ran out.
CREATE INDEX idempotency_keys_pending_idx
    ON idempotency_keys (locked_until)
    WHERE status = 'pending';

-- +goose Down
DROP TABLE idempotency_keys;
