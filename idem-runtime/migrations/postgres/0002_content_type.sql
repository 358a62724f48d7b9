-- idem: upgrade 2, for both PostgreSQL layouts (plain and partitioned).
--
-- The request's Content-Type becomes part of its identity. Rows recorded before this
-- upgrade keep NULL, which matches any content type, so retries of keys in flight
-- during the upgrade are answered as before. Adding a nullable column without a
-- default rewrites nothing and is applied in place, rows included.
ALTER TABLE idempotency_keys ADD COLUMN IF NOT EXISTS content_type TEXT;
