-- When an operator sent a dead letter back to its queue (pgsaga dead-letters
-- replay): a dead letter is replayed once, and keeps the record.

-- +goose Up
ALTER TABLE pgsaga_dead_letters ADD COLUMN replayed_at timestamptz;

-- +goose Down
ALTER TABLE pgsaga_dead_letters DROP COLUMN replayed_at;
