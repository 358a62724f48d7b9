-- idem: upgrade 2 for SQLite.
--
-- The request's Content-Type becomes part of its identity. Rows recorded before this
-- upgrade keep NULL, which matches any content type, so retries of keys in flight
-- during the upgrade are answered as before. `Idempotency::migrate` applies it only
-- to a table that lacks the column (SQLite has no ADD COLUMN IF NOT EXISTS).
ALTER TABLE idempotency_keys ADD COLUMN content_type TEXT;
