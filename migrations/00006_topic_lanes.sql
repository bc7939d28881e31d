-- The lane count of every topic the transport created (see
-- transport.Config.Lanes): a topic spread over N lanes is stored in N
-- watermill tables, "<topic>.0" … "<topic>.<N-1>" (one table, named after the
-- topic, when N is 1). Changing a topic's count moves keys between lanes, so
-- the transport refuses it while the old lanes hold unconsumed messages.

-- +goose Up
CREATE TABLE pgsaga_topic_lanes (
    topic      text        PRIMARY KEY,
    lanes      integer     NOT NULL CHECK (lanes BETWEEN 1 AND 256),
    updated_at timestamptz NOT NULL DEFAULT clock_timestamp()
);

-- +goose Down
DROP TABLE pgsaga_topic_lanes;
