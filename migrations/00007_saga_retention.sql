-- Retention of finished sagas (saga.Engine.Prune) finds them by age.

-- +goose Up
CREATE INDEX saga_instances_finished_idx ON saga_instances (finished_at)
    WHERE status IN ('completed', 'compensated');

-- +goose Down
DROP INDEX saga_instances_finished_idx;
