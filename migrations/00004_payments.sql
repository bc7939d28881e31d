-- Version 4 created the payments sample's tables until they moved to
-- the sample's own migrations (payments/migrations, applied by payments.Migrate):
-- a user's database holds pgsaga's tables only. A database migrated before
-- keeps the tables and their rows; the sample's first migration adopts
-- them. The version stays, with nothing to do, so that every database
-- counts the same versions.

-- +goose Up
SELECT 1;

-- +goose Down
SELECT 1;
