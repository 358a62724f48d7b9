-- idem: the idempotency-key table for MySQL 8 and MariaDB 10.6+.
--
-- `Idempotency::migrate` applies this file (with `idempotency_keys` replaced by the
-- configured table name); it can also be copied as is into your own migration tool.
-- Scope and key are VARBINARY: compared byte for byte, with no collation to fold
-- case or ignore trailing spaces. Times are UTC with microseconds, from the database
-- clock; `lease` fences an executor that lost its claim.
CREATE TABLE IF NOT EXISTS idempotency_keys (
    scope           VARBINARY(1024) NOT NULL,
    idempotency_key VARBINARY(255)  NOT NULL,
    state           VARCHAR(10)     NOT NULL,
    lease           BIGINT          NOT NULL,
    method          VARCHAR(16)     NOT NULL,
    path            TEXT            NOT NULL,
    fingerprint     BINARY(32)      NOT NULL,
    status          SMALLINT,
    headers         BLOB,
    body            LONGBLOB,
    locked_until    DATETIME(6)     NOT NULL,
    expires_at      DATETIME(6)     NOT NULL,
    created_at      DATETIME(6)     NOT NULL,
    PRIMARY KEY (scope, idempotency_key),
    KEY idempotency_keys_expires_at_idx (expires_at),
    CONSTRAINT idempotency_keys_state CHECK (state IN ('processing', 'completed'))
) ENGINE = InnoDB;
