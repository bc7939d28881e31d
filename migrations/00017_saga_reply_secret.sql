-- Replies prove where they came from (docs/DESIGN.md, "Authenticated
-- replies"): every saga instance has a random secret, and every command it
-- sends carries a token derived from the secret and the command's key
-- (HMAC-SHA256), which the participant's step runtime copies into its reply
-- and into the reply it stores for duplicates. A reply to the command in
-- flight without the right token is dead-lettered as forged and changes
-- nothing. NULL for an instance started by an earlier release: its
-- commands carry no token and its replies are taken as before.

--
-- A reaction whose instance changed since it was read (another reaction
-- saved it first) fails with a serialization failure (40001), a conflict
-- retried like any other, saying which instance: saga_instance_changed
-- raises it from inside the instance's save.

--
-- Operators' requests carried out are pruned with the timelines (the
-- retention job): by when they were carried out (saga_requests_done_idx,
-- built CONCURRENTLY by migration 18).

-- +goose Up
ALTER TABLE saga_instances ADD COLUMN reply_secret bytea;


-- +goose StatementBegin
CREATE FUNCTION saga_instance_changed(id uuid, version integer) RETURNS integer
LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'saga instance % changed since it was read (version %)', id, version
        USING ERRCODE = 'serialization_failure';
END
$$;
-- +goose StatementEnd

-- +goose Down
DROP FUNCTION saga_instance_changed(uuid, integer);
ALTER TABLE saga_instances DROP COLUMN reply_secret;
