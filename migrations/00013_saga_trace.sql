-- The trace a saga belongs to (W3C traceparent of the engine's span that
-- started it): the engine's decisions that no message carries a trace to
-- (the deadline sweeper's re-sends, operators' retries and cancels) join
-- the saga's trace through it, so that one saga is one trace.

-- +goose Up
ALTER TABLE saga_instances ADD COLUMN trace_parent text;

-- +goose Down
ALTER TABLE saga_instances DROP COLUMN trace_parent;
