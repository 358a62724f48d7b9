-- idem: the idempotency-key table for PostgreSQL, partitioned by day of expiry.
--
-- The opt-in layout of `Builder::partitioned_by_day`: expired days are dropped
-- whole by `Idempotency::maintain_partitions`, which also creates the days ahead.
-- PostgreSQL requires the partition column in the primary key, so (scope, key) is
-- no longer unique by itself: idem keeps it unique by claiming only under an
-- advisory lock on (scope, key) and checking for an existing row after taking it.
-- There is no default partition (the first release had one: upgrade 3 bounds it and
-- maintenance retires it): a claim whose day has no partition yet attaches it, and
-- without one an ended day is detached CONCURRENTLY, queueing no lookup.
CREATE TABLE IF NOT EXISTS idempotency_keys (
    scope           TEXT        NOT NULL,
    idempotency_key TEXT        NOT NULL,
    state           TEXT        NOT NULL CHECK (state IN ('processing', 'completed')),
    lease           BIGINT      NOT NULL,
    method          TEXT        NOT NULL,
    path            TEXT        NOT NULL,
    fingerprint     BYTEA       NOT NULL,
    status          SMALLINT,
    headers         BYTEA,
    body            BYTEA,
    locked_until    TIMESTAMPTZ NOT NULL,
    expires_at      TIMESTAMPTZ NOT NULL,
    created_at      TIMESTAMPTZ NOT NULL,
    PRIMARY KEY (scope, idempotency_key, expires_at)
) PARTITION BY RANGE (expires_at);

CREATE INDEX IF NOT EXISTS idempotency_keys_expires_at_idx ON idempotency_keys (expires_at);
