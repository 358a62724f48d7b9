//! One fresh database per scenario and backend, and the faults the suite injects
//! into the database itself.

use std::path::PathBuf;

use sqlx::{AssertSqlSafe, MySqlPool, PgPool};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    Postgres,
    MySql,
    Sqlite,
}

impl Backend {
    pub const ALL: [Self; 3] = [Self::Postgres, Self::MySql, Self::Sqlite];

    pub fn name(self) -> &'static str {
        match self {
            Self::Postgres => "postgres",
            Self::MySql => "mysql",
            Self::Sqlite => "sqlite",
        }
    }
}

/// A database of its own, dropped by [`Fresh::drop_all`].
pub struct Fresh {
    pub backend: Backend,
    pub url: String,
    admin: Admin,
    name: String,
}

enum Admin {
    Postgres(PgPool),
    MySql(MySqlPool),
    Sqlite(PathBuf),
}

fn server_url(env: &str, fallback: &str) -> String {
    std::env::var(env).unwrap_or_else(|_| fallback.to_owned())
}

fn with_database(base: &str, database: &str) -> String {
    match base.rsplit_once('/') {
        Some((server, _)) => format!("{server}/{database}"),
        None => format!("{base}/{database}"),
    }
}

impl Fresh {
    /// `Err` when the server cannot be reached (the caller reports it).
    pub async fn new(backend: Backend, tag: &str) -> Result<Self, String> {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() % 1_000_000_000);
        let name = format!("idem_faults_{}_{tag}_{nanos}", std::process::id());
        match backend {
            Backend::Postgres => {
                let base = server_url(
                    "IDEM_TEST_POSTGRES_URL",
                    "postgres://postgres@127.0.0.1:5432/postgres",
                );
                let admin = PgPool::connect(&base)
                    .await
                    .map_err(|e| format!("PostgreSQL not reachable at {base}: {e}"))?;
                sqlx::raw_sql(AssertSqlSafe(format!("CREATE DATABASE {name}")))
                    .execute(&admin)
                    .await
                    .map_err(|e| e.to_string())?;
                Ok(Self {
                    backend,
                    url: with_database(&base, &name),
                    admin: Admin::Postgres(admin),
                    name,
                })
            }
            Backend::MySql => {
                let base = server_url("IDEM_TEST_MYSQL_URL", "mysql://root@127.0.0.1:3306/test");
                let admin = MySqlPool::connect(&base)
                    .await
                    .map_err(|e| format!("MySQL/MariaDB not reachable at {base}: {e}"))?;
                sqlx::raw_sql(AssertSqlSafe(format!("CREATE DATABASE {name}")))
                    .execute(&admin)
                    .await
                    .map_err(|e| e.to_string())?;
                Ok(Self {
                    backend,
                    url: with_database(&base, &name),
                    admin: Admin::MySql(admin),
                    name,
                })
            }
            Backend::Sqlite => {
                let path = std::env::temp_dir().join(format!("{name}.db"));
                Ok(Self {
                    backend,
                    url: format!("sqlite://{}", path.display()),
                    admin: Admin::Sqlite(path),
                    name,
                })
            }
        }
    }

    /// Ends, from outside, every session of this database that sits in an open
    /// transaction; returns how many. SQLite has no sessions to end: `None`.
    pub async fn kill_open_transactions(&self) -> Option<u64> {
        match &self.admin {
            Admin::Postgres(admin) => {
                let killed: Vec<bool> = sqlx::query_scalar(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
                     WHERE datname = $1 AND state LIKE 'idle in transaction%'",
                )
                .bind(&self.name)
                .fetch_all(admin)
                .await
                .ok()?;
                Some(killed.len() as u64)
            }
            Admin::MySql(admin) => {
                let ids: Vec<i64> = sqlx::query_scalar(
                    "SELECT CAST(p.ID AS SIGNED) FROM information_schema.PROCESSLIST p \
                     JOIN information_schema.INNODB_TRX t ON t.trx_mysql_thread_id = p.ID \
                     WHERE p.DB = ?",
                )
                .bind(&self.name)
                .fetch_all(admin)
                .await
                .ok()?;
                let mut killed = 0;
                for id in ids {
                    if sqlx::raw_sql(AssertSqlSafe(format!("KILL {id}")))
                        .execute(admin)
                        .await
                        .is_ok()
                    {
                        killed += 1;
                    }
                }
                Some(killed)
            }
            Admin::Sqlite(_) => None,
        }
    }

    pub async fn drop_all(self) {
        match self.admin {
            Admin::Postgres(admin) => {
                let drop = format!("DROP DATABASE IF EXISTS {} WITH (FORCE)", self.name);
                let _ = sqlx::raw_sql(AssertSqlSafe(drop)).execute(&admin).await;
                admin.close().await;
            }
            Admin::MySql(admin) => {
                let drop = format!("DROP DATABASE IF EXISTS {}", self.name);
                let _ = sqlx::raw_sql(AssertSqlSafe(drop)).execute(&admin).await;
                admin.close().await;
            }
            Admin::Sqlite(path) => {
                for suffix in [
                    "",
                    "-wal",
                    "-shm",
                    "-provider",
                    "-provider-wal",
                    "-provider-shm",
                ] {
                    let mut file = path.clone().into_os_string();
                    file.push(suffix);
                    let _ = std::fs::remove_file(file);
                }
            }
        }
    }
}

/// Restarts the database server itself (the machine's own services, as `.ci/run`
/// starts them) and waits until it accepts connections again; `Err` says why not.
pub async fn restart_server(backend: Backend) -> Result<(), String> {
    let run = |program: &str, args: &[&str]| -> Result<(), String> {
        let status = std::process::Command::new(program)
            .args(args)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status()
            .map_err(|e| format!("{program}: {e}"))?;
        if status.success() {
            Ok(())
        } else {
            Err(format!("{program} {args:?}: {status}"))
        }
    };
    let ready: Box<dyn Fn() -> bool + Send> = match backend {
        Backend::Postgres => {
            let version = std::fs::read_dir("/etc/postgresql")
                .map_err(|e| e.to_string())?
                .filter_map(Result::ok)
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .next()
                .ok_or("no PostgreSQL cluster")?;
            tokio::task::spawn_blocking(move || {
                run(
                    "pg_ctlcluster",
                    &["--skip-systemctl-redirect", &version, "main", "restart"],
                )
            })
            .await
            .map_err(|e| e.to_string())??;
            Box::new(move || run("pg_isready", &["-q", "-h", "127.0.0.1", "-p", "5432"]).is_ok())
        }
        Backend::MySql => {
            let ping = [
                "--protocol=tcp",
                "-h",
                "127.0.0.1",
                "-P",
                "3306",
                "-u",
                "root",
            ];
            tokio::task::spawn_blocking(move || {
                // This server by its pid file: another `mariadbd` may run on the
                // machine (the Galera cluster's nodes), which `--exec` alone would
                // take for it.
                let pid_file = String::from_utf8(
                    std::process::Command::new("mariadb")
                        .args(ping)
                        .args(["-N", "-e", "SELECT @@pid_file"])
                        .output()
                        .map_err(|e| format!("mariadb: {e}"))?
                        .stdout,
                )
                .map_err(|e| e.to_string())?
                .trim()
                .to_owned();
                if pid_file.is_empty() {
                    return Err("the server's pid file is unknown".to_owned());
                }
                run("mariadb-admin", &[&ping[..], &["shutdown"]].concat())?;
                // `shutdown` returns before the server has exited; starting while
                // it still runs would do nothing.
                let daemon = ["--pidfile", &pid_file, "--exec", "/usr/sbin/mariadbd"];
                for _ in 0..120 {
                    if run("start-stop-daemon", &[&["--status"][..], &daemon].concat()).is_err() {
                        break;
                    }
                    std::thread::sleep(std::time::Duration::from_millis(250));
                }
                let start = ["--start", "--oknodo", "--background"];
                run("start-stop-daemon", &[&start[..], &daemon].concat())
            })
            .await
            .map_err(|e| e.to_string())??;
            Box::new(move || run("mariadb-admin", &[&ping[..], &["ping"]].concat()).is_ok())
        }
        Backend::Sqlite => return Err("SQLite has no server".into()),
    };
    for _ in 0..120 {
        if ready() {
            return Ok(());
        }
        tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    }
    Err(format!("{} did not come back within 60 s", backend.name()))
}

impl Fresh {
    /// Takes the business table (`effects`) from another session, as a migration or
    /// a backup would, and holds it for `hold`; returns once it is held.
    pub async fn lock_effects(
        &self,
        hold: std::time::Duration,
    ) -> Result<tokio::task::JoinHandle<()>, String> {
        use sqlx::Connection as _;
        let (held, ready) = tokio::sync::oneshot::channel::<Result<(), String>>();
        let (url, backend) = (self.url.clone(), self.backend);
        let holder = tokio::spawn(async move {
            let locked = async {
                match backend {
                    Backend::Postgres => {
                        let mut conn = sqlx::PgConnection::connect(&url).await?;
                        sqlx::raw_sql("BEGIN; LOCK TABLE effects IN ACCESS EXCLUSIVE MODE")
                            .execute(&mut conn)
                            .await?;
                        Ok::<_, sqlx::Error>(Held::Postgres(conn))
                    }
                    Backend::MySql => {
                        let mut conn = sqlx::MySqlConnection::connect(&url).await?;
                        sqlx::raw_sql("LOCK TABLES effects WRITE")
                            .execute(&mut conn)
                            .await?;
                        Ok(Held::MySql(conn))
                    }
                    Backend::Sqlite => {
                        // Behind the writers already in their transactions, as a
                        // migration would be: without a busy timeout it fails at once.
                        let options =
                            <sqlx::sqlite::SqliteConnectOptions as std::str::FromStr>::from_str(
                                &url,
                            )?
                            .busy_timeout(std::time::Duration::from_secs(30));
                        let mut conn = sqlx::SqliteConnection::connect_with(&options).await?;
                        sqlx::raw_sql("BEGIN EXCLUSIVE").execute(&mut conn).await?;
                        Ok(Held::Sqlite(conn))
                    }
                }
            };
            match locked.await {
                Ok(conn) => {
                    let _ = held.send(Ok(()));
                    tokio::time::sleep(hold).await;
                    let _ = match conn {
                        Held::Postgres(mut conn) => {
                            sqlx::raw_sql("COMMIT").execute(&mut conn).await.map(drop)
                        }
                        Held::MySql(mut conn) => sqlx::raw_sql("UNLOCK TABLES")
                            .execute(&mut conn)
                            .await
                            .map(drop),
                        Held::Sqlite(mut conn) => {
                            sqlx::raw_sql("COMMIT").execute(&mut conn).await.map(drop)
                        }
                    };
                }
                Err(error) => {
                    let _ = held.send(Err(error.to_string()));
                }
            }
        });
        ready.await.map_err(|e| e.to_string())??;
        Ok(holder)
    }
}

enum Held {
    Postgres(sqlx::PgConnection),
    MySql(sqlx::MySqlConnection),
    Sqlite(sqlx::SqliteConnection),
}
