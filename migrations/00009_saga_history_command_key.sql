-- The idempotency key of the command a timeline entry sent, so that the
-- timeline says which command an answer belongs to and a checker can follow
-- every command to its participant's stored outcome.

-- +goose Up
ALTER TABLE saga_history ADD COLUMN command_key text;

-- +goose Down
ALTER TABLE saga_history DROP COLUMN command_key;
