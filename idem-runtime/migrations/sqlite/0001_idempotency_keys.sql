-- idem: the idempotency-key table for SQLite.
--
-- `Idempotency::migrate` applies this file (with `idempotency_keys` replaced by the
-- configured table name); it can also be copied as is into your own migration tool.
-- Times are Unix milliseconds from SQLite's clock; `lease` fences an executor that
-- lost its claim.
CREATE TABLE IF NOT EXISTS idempotency_keys (
    scope           TEXT    NOT NULL,
    idempotency_key TEXT    NOT NULL,
    state           TEXT    NOT NULL CHECK (state IN ('processing', 'completed')),
    lease           INTEGER NOT NULL,
    method          TEXT    NOT NULL,
    path            TEXT    NOT NULL,
    fingerprint     BLOB    NOT NULL,
    status          INTEGER,
    headers         BLOB,
    body            BLOB,
    locked_until    INTEGER NOT NULL,
    expires_at      INTEGER NOT NULL,
    created_at      INTEGER NOT NULL,
    PRIMARY KEY (scope, idempotency_key)
);

CREATE INDEX IF NOT EXISTS idempotency_keys_expires_at_idx ON idempotency_keys (expires_at);
