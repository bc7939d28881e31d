-- The orders sample's tables. Until pgsaga's own migrations stopped
-- creating them, its version 3 did, with this definition: IF NOT EXISTS
-- adopts them, with their rows, in a database migrated then.

-- The orders domain: customers who may place orders, and the order read
-- model kept by the projection of order streams ("order-<id>").

-- +goose Up
CREATE TABLE IF NOT EXISTS customers (
    customer_id text        PRIMARY KEY,
    name        text        NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE IF NOT EXISTS order_views (
    order_id      uuid        PRIMARY KEY,
    customer_id   text        NOT NULL,
    amount_cents  bigint      NOT NULL,
    status        text        NOT NULL,
    -- The stream version this row reflects; an update applies only when
    -- newer, so duplicated and reordered events cannot move it back.
    version       integer     NOT NULL,
    placed_at     timestamptz NOT NULL,
    confirmed_at  timestamptz,
    cancelled_at  timestamptz,
    cancelled_by  text,
    cancel_reason text,
    updated_at    timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT order_views_status_check CHECK (status IN ('placed', 'confirmed', 'cancelled'))
);

CREATE INDEX IF NOT EXISTS order_views_customer_idx ON order_views (customer_id);

-- +goose Down
DROP TABLE IF EXISTS order_views;
DROP TABLE IF EXISTS customers;
