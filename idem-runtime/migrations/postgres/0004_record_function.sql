-- idem: upgrade 4, for both PostgreSQL layouts (plain and partitioned).
--
-- Two functions that do in one call what idem would otherwise send as a statement
-- that PostgreSQL must parse and plan anew on every claim, or as two statements.
-- Both run with the caller's rights (no SECURITY DEFINER): they do only what idem
-- would send itself, and resolve the table by the caller's search_path, as those
-- statements did. idem uses them only where every role may call them (USAGE on
-- their schema and EXECUTE for PUBLIC, the defaults) and sends the statements
-- elsewhere, or before this upgrade.
--
-- `idempotency_keys_open` opens a claim's transaction, right after its BEGIN:
-- the transaction's timeouts (`whole`: also PostgreSQL 17's transaction_timeout,
-- disarmed then counted from now), the key's transaction lock and, when
-- `session_lock`, its session lock, taken only with the first (a claim holds both
-- or neither), the lock's id in `idem.key` and its outcome in `idem.locked`, and
-- the session state the record must come back to in `idem.*` settings. Returns
-- whether the key's lock was taken.
CREATE OR REPLACE FUNCTION idempotency_keys_open(
    seed            BIGINT,
    lock_ms         BIGINT,
    whole           BOOLEAN,
    session_lock    BOOLEAN
) RETURNS BOOLEAN
LANGUAGE plpgsql
AS $idem$
DECLARE
    -- Keyed on the table itself, so that instances whose search_path differs take
    -- the same lock for the same table.
    k BIGINT := hashint8extended(seed, 'idempotency_keys'::regclass::oid::int8);
    locked BOOLEAN;
    ignored TEXT;
BEGIN
    -- Assignments, not PERFORM: each is evaluated without a query of its own.
    ignored := set_config('statement_timeout', lock_ms::text, true);
    ignored := set_config('idle_in_transaction_session_timeout', lock_ms::text, true);
    IF whole THEN
        ignored := set_config('transaction_timeout', '0', true);
        ignored := set_config('transaction_timeout', lock_ms::text, true);
    END IF;
    locked := pg_try_advisory_xact_lock(k);
    IF session_lock THEN
        ignored := set_config('idem.key', k::text, true);
        IF locked THEN
            locked := pg_try_advisory_lock((k >> 32)::int4, ((k << 32) >> 32)::int4);
        END IF;
    END IF;
    ignored := set_config('idem.locked', locked::text, true);
    ignored := set_config('idem.session_authorization', current_setting('session_authorization'), true);
    ignored := set_config('idem.role', current_setting('role'), true);
    ignored := set_config('idem.search_path', current_setting('search_path'), true);
    ignored := set_config('idem.default_transaction_read_only',
                          current_setting('default_transaction_read_only'), true);
    RETURN locked;
END
$idem$;

-- `idempotency_keys_record` records a first execution: a handler may change its
-- session (a tenant's `search_path`, `SET ROLE` for row-level security, `SET
-- SESSION AUTHORIZATION`), so it first sets back what the claim saved in the
-- transaction's `idem.*` settings, then writes the response, in one round trip.
--
-- Returns -1 when the transaction is no longer the claim's (the handler ended it,
-- or ran `RESET ALL`): nothing is written, idem looks further. Otherwise the rows
-- recorded: 1, or 0 when the claim's lease or lock is gone. `release_lock` lets
-- the key's session lock go (the transaction lock holds the key until the commit);
-- `announce`, when not null, is the payload of the completion's NOTIFY.
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
    k BIGINT;
    unlocked BOOLEAN;
BEGIN
    -- Nothing to restore in the common case, checked in one expression; else the
    -- authorization first: it decides which roles may be set. A setting is set only
    -- if it changed: the role and the authorization cost catalog look-ups.
    IF (current_setting('session_authorization'), current_setting('role'),
        current_setting('search_path'), current_setting('default_transaction_read_only'))
       IS DISTINCT FROM
       (current_setting('idem.session_authorization', true), current_setting('idem.role', true),
        current_setting('idem.search_path', true),
        current_setting('idem.default_transaction_read_only', true)) THEN
        FOREACH setting IN ARRAY ARRAY['session_authorization', 'role', 'search_path',
                                       'default_transaction_read_only'] LOOP
            saved := nullif(current_setting('idem.' || setting, true), '');
            IF saved IS NOT NULL AND current_setting(setting) <> saved THEN
                PERFORM set_config(setting, saved, false);
            END IF;
        END LOOP;
    END IF;
    IF coalesce(current_setting('idem.locked', true), '') <> 'true' THEN
        RETURN -1;
    END IF;
    IF release_lock THEN
        k := current_setting('idem.key')::int8;
        unlocked := pg_advisory_unlock((k >> 32)::int4, ((k << 32) >> 32)::int4);
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
