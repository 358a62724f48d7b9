-- idem: upgrade 4, for both PostgreSQL layouts (plain and partitioned).
--
-- The record of a first execution in one statement instead of two. A handler may
-- change its session (a tenant's `search_path`, `SET ROLE` for row-level security,
-- `SET SESSION AUTHORIZATION`), so idem first sets back what the claim saved in
-- the transaction's `idem.*` settings, then writes the response: two round trips
-- before this function, one with it. It runs with the caller's rights (no
-- SECURITY DEFINER): it does only what idem would send as separate statements, and
-- resolves the table by the search_path it has just restored, as they did.
--
-- Returns -1 when the transaction is no longer the claim's (the handler ended it,
-- or ran `RESET ALL`): nothing is written, idem looks further. Otherwise the rows
-- recorded: 1, or 0 when the claim's lease or lock is gone. `release_lock` lets
-- the key's session lock go (the transaction lock holds the key until the commit);
-- `announce`, when not null, is the payload of the completion's NOTIFY.
--
-- Used only where every role may call it (USAGE on its schema and EXECUTE for
-- PUBLIC, the defaults): a handler's role must reach it before it restores the
-- session. Elsewhere, or before this upgrade, idem sends the two statements.
CREATE OR REPLACE FUNCTION idempotency_keys_record(
    scope_in        TEXT,
    key_in          TEXT,
    lease_in        BIGINT,
    status_in       SMALLINT,
    headers_in      BYTEA,
    body_in         BYTEA,
    release_lock    BOOLEAN,
    announce        TEXT
) RETURNS BIGINT
LANGUAGE plpgsql
AS $idem$
DECLARE
    setting TEXT;
    saved TEXT;
    recorded BIGINT;
BEGIN
    -- The authorization first: it decides which roles may be set. A setting is
    -- set only if it changed: the role and the authorization cost catalog look-ups.
    FOREACH setting IN ARRAY ARRAY['session_authorization', 'role', 'search_path',
                                   'default_transaction_read_only'] LOOP
        saved := nullif(current_setting('idem.' || setting, true), '');
        IF saved IS NOT NULL AND current_setting(setting) <> saved THEN
            PERFORM set_config(setting, saved, false);
        END IF;
    END LOOP;
    IF coalesce(current_setting('idem.locked', true), '') <> 'true' THEN
        RETURN -1;
    END IF;
    IF release_lock THEN
        PERFORM pg_advisory_unlock((k >> 32)::int4, ((k << 32) >> 32)::int4)
        FROM (SELECT current_setting('idem.key')::int8 AS k) AS kept;
    END IF;
    UPDATE idempotency_keys
    SET state = 'completed', status = status_in, headers = headers_in, body = body_in
    WHERE scope = scope_in AND idempotency_key = key_in AND lease = lease_in
      AND state = 'processing' AND locked_until > clock_timestamp();
    GET DIAGNOSTICS recorded = ROW_COUNT;
    IF recorded > 0 AND announce IS NOT NULL THEN
        PERFORM pg_notify('idem_completed', announce);
    END IF;
    RETURN recorded;
END
$idem$;
