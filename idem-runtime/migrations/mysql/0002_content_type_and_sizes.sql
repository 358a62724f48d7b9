-- idem: upgrade 2 for MySQL 8 and MariaDB 10.6+.
--
-- The request's Content-Type becomes part of its identity (NULL in rows recorded
-- before this upgrade, which matches any content type). Columns that could refuse a
-- legal request or response are widened: an extension method longer than 16
-- characters, a path and query over 64 KiB, stored headers over 64 KiB.
-- `Idempotency::migrate` applies it only to a table that lacks `content_type`
-- (MySQL has no ADD COLUMN IF NOT EXISTS); the column is added last, in the same
-- statement, so a table that has it has every change. Changing column types copies
-- the table: on a large key table, apply it when writes are quiet.
ALTER TABLE idempotency_keys
    MODIFY method  TEXT       NOT NULL,
    MODIFY path    MEDIUMTEXT NOT NULL,
    MODIFY headers LONGBLOB,
    ADD COLUMN content_type TEXT;
