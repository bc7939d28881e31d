-- A consumer group's last_seen_at is when a running router last showed it
-- alive (on start, then every heartbeat); NULL for a group that was only
-- set up (Transport.Subscribe) and never seen running. Operators list the
-- groups that no longer run by it.

-- +goose Up
ALTER TABLE pgsaga_subscriptions ALTER COLUMN last_seen_at DROP NOT NULL, ALTER COLUMN last_seen_at DROP DEFAULT;

-- +goose Down
UPDATE pgsaga_subscriptions SET last_seen_at = created_at WHERE last_seen_at IS NULL;
ALTER TABLE pgsaga_subscriptions ALTER COLUMN last_seen_at SET DEFAULT clock_timestamp(), ALTER COLUMN last_seen_at SET NOT NULL;
