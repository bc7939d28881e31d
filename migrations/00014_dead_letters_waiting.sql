-- The dead letters not replayed, by topic, for the metrics collector
-- (pgsaga_dead_letters_waiting), which reads them at every scrape: replayed
-- ones are kept for the record and must not make each scrape slower.

-- +goose Up
CREATE INDEX pgsaga_dead_letters_waiting_idx ON pgsaga_dead_letters (topic) WHERE replayed_at IS NULL;

-- +goose Down
DROP INDEX pgsaga_dead_letters_waiting_idx;
