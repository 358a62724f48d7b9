//! The `idem` binary against a real SQLite file: what an operator types, what it
//! prints, and that it never shows another scope's record.

use std::process::Command;

use idem_runtime::Idempotency;
use sqlx::sqlite::SqliteConnectOptions;

struct Run {
    code: i32,
    stdout: String,
    stderr: String,
}

fn idem(url: &str, args: &[&str]) -> Run {
    let output = Command::new(env!("CARGO_BIN_EXE_idem"))
        .arg("--database-url")
        .arg(url)
        .args(args)
        .env_remove("DATABASE_URL")
        .output()
        .expect("run idem");
    Run {
        code: output.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&output.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
    }
}

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
    for command in ["list", "show", "forget", "sweep", "partitions", "migration"] {
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
    assert!(stuck.stdout.contains("no stuck claims"), "{}", stuck.stdout);

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
    let nobody = idem(&url, &["show", "--scope", "carol", "k-done"]);
    assert!(nobody.stdout.contains("holds no key"), "{}", nobody.stdout);
    assert!(nobody.stdout.contains("alice, bob") && !nobody.stdout.contains("receipt"));

    let sweep = idem(&url, &["sweep", "--batch", "10"]);
    assert_eq!(sweep.code, 0, "{}", sweep.stderr);
    assert!(
        sweep.stdout.starts_with("deleted 1 expired keys"),
        "{}",
        sweep.stdout
    );
    assert!(
        idem(&url, &["show", "--scope", "alice", "k-old"])
            .stdout
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
            .stdout
            .contains("holds no key")
    );
    let kept = idem(&url, &["show", "--scope", "alice", "k-done"]);
    assert!(
        kept.stdout.contains("alice's receipt"),
        "another scope's key stays"
    );
    let again = idem(&url, &["forget", "--scope", "bob", "k-done"]);
    assert_eq!(again.code, 2);
    assert!(
        again.stderr.contains("no completed record"),
        "{}",
        again.stderr
    );
    let claimed = idem(&url, &["forget", "--scope", "alice", "k-stuck"]);
    assert_eq!(claimed.code, 2);
    assert!(claimed.stderr.contains("in flight"), "{}", claimed.stderr);
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
