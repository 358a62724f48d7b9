//! The `idem` binary against a real SQLite file: what an operator types, what it
//! prints, and that it never shows another scope's record.

mod support;

use std::process::Command;

use idem_runtime::Idempotency;
use sqlx::sqlite::SqliteConnectOptions;
use support::idem;

const NOW: &str = "CAST((julianday('now') - 2440587.5) * 86400000.0 AS INTEGER)";

#[tokio::test]
async fn operator_commands_on_sqlite() {
    let dir = std::env::temp_dir().join(format!("idem_cli_{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("scratch dir");
    let path = dir.join("keys.db");
    let pool = sqlx::SqlitePool::connect_with(
        SqliteConnectOptions::new()
            .filename(&path)
            .create_if_missing(true),
    )
    .await
    .expect("sqlite");
    Idempotency::new(pool.clone())
        .migrate()
        .await
        .expect("migrate");
    let rows = [
        // scope, key, state, locked_until, expires_at, body
        ("alice", "k-stuck", "processing", "-1000", "3600000", ""),
        (
            "alice",
            "k-done",
            "completed",
            "-1000",
            "3600000",
            "alice's receipt",
        ),
        (
            "bob",
            "k-done",
            "completed",
            "-1000",
            "3600000",
            "bob's receipt",
        ),
        ("alice", "k-old", "completed", "-7200000", "-1000", "old"),
    ];
    for (scope, key, state, lock, ttl, body) in rows {
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "INSERT INTO idempotency_keys (scope, idempotency_key, state, lease, method, path, \
                 fingerprint, status, headers, body, locked_until, expires_at, created_at) \
             VALUES (?1, ?2, ?3, 1, 'POST', '/payments', x'00', 201, \
                 CAST('content-type: application/json' || char(13, 10) AS BLOB), CAST(?4 AS BLOB), \
                 {NOW} + {lock}, {NOW} + {ttl}, {NOW} - 5000)"
        )))
        .bind(scope)
        .bind(key)
        .bind(state)
        .bind(body)
        .execute(&pool)
        .await
        .expect("row");
    }
    pool.close().await;
    let url = format!("sqlite://{}", path.display());

    let help = idem(&url, &["--help"]);
    assert_eq!(help.code, 0);
    assert!(help.stdout.contains("Commands:"), "{}", help.stdout);
    for command in [
        "list",
        "show",
        "forget",
        "sweep",
        "reseal",
        "partitions",
        "migration",
    ] {
        let help = idem(&url, &[command, "--help"]);
        assert_eq!(help.code, 0);
        assert!(
            help.stdout.contains(&format!("Usage: idem {command}")),
            "{command}: {}",
            help.stdout
        );
    }

    let list = idem(&url, &["list"]);
    assert_eq!(list.code, 0, "{}", list.stderr);
    assert!(
        list.stdout.contains("k-stuck") && list.stdout.contains("stuck"),
        "{}",
        list.stdout
    );
    assert!(
        !list.stdout.contains("k-done"),
        "completed keys are not claims"
    );
    let stuck = idem(&url, &["list", "--stuck", "--scope", "bob"]);
    assert!(stuck.stdout.contains("no stuck claim"), "{}", stuck.stdout);

    let show = idem(&url, &["show", "--scope", "alice", "k-done"]);
    assert_eq!(show.code, 0, "{}", show.stderr);
    assert!(
        show.stdout.contains("state:       completed"),
        "{}",
        show.stdout
    );
    assert!(show.stdout.contains("alice's receipt"));
    assert!(show.stdout.contains("content-type: application/json"));
    assert!(
        !show.stdout.contains("bob's receipt"),
        "never another scope's record"
    );
    assert!(show.stdout.contains("1 other scope(s)") && show.stdout.contains("bob"));
    // Nothing to show is a failure a script can test for, as for `forget`.
    let nobody = idem(&url, &["show", "--scope", "carol", "k-done"]);
    assert_eq!(nobody.code, 1, "{}", nobody.stderr);
    assert!(nobody.stderr.contains("holds no key"), "{}", nobody.stderr);
    assert!(nobody.stderr.contains("alice, bob") && !nobody.stderr.contains("receipt"));

    let sweep = idem(&url, &["sweep", "--batch", "10"]);
    assert_eq!(sweep.code, 0, "{}", sweep.stderr);
    assert!(
        sweep.stdout.starts_with("deleted 1 expired keys"),
        "{}",
        sweep.stdout
    );
    assert!(
        idem(&url, &["show", "--scope", "alice", "k-old"])
            .stderr
            .contains("holds no key")
    );

    let forget = idem(&url, &["forget", "--scope", "bob", "k-done"]);
    assert_eq!(forget.code, 0, "{}", forget.stderr);
    assert!(
        forget.stdout.starts_with("forgot k-done in scope bob"),
        "{}",
        forget.stdout
    );
    assert!(
        idem(&url, &["show", "--scope", "bob", "k-done"])
            .stderr
            .contains("holds no key")
    );
    let kept = idem(&url, &["show", "--scope", "alice", "k-done"]);
    assert!(
        kept.stdout.contains("alice's receipt"),
        "another scope's key stays"
    );
    let again = idem(&url, &["forget", "--scope", "bob", "k-done"]);
    assert_eq!(again.code, 1);
    assert!(
        again.stderr.contains("holds no record") && again.stderr.contains("nothing deleted"),
        "{}",
        again.stderr
    );
    // A stuck claim is still a claim: its next request takes it over.
    let claimed = idem(&url, &["forget", "--scope", "alice", "k-stuck"]);
    assert_eq!(claimed.code, 3, "{}", claimed.stderr);
    assert!(
        claimed.stderr.contains("in flight: nothing deleted")
            && claimed
                .stderr
                .contains("stuck, the next request takes it over"),
        "{}",
        claimed.stderr
    );
    assert!(
        idem(&url, &["list"]).stdout.contains("k-stuck"),
        "claims stay"
    );

    let partitions = idem(&url, &["partitions"]);
    assert_eq!(partitions.code, 2);
    assert!(
        partitions.stderr.contains("PostgreSQL"),
        "{}",
        partitions.stderr
    );
    let unknown = idem(&url, &["lsit"]);
    assert_eq!(unknown.code, 2);
    assert!(
        unknown.stderr.contains("unrecognized subcommand 'lsit'")
            && unknown.stderr.contains("list"),
        "{}",
        unknown.stderr
    );
    let bad = idem(&url, &["sweep", "--batch", "many"]);
    assert_eq!(bad.code, 2);
    assert!(
        bad.stderr.contains("invalid value 'many'"),
        "{}",
        bad.stderr
    );

    let _ = std::fs::remove_dir_all(dir);
}

/// `idem migration <backend>` prints, with no database, the SQL a user's own
/// migration tool applies; on SQLite that SQL makes a table the store uses as is.
#[tokio::test]
async fn migration_prints_the_table_for_a_migration_tool() {
    let no_db = "sqlite://unused";
    for backend in ["postgres", "mysql", "sqlite"] {
        let printed = idem(no_db, &["--table", "api_keys", "migration", backend]);
        assert_eq!(printed.code, 0, "{backend}: {}", printed.stderr);
        assert!(
            printed
                .stdout
                .contains("CREATE TABLE IF NOT EXISTS api_keys")
                && !printed.stdout.contains("idempotency_keys"),
            "{backend}: {}",
            printed.stdout
        );
    }
    let parted = idem(no_db, &["--partitioned", "migration", "postgres"]);
    assert!(
        parted.stdout.contains("PARTITION BY RANGE"),
        "{}",
        parted.stdout
    );
    let refused = idem(no_db, &["--partitioned", "migration", "sqlite"]);
    assert_eq!(refused.code, 2);
    let unknown = idem(no_db, &["migration", "oracle"]);
    assert_eq!(unknown.code, 2);

    let dir = std::env::temp_dir().join(format!("idem_cli_migration_{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("scratch dir");
    let options = SqliteConnectOptions::new()
        .filename(dir.join("app.db"))
        .create_if_missing(true);
    let pool = sqlx::SqlitePool::connect_with(options)
        .await
        .expect("sqlite");
    let sql = idem(no_db, &["--table", "api_keys", "migration", "sqlite"]).stdout;
    sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
        .execute(&pool)
        .await
        .expect("the printed SQL applies");
    let store = Idempotency::builder(pool.clone())
        .table("api_keys")
        .build()
        .expect("store");
    store.migrate().await.expect("nothing left to migrate");
    assert!(
        store
            .claims(None, false, 10)
            .await
            .expect("claims")
            .is_empty()
    );
    pool.close().await;
    let _ = std::fs::remove_dir_all(dir);
}

/// What fails outside the table: a server that refuses answers at once (the
/// message comes from one connection attempt, not from the pool's 30 s timeout),
/// a missing table says to migrate, and no database error carries the server's
/// source position. `DATABASE_URL` is found in a `.env` above the directory.
#[tokio::test]
async fn failures_say_what_to_do() {
    // Nothing listens on port 1 of the loopback. The message names the database,
    // never its password.
    let refused = idem(
        "postgres://postgres:hunter2@127.0.0.1:1/postgres?password=hunter2",
        &["list"],
    );
    assert_eq!(refused.code, 1);
    assert!(
        refused.stderr.contains("cannot reach the database") && !refused.stderr.contains("pool"),
        "{}",
        refused.stderr
    );
    assert!(
        refused.stderr.contains(
            "database: postgres://postgres:***@127.0.0.1:1/postgres?password=*** \
             (from --database-url)"
        ) && !refused.stderr.contains("hunter2"),
        "{}",
        refused.stderr
    );

    let dir = std::env::temp_dir().join(format!("idem_cli_env_{}", std::process::id()));
    let below = dir.join("service").join("src");
    std::fs::create_dir_all(&below).expect("scratch dir");
    let empty = dir.join("empty.db");
    // Read as sqlx-cli reads it: `export`, quotes, and a variable the file set
    // before, expanded.
    std::fs::write(
        dir.join(".env"),
        format!(
            "# the service's settings\nRUST_LOG=info\nDATA_DIR='{}'\n\
             export DATABASE_URL=\"sqlite://${{DATA_DIR}}/empty.db?mode=rwc\"\n",
            dir.display()
        ),
    )
    .expect(".env");
    let output = Command::new(env!("CARGO_BIN_EXE_idem"))
        .arg("list")
        .current_dir(&below)
        .env_remove("DATABASE_URL")
        .output()
        .expect("run idem");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("no such table") && stderr.contains("migrate"),
        "the .env's database was used, and its missing table named: {stderr}"
    );
    assert!(
        stderr.contains(&format!(
            "database: sqlite://{}?mode=rwc (from DATABASE_URL in {})",
            empty.display(),
            dir.join(".env").display()
        )),
        "{stderr}"
    );
    assert!(!stderr.contains(" at line "), "{stderr}");

    // A `.env` that cannot be read is named; `migration`, which needs no database,
    // still works beside it.
    let broken = dir.join("broken");
    std::fs::create_dir_all(&broken).expect("scratch dir");
    std::fs::write(
        broken.join(".env"),
        "DATABASE_URL=\"sqlite://never-closed\n",
    )
    .expect(".env");
    let run_in = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_idem"))
            .args(args)
            .current_dir(&broken)
            .env_remove("DATABASE_URL")
            .output()
            .expect("run idem")
    };
    let unread = run_in(&["list"]);
    let stderr = String::from_utf8_lossy(&unread.stderr);
    assert_eq!(unread.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains(&broken.join(".env").display().to_string()),
        "{stderr}"
    );
    assert_eq!(run_in(&["migration", "sqlite"]).status.code(), Some(0));

    let none = Command::new(env!("CARGO_BIN_EXE_idem"))
        .arg("list")
        .current_dir(std::env::temp_dir())
        .env_remove("DATABASE_URL")
        .output()
        .expect("run idem");
    if !std::env::temp_dir()
        .ancestors()
        .any(|d| d.join(".env").is_file())
    {
        assert_eq!(none.status.code(), Some(2));
        assert!(String::from_utf8_lossy(&none.stderr).contains("DATABASE_URL"));
    }
    let _ = std::fs::remove_dir_all(dir);
}

/// `--since n` prints only the versions after n, each headed by its number, for a
/// migration folder that holds the earlier ones; past the latest is refused.
#[test]
fn migration_since_prints_only_what_is_new() {
    let no_db = "sqlite://unused";
    let all = idem(no_db, &["--partitioned", "migration", "postgres"]);
    assert_eq!(all.code, 0, "{}", all.stderr);
    for version in ["0001", "0002", "0003", "0004"] {
        assert!(
            all.stdout.contains(&format!("-- idem migration {version}")),
            "{}",
            all.stdout
        );
    }
    let new = idem(
        no_db,
        &["--partitioned", "migration", "--since", "2", "postgres"],
    );
    assert_eq!(new.code, 0, "{}", new.stderr);
    assert!(
        new.stdout.contains("-- idem migration 0003"),
        "{}",
        new.stdout
    );
    assert!(
        !new.stdout.contains("-- idem migration 0002") && !new.stdout.contains("CREATE TABLE"),
        "{}",
        new.stdout
    );
    // Upgrades keep their numbers across layouts: the plain layout has no 3.
    let plain = idem(no_db, &["migration", "--since", "2", "postgres"]);
    assert_eq!(plain.code, 0, "{}", plain.stderr);
    assert!(
        plain.stdout.contains("-- idem migration 0004")
            && plain.stdout.contains("FUNCTION idempotency_keys_record")
            && !plain.stdout.contains("-- idem migration 0003"),
        "{}",
        plain.stdout
    );
    let current = idem(no_db, &["migration", "--since", "2", "sqlite"]);
    assert_eq!(current.code, 0);
    assert!(current.stdout.contains("up to date"), "{}", current.stdout);
    let ahead = idem(no_db, &["migration", "--since", "9", "mysql"]);
    assert_eq!(ahead.code, 2);
    assert!(
        ahead.stderr.contains("latest version is 2"),
        "{}",
        ahead.stderr
    );
}

/// PostgreSQL: a claim lives in its open transaction, invisible to `list`; the
/// command says so and counts the sessions that hold advisory locks in a
/// transaction, the only trace a claim leaves meanwhile.
#[tokio::test]
async fn postgres_list_tells_what_it_cannot_see() {
    let base = std::env::var("IDEM_TEST_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".to_owned());
    let admin = match sqlx::PgPool::connect(&base).await {
        Ok(pool) => pool,
        Err(error) if !std::env::var("CI").is_ok_and(|v| v == "true" || v == "1") => {
            eprintln!("SKIPPED: PostgreSQL unreachable at {base}: {error}");
            return;
        }
        Err(error) => panic!("PostgreSQL unreachable at {base}: {error}"),
    };
    let database = format!("idem_cli_{}", std::process::id());
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE DATABASE {database}")))
        .execute(&admin)
        .await
        .expect("create database");
    let mut options: sqlx::postgres::PgConnectOptions = base.parse().expect("url");
    options = options.database(&database);
    let pool = sqlx::PgPool::connect_with(options)
        .await
        .expect("test database");
    Idempotency::new(pool.clone())
        .migrate()
        .await
        .expect("migrate");
    let url = {
        let (head, _) = base.rsplit_once('/').expect("a database in the URL");
        format!("{head}/{database}")
    };

    let idle = idem(&url, &["list"]);
    assert_eq!(idle.code, 0, "{}", idle.stderr);
    assert!(
        idle.stdout.contains("no claim is in flight"),
        "{}",
        idle.stdout
    );

    // A claim's trace: an advisory lock held in an open transaction.
    let mut claim = pool.begin().await.expect("begin");
    sqlx::query("SELECT pg_advisory_xact_lock(42)")
        .execute(&mut *claim)
        .await
        .expect("lock");
    let busy = idem(&url, &["list"]);
    assert_eq!(busy.code, 0, "{}", busy.stderr);
    assert!(
        busy.stdout.contains("committed claims only")
            && busy.stdout.contains("0 claim(s)")
            && busy
                .stdout
                .contains("1 other session(s) of this database hold advisory locks"),
        "{}",
        busy.stdout
    );
    claim.rollback().await.expect("rollback");
    pool.close().await;
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "DROP DATABASE {database} WITH (FORCE)"
    )))
    .execute(&admin)
    .await
    .expect("drop database");
}
