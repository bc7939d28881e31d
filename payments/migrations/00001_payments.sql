-- The payments sample's tables. Until pgsaga's own migrations stopped
-- creating them, its version 4 did, with this definition: IF NOT EXISTS
-- adopts them, with their rows, in a database migrated then.

-- The payments domain: accounts and their ledger. An account's balance is
-- the sum of its postings; nothing else stores it.

-- +goose Up
CREATE TABLE IF NOT EXISTS accounts (
    account_id  text        PRIMARY KEY,
    -- Bumped by every posting: writers lock the account by updating it, and
    -- under REPEATABLE READ a concurrent posting surfaces as a serialization
    -- failure instead of an unseen balance change.
    version     bigint      NOT NULL DEFAULT 0,
    created_at  timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE IF NOT EXISTS account_postings (
    account_id  text        NOT NULL REFERENCES accounts,
    -- The domain event that made the posting.
    event_id    uuid        NOT NULL,
    delta_cents bigint      NOT NULL,
    -- The order a charge or refund belongs to; NULL for deposits.
    order_id    uuid,
    kind        text        NOT NULL,
    -- The payment gateway's id of the charge or refund, once known.
    reference   text,
    -- The idempotency key of the command that made the posting.
    request_key text,
    created_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (account_id, event_id),
    -- A charge is posted (reserved) before the gateway is called; a void
    -- gives it back when the gateway declines; a refund returns a captured
    -- charge.
    CONSTRAINT account_postings_kind_check CHECK (kind IN ('deposit', 'charge', 'void', 'refund')),
    CONSTRAINT account_postings_sign_check CHECK (
        (kind = 'charge' AND delta_cents < 0) OR (kind IN ('deposit', 'void', 'refund') AND delta_cents > 0)),
    CONSTRAINT account_postings_order_check CHECK ((kind = 'deposit') = (order_id IS NULL))
);

-- An order is charged at most once, voided at most once, refunded at most once.
CREATE UNIQUE INDEX IF NOT EXISTS account_postings_one_charge_idx ON account_postings (order_id) WHERE kind = 'charge';
CREATE UNIQUE INDEX IF NOT EXISTS account_postings_one_void_idx ON account_postings (order_id) WHERE kind = 'void';
CREATE UNIQUE INDEX IF NOT EXISTS account_postings_one_refund_idx ON account_postings (order_id) WHERE kind = 'refund';

-- An order whose payment was compensated before any charge was reserved: no
-- charge may be reserved for it afterwards (a late charge command, a retry
-- still in flight when the saga gave up on it).
CREATE TABLE IF NOT EXISTS charge_fences (
    order_id   uuid        PRIMARY KEY,
    account_id text        NOT NULL REFERENCES accounts,
    fenced_at  timestamptz NOT NULL DEFAULT now()
);

-- +goose Down
DROP TABLE IF EXISTS charge_fences;
DROP TABLE IF EXISTS account_postings;
DROP TABLE IF EXISTS accounts;
