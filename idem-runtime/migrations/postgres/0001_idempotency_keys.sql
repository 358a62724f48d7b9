-- idem: the idempotency-key table for PostgreSQL.
--
-- `Idempotency::migrate` applies this file (with `idempotency_keys` replaced by the
-- configured table name); it can also be copied as is into your own migration tool.
-- Times come from the database clock; `lease` fences an executor that lost its claim.
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
    PRIMARY KEY (scope, idempotency_key)
);

CREATE INDEX IF NOT EXISTS idempotency_keys_expires_at_idx ON idempotency_keys (expires_at);
