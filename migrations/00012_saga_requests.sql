-- Operators' requests to retry or cancel a saga (pgsaga retry, pgsaga
-- cancel): recorded and published in one transaction by a tool that runs no
-- saga, carried out once by a worker that knows the saga's definition, in
-- the delivery's transaction, which records the outcome here.

-- +goose Up
CREATE TABLE saga_requests (
    id           uuid        PRIMARY KEY,
    saga_id      uuid        NOT NULL,
    kind         text        NOT NULL CHECK (kind IN ('retry', 'cancel')),
    reason       text        NOT NULL DEFAULT '',
    requested_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    done_at      timestamptz,
    -- 'done', or 'refused' (the saga was in no state to do it: detail says why)
    outcome      text        CHECK (outcome IN ('done', 'refused')),
    detail       text        NOT NULL DEFAULT ''
);
CREATE INDEX saga_requests_saga_idx ON saga_requests (saga_id, requested_at);

-- +goose Down
DROP TABLE saga_requests;
