-- idem: upgrade 3, for the partitioned layout only.
--
-- The first release's default partition took every key whose day had no partition,
-- and PostgreSQL scans it, under a lock every lookup waits for, whenever a day is
-- attached. This bounds it after the last day it already holds a key of (today at
-- the earliest): it keeps those keys and days, and takes nothing later, so a later
-- day is attached without scanning it. `NOT VALID` adds the bound without a scan;
-- `Idempotency::maintain_partitions` validates it (a scan that lets claims go on)
-- and drops the partition once it is empty. A key whose day has no partition is no
-- longer caught here: the claim that needs the day attaches it. Safe to run again.
DO $idem$
DECLARE
    bound timestamptz;
BEGIN
    IF to_regclass('idempotency_keys_default') IS NOT NULL AND NOT EXISTS (
        SELECT 1 FROM pg_constraint
        WHERE conrelid = to_regclass('idempotency_keys_default')
          AND conname = 'idempotency_keys_default_bound'
    ) THEN
        SELECT (date_trunc('day', greatest(max(expires_at), now()) AT TIME ZONE 'UTC')
                + interval '1 day') AT TIME ZONE 'UTC'
          INTO bound
          FROM idempotency_keys_default;
        EXECUTE format(
            'ALTER TABLE idempotency_keys_default ADD CONSTRAINT idempotency_keys_default_bound '
            'CHECK (expires_at < %L) NOT VALID',
            bound
        );
    END IF;
END
$idem$;
