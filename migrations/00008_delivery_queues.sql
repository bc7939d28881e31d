-- Delivery by queue (see docs/DESIGN.md, "Delivery"): every message
-- published to a topic becomes one row per consumer group subscribed to the
-- topic, claimed with FOR UPDATE SKIP LOCKED and deleted in the transaction
-- that handles it. Nothing waits for transactions older than a message, so a
-- long transaction elsewhere on the server delays no delivery.

-- +goose Up

-- Settings every process on this database must share, recorded by the first
-- that starts (the notification channel of wake-ups).
CREATE TABLE pgsaga_settings (
    name       text        PRIMARY KEY,
    value      text        NOT NULL,
    updated_at timestamptz NOT NULL DEFAULT clock_timestamp()
);

-- The consumer groups of each topic: a publish fans out to every group
-- recorded here when it runs. Routers record their groups when they
-- subscribe; Transport.Subscribe records them ahead of time.
CREATE TABLE pgsaga_subscriptions (
    topic          text        NOT NULL,
    consumer_group text        NOT NULL,
    created_at     timestamptz NOT NULL DEFAULT clock_timestamp(),
    -- When a process last subscribed this group.
    last_seen_at   timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (topic, consumer_group)
);

-- The queues: one row per message and consumer group, deleted when the
-- group has handled it.
CREATE TABLE pgsaga_queue (
    id             bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    topic          text        NOT NULL,
    consumer_group text        NOT NULL,
    uuid           text        NOT NULL,
    payload        bytea,
    metadata       jsonb,
    created_at     timestamptz NOT NULL DEFAULT clock_timestamp(),
    -- A message is claimed only from this time on: its publication, or the
    -- end of the backoff after a failed attempt.
    available_at   timestamptz NOT NULL DEFAULT clock_timestamp(),
    -- Failed attempts so far, and why the last one failed.
    attempts       integer     NOT NULL DEFAULT 0,
    last_error     text
);

-- A consumer claims its group's available messages in this order.
CREATE INDEX pgsaga_queue_claim_idx ON pgsaga_queue (topic, consumer_group, available_at, id);

-- Messages no consumer could handle, or that no consumer group wanted, kept
-- for operators with the reason.
CREATE TABLE pgsaga_dead_letters (
    id             bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    uuid           text        NOT NULL,
    topic          text        NOT NULL,
    -- '' when no consumer group subscribed to the topic at publication.
    consumer_group text        NOT NULL,
    handler        text        NOT NULL,
    payload        bytea,
    -- The message's metadata, with the dead_letter_* entries added when it
    -- is a JSON object.
    metadata       jsonb,
    reason         text        NOT NULL,
    attempts       integer     NOT NULL,
    -- When the message was published.
    created_at     timestamptz NOT NULL,
    dead_at        timestamptz NOT NULL DEFAULT clock_timestamp()
);

CREATE INDEX pgsaga_dead_letters_topic_idx ON pgsaga_dead_letters (topic, dead_at);

-- A dead letter's metadata: the message's, with the dead_letter_* entries
-- readers of earlier releases know (all strings, as Watermill metadata is).
-- Metadata that is not a JSON object is kept as it is.
-- +goose StatementBegin
CREATE FUNCTION pgsaga_dead_letter_metadata(md jsonb, topic text, consumer_group text, handler text, reason text, attempts integer)
RETURNS jsonb LANGUAGE sql VOLATILE AS $$
    SELECT CASE WHEN md IS NULL OR jsonb_typeof(md) = 'object' THEN
        coalesce(md, '{}'::jsonb) || jsonb_build_object(
            'dead_letter_reason', reason,
            'dead_letter_attempts', attempts::text,
            'dead_letter_topic', topic,
            'dead_letter_handler', handler,
            'dead_letter_group', consumer_group,
            'dead_letter_at', to_char(clock_timestamp() AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"'))
    ELSE md END
$$;
-- +goose StatementEnd

-- The commit guard of delivery transactions. Each one that claimed messages
-- inserts a row into a temporary table whose constraint trigger runs this
-- function at commit; it refuses unless pgsaga allowed the commit
-- (pgsaga.commit_ok = 'on'), which the transport does only at the end of a
-- batch with no attempt open. A handler that commits its attempt's
-- transaction itself (COMMIT, END) therefore commits nothing, and neither
-- does a subscriber that gives up on a running attempt.
-- +goose StatementBegin
CREATE FUNCTION pgsaga_commit_guard() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF current_setting('pgsaga.commit_ok', true) IS DISTINCT FROM 'on' THEN
        RAISE EXCEPTION 'pgsaga: a delivery transaction cannot commit while an attempt is open; nothing of it is kept'
            USING ERRCODE = 'invalid_transaction_state',
                  HINT = 'A step handler must not end its transaction (COMMIT, END, ROLLBACK); use transport.Savepoint for nested rollback. '
                      'SET CONSTRAINTS ALL IMMEDIATE runs this check too: name the constraints to check instead.';
    END IF;
    RETURN NULL;
END
$$;
-- +goose StatementEnd

-- Upgrade: move what the offset-log topics of earlier releases still held
-- for each consumer group into the queues, and their dead letters into
-- pgsaga_dead_letters, so that no message in flight is lost. The old
-- watermill_* tables are left as they are; drop them once this release runs.
-- +goose StatementBegin
CREATE FUNCTION pg_temp.pgsaga_jsonb(j text) RETURNS jsonb LANGUAGE plpgsql AS $$
BEGIN
    RETURN j::jsonb;
EXCEPTION WHEN OTHERS THEN
    RETURN jsonb_build_object('_pgsaga_unreadable_metadata', true);
END
$$;
-- +goose StatementEnd

-- +goose StatementBegin
DO $$
DECLARE
    t     record;
    g     record;
    lane  text;
    msgs  regclass;
    offs  regclass;
BEGIN
    IF to_regclass('pgsaga_topic_lanes') IS NULL THEN
        RETURN;
    END IF;
    FOR t IN SELECT topic, lanes FROM pgsaga_topic_lanes ORDER BY topic LOOP
        FOR i IN 0 .. t.lanes - 1 LOOP
            lane := CASE WHEN t.lanes = 1 THEN t.topic ELSE t.topic || '.' || i END;
            msgs := to_regclass(format('%I', 'watermill_' || lane));
            offs := to_regclass(format('%I', 'watermill_offsets_' || lane));
            CONTINUE WHEN msgs IS NULL;
            IF t.topic = 'pgsaga_dead_letters' THEN
                EXECUTE format($q$
                    INSERT INTO pgsaga_dead_letters (uuid, topic, consumer_group, handler, payload, metadata, reason, attempts, created_at)
                    SELECT m.uuid, coalesce(md->>'dead_letter_topic', ''), coalesce(md->>'dead_letter_group', ''),
                        coalesce(md->>'dead_letter_handler', ''), m.payload, md,
                        coalesce(md->>'dead_letter_reason', 'dead-lettered before the upgrade'),
                        coalesce(nullif(md->>'dead_letter_attempts', '')::int, 0), m.created_at
                    FROM %s m, LATERAL (SELECT pg_temp.pgsaga_jsonb(m.metadata::text) AS md) x
                    ORDER BY m.transaction_id, m."offset"$q$, msgs);
                CONTINUE;
            END IF;
            CONTINUE WHEN offs IS NULL;
            FOR g IN EXECUTE format('SELECT consumer_group, offset_acked, last_processed_transaction_id FROM %s', offs) LOOP
                INSERT INTO pgsaga_subscriptions (topic, consumer_group) VALUES (t.topic, g.consumer_group)
                ON CONFLICT DO NOTHING;
                EXECUTE format($q$
                    INSERT INTO pgsaga_queue (topic, consumer_group, uuid, payload, metadata, created_at)
                    SELECT $1, $2, m.uuid, m.payload, pg_temp.pgsaga_jsonb(m.metadata::text), m.created_at
                    FROM %s m
                    WHERE (m.transaction_id, m."offset") > ($3, $4)
                    ORDER BY m.transaction_id, m."offset"$q$, msgs)
                USING t.topic, g.consumer_group, g.last_processed_transaction_id, g.offset_acked;
            END LOOP;
        END LOOP;
    END LOOP;
    DROP TABLE pgsaga_topic_lanes;
END
$$;
-- +goose StatementEnd

-- +goose Down
DROP FUNCTION pgsaga_dead_letter_metadata(jsonb, text, text, text, text, integer);
DROP FUNCTION pgsaga_commit_guard();
DROP TABLE pgsaga_dead_letters;
DROP TABLE pgsaga_queue;
DROP TABLE pgsaga_subscriptions;
DROP TABLE pgsaga_settings;
CREATE TABLE pgsaga_topic_lanes (
    topic      text        PRIMARY KEY,
    lanes      integer     NOT NULL CHECK (lanes BETWEEN 1 AND 256),
    updated_at timestamptz NOT NULL DEFAULT clock_timestamp()
);
