-- Versioned domain events (docs/DESIGN.md, "Schema contract"): one row per event, streams versioned
-- from 1 without gaps.

-- +goose Up
CREATE TABLE domain_events (
    -- Global order of appends, for projections and rebuilds. Positions are
    -- assigned at insert, not commit: a follower must only read positions
    -- of transactions older than every running one (see transaction_id).
    position       bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    event_id       uuid        NOT NULL,
    stream_id      text        NOT NULL,
    version        integer     NOT NULL,
    event_type     text        NOT NULL,
    payload        jsonb       NOT NULL,
    -- correlation_id, causation_id, saga_id, idempotency_key.
    metadata       jsonb       NOT NULL DEFAULT '{}',
    recorded_at    timestamptz NOT NULL DEFAULT now(),
    transaction_id xid8        NOT NULL DEFAULT pg_current_xact_id(),
    CONSTRAINT domain_events_event_id_key UNIQUE (event_id),
    CONSTRAINT domain_events_stream_version_key UNIQUE (stream_id, version),
    CONSTRAINT domain_events_version_check CHECK (version > 0),
    CONSTRAINT domain_events_stream_check CHECK (length(stream_id) BETWEEN 1 AND 200)
);

-- +goose Down
DROP TABLE domain_events;
