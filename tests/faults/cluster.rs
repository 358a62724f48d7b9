//! A replicated PostgreSQL on this machine, as deployments run it: two nodes
//! managed by Patroni, etcd as Patroni's store, and HAProxy sending connections to
//! whichever node Patroni's REST API calls the primary. Every run gets its own
//! ports, directories and cluster name; everything it started is killed and its
//! directory removed when the [`Cluster`] is dropped.
//!
//! Needs the Debian packages `patroni`, `etcd-server` and `haproxy`, PostgreSQL's
//! binaries under `/usr/lib/postgresql/<major>/bin`, and root (Patroni runs as the
//! `postgres` user through `setpriv`).

use std::fmt::Write as _;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt as _, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use sqlx::{Connection as _, PgConnection};

/// The programs the cluster needs, and the package each comes from.
const PROGRAMS: [(&str, &str); 4] = [
    ("etcd", "etcd-server"),
    ("patroni", "patroni"),
    ("haproxy", "haproxy"),
    ("setpriv", "util-linux"),
];

pub struct Cluster {
    dir: PathBuf,
    children: Vec<Child>,
    nodes: [Node; 2],
    /// HAProxy's port for the primary.
    front: u16,
    stats: u16,
    /// Keep the directory (logs) after a failed run.
    pub keep: bool,
}

struct Node {
    name: String,
    port: u16,
    rest: u16,
    data: PathBuf,
}

impl Cluster {
    /// Starts etcd, two Patroni nodes and HAProxy, and waits until the replica
    /// streams (as the synchronous standby when `synchronous`) and HAProxy routes
    /// to the primary alone.
    pub async fn start(synchronous: bool) -> Result<Self, String> {
        let missing: Vec<&str> = PROGRAMS
            .iter()
            .filter(|(program, _)| find(program).is_none())
            .map(|(_, package)| *package)
            .collect();
        if !missing.is_empty() {
            return Err(format!(
                "missing programs; install them with `apt-get install -y {}`",
                missing.join(" ")
            ));
        }
        let bin = postgres_bin()?;
        let mode = if synchronous { "sync" } else { "async" };
        let dir = std::env::temp_dir().join(format!(
            "idem-failover-{}-{mode}-{}",
            std::process::id(),
            nanos()
        ));
        std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        let ports = free_ports(8)?;
        let nodes = [0, 1].map(|i| Node {
            name: format!("node{i}"),
            port: ports[2 + i],
            rest: ports[4 + i],
            data: dir.join(format!("node{i}")).join("data"),
        });
        let mut cluster = Self {
            dir,
            children: Vec::new(),
            nodes,
            front: ports[6],
            stats: ports[7],
            keep: false,
        };
        cluster.launch(synchronous, &bin, ports[0], ports[1])?;
        if let Err(error) = cluster.ready(synchronous).await {
            cluster.keep = true;
            return Err(format!("{error} (logs in {})", cluster.dir.display()));
        }
        Ok(cluster)
    }

    fn launch(
        &mut self,
        synchronous: bool,
        bin: &Path,
        etcd: u16,
        peer: u16,
    ) -> Result<(), String> {
        let dir = self.dir.clone();
        let scope = dir
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let etcd_url = format!("http://127.0.0.1:{etcd}");
        let peer_url = format!("http://127.0.0.1:{peer}");
        let mut command = program("etcd");
        command
            .args(["--name", "idem", "--data-dir"])
            .arg(dir.join("etcd"))
            .args(["--listen-client-urls", &etcd_url])
            .args(["--advertise-client-urls", &etcd_url])
            .args(["--listen-peer-urls", &peer_url])
            .args(["--initial-advertise-peer-urls", &peer_url])
            .args(["--initial-cluster", &format!("idem={peer_url}")]);
        self.spawn(command, "etcd.log")?;

        for node in &self.nodes {
            let home = dir.join(&node.name);
            std::fs::create_dir_all(&home).map_err(|e| e.to_string())?;
            let config = patroni_config(&scope, node, &home, bin, etcd, synchronous);
            let file = home.join("patroni.yml");
            std::fs::write(&file, config).map_err(|e| e.to_string())?;
        }
        // PostgreSQL refuses to run as root: Patroni and its directories belong to
        // the `postgres` user.
        let owned = Command::new("chown")
            .args(["-R", "postgres:postgres"])
            .arg(&dir)
            .status()
            .map_err(|e| e.to_string())?;
        if !owned.success() {
            return Err(format!("chown postgres {}", dir.display()));
        }
        for i in 0..self.nodes.len() {
            let home = dir.join(&self.nodes[i].name);
            let mut command = program("setpriv");
            command
                .args([
                    "--reuid=postgres",
                    "--regid=postgres",
                    "--init-groups",
                    "--",
                ])
                .arg(find("patroni").unwrap_or_else(|| "patroni".into()))
                .arg(home.join("patroni.yml"))
                .env("HOME", &home);
            self.spawn(command, &format!("{}/patroni.log", self.nodes[i].name))?;
        }

        let config = haproxy_config(&self.nodes, self.front, self.stats);
        let file = dir.join("haproxy.cfg");
        std::fs::write(&file, config).map_err(|e| e.to_string())?;
        let mut command = program("haproxy");
        command.arg("-db").arg("-f").arg(&file);
        self.spawn(command, "haproxy.log")
    }

    fn spawn(&mut self, mut command: Command, log: &str) -> Result<(), String> {
        let log = File::create(self.dir.join(log)).map_err(|e| format!("{log}: {e}"))?;
        let err = log.try_clone().map_err(|e| e.to_string())?;
        let child = command
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(err)
            .spawn()
            .map_err(|e| format!("{command:?}: {e}"))?;
        self.children.push(child);
        Ok(())
    }

    /// The URL applications use: through HAProxy, to the primary.
    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.front)
    }

    fn node_url(node: &Node) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", node.port)
    }

    /// The node Patroni's REST API calls the primary, if exactly one.
    pub async fn primary(&self) -> Option<usize> {
        let mut primaries = Vec::new();
        for (i, node) in self.nodes.iter().enumerate() {
            let url = format!("http://127.0.0.1:{}/primary", node.rest);
            if matches!(get(&url).await, Ok((200, _))) {
                primaries.push(i);
            }
        }
        (primaries.len() == 1).then(|| primaries[0])
    }

    /// HAProxy's servers for the primary that its health checks see up.
    pub async fn routed(&self) -> Result<Vec<String>, String> {
        let url = format!("http://127.0.0.1:{}/;csv", self.stats);
        let (_, csv) = get(&url).await?;
        // `# pxname,svname,…,status (18th),…`
        Ok(csv
            .lines()
            .map(|line| line.split(',').collect::<Vec<_>>())
            .filter(|f| f.len() > 17 && f[0] == "primary" && f[1].starts_with("node"))
            .filter(|f| f[17] == "UP")
            .map(|f| f[1].to_owned())
            .collect())
    }

    async fn ready(&self, synchronous: bool) -> Result<(), String> {
        let deadline = Instant::now() + Duration::from_secs(120);
        let mut last = String::from("nothing yet");
        while Instant::now() < deadline {
            match self.check(synchronous).await {
                Ok(()) => return Ok(()),
                Err(why) => last = why,
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        Err(format!("the cluster did not come up in 120 s: {last}"))
    }

    async fn check(&self, synchronous: bool) -> Result<(), String> {
        let primary = self.primary().await.ok_or("no single primary")?;
        let mut conn = PgConnection::connect(&Self::node_url(&self.nodes[primary]))
            .await
            .map_err(|e| e.to_string())?;
        let streaming: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_replication \
             WHERE state = 'streaming' AND (NOT $1 OR sync_state = 'sync')",
        )
        .bind(synchronous)
        .fetch_one(&mut conn)
        .await
        .map_err(|e| e.to_string())?;
        if streaming != 1 {
            return Err(format!("{streaming} replicas streaming"));
        }
        let routed = self.routed().await?;
        if routed != [self.nodes[primary].name.clone()] {
            return Err(format!("HAProxy routes to {routed:?}"));
        }
        let mut front = PgConnection::connect(&self.url())
            .await
            .map_err(|e| e.to_string())?;
        let recovering: bool = sqlx::query_scalar("SELECT pg_is_in_recovery()")
            .fetch_one(&mut front)
            .await
            .map_err(|e| e.to_string())?;
        if recovering {
            return Err("HAProxy reached a replica".into());
        }
        Ok(())
    }

    /// SIGKILLs the primary's postmaster (its backends follow), as when PostgreSQL
    /// crashes or is OOM-killed, and the WAL sender stalled by
    /// [`Cluster::stall_replication`], which cannot notice while stopped; Patroni
    /// on that node stays up. The node killed.
    pub async fn kill_primary(&self, stalled: Option<&str>) -> Result<usize, String> {
        let primary = self.primary().await.ok_or("no single primary to kill")?;
        let pid_file = self.nodes[primary].data.join("postmaster.pid");
        let pid = std::fs::read_to_string(&pid_file)
            .map_err(|e| format!("{}: {e}", pid_file.display()))?;
        signal(pid.lines().next().unwrap_or_default().trim(), "KILL")?;
        if let Some(sender) = stalled {
            signal(sender, "KILL")?;
        }
        Ok(primary)
    }

    /// SIGSTOPs the primary's WAL sender: from now on the replica receives nothing
    /// more, so it falls behind (asynchronous) or the primary's commits wait for it
    /// (synchronous). The sender's pid, for [`Cluster::kill_primary`].
    pub async fn stall_replication(&self) -> Result<String, String> {
        let primary = self.primary().await.ok_or("no single primary")?;
        let mut conn = PgConnection::connect(&Self::node_url(&self.nodes[primary]))
            .await
            .map_err(|e| e.to_string())?;
        // Patroni may restart the replica's WAL receiver after bring-up: wait for
        // a sender that streams.
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let pid: Option<i32> = sqlx::query_scalar(
                "SELECT pid FROM pg_stat_replication WHERE state = 'streaming' LIMIT 1",
            )
            .fetch_optional(&mut conn)
            .await
            .map_err(|e| format!("the primary's WAL sender: {e}"))?;
            if let Some(pid) = pid {
                signal(&pid.to_string(), "STOP")?;
                return Ok(pid.to_string());
            }
            if Instant::now() > deadline {
                return Err("no WAL sender streaming for 20 s".into());
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Waits until another node than `old` is the primary and HAProxy routes to it
    /// alone, then until `old` streams from it again (rejoined through pg_rewind).
    pub async fn settled(&self, old: usize, synchronous: bool) -> Result<(), String> {
        let deadline = Instant::now() + Duration::from_secs(90);
        let mut last = String::new();
        while Instant::now() < deadline {
            match self.primary().await {
                Some(new) if new != old => match self.check(synchronous).await {
                    Ok(()) => return Ok(()),
                    Err(why) => last = why,
                },
                other => last = format!("primary {other:?}"),
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        Err(format!("no failover within 90 s: {last}"))
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for child in self.children.iter_mut().rev() {
            let _ = child.kill();
            let _ = child.wait();
        }
        // PostgreSQL's processes are Patroni's children; each command line names
        // this run's directory.
        let _ = Command::new("pkill")
            .arg("-KILL")
            .arg("-f")
            .arg(self.dir.as_os_str())
            .status();
        if self.keep {
            eprintln!("failover: logs kept in {}", self.dir.display());
        } else {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

fn signal(pid: &str, signal: &str) -> Result<(), String> {
    let sent = Command::new("kill")
        .args([&format!("-{signal}"), pid])
        .status()
        .map_err(|e| e.to_string())?;
    if sent.success() {
        Ok(())
    } else {
        Err(format!("kill -{signal} {pid} failed"))
    }
}

fn patroni_config(
    scope: &str,
    node: &Node,
    home: &Path,
    bin: &Path,
    etcd: u16,
    synchronous: bool,
) -> String {
    let mut yaml = String::new();
    let home = home.display();
    let _ = write!(
        yaml,
        r#"scope: {scope}
name: {name}
log:
  level: WARNING
restapi:
  listen: 127.0.0.1:{rest}
  connect_address: 127.0.0.1:{rest}
etcd3:
  hosts: 127.0.0.1:{etcd}
bootstrap:
  dcs:
    ttl: 10
    loop_wait: 2
    retry_timeout: 3
    master_start_timeout: 0
    synchronous_mode: {synchronous}
    postgresql:
      use_pg_rewind: true
      use_slots: true
      parameters:
        wal_log_hints: "on"
        max_connections: 200
  initdb:
    - encoding: UTF8
postgresql:
  listen: 127.0.0.1:{port}
  connect_address: 127.0.0.1:{port}
  data_dir: {data}
  bin_dir: {bin}
  pgpass: {home}/pgpass
  authentication:
    superuser:
      username: postgres
    replication:
      username: postgres
    rewind:
      username: postgres
  parameters:
    unix_socket_directories: {home}
  pg_hba:
    - local all all trust
    - host all all 127.0.0.1/32 trust
    - host replication all 127.0.0.1/32 trust
"#,
        name = node.name,
        rest = node.rest,
        port = node.port,
        data = node.data.display(),
        bin = bin.display(),
    );
    yaml
}

fn haproxy_config(nodes: &[Node; 2], front: u16, stats: u16) -> String {
    let mut cfg = format!(
        "global\n  maxconn 1000\n\
         defaults\n  mode tcp\n  timeout connect 2s\n  timeout client 30m\n  timeout server 30m\n  timeout check 1s\n\
         listen primary\n  bind 127.0.0.1:{front}\n\
         \x20 option httpchk OPTIONS /primary\n  http-check expect status 200\n\
         \x20 default-server inter 500ms fall 2 rise 1 on-marked-down shutdown-sessions\n"
    );
    for node in nodes {
        let _ = writeln!(
            cfg,
            "  server {} 127.0.0.1:{} check port {}",
            node.name, node.port, node.rest
        );
    }
    let _ = write!(
        cfg,
        "listen stats\n  mode http\n  bind 127.0.0.1:{stats}\n  stats enable\n  stats uri /\n"
    );
    cfg
}

/// Where `program` is: on `PATH`, or in the system directories a user's `PATH`
/// may lack.
fn find(program: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/sbin", "/sbin", "/usr/bin"].map(PathBuf::from))
        .map(|dir| dir.join(program))
        .find(|file| file.is_file())
}

fn program(program: &str) -> Command {
    Command::new(find(program).unwrap_or_else(|| PathBuf::from(program)))
}

/// The newest PostgreSQL's binaries Debian installed.
fn postgres_bin() -> Result<PathBuf, String> {
    let root = Path::new("/usr/lib/postgresql");
    let newest = std::fs::read_dir(root)
        .map_err(|e| format!("{}: {e}", root.display()))?
        .filter_map(Result::ok)
        .filter_map(|entry| entry.file_name().to_str()?.parse::<u32>().ok())
        .max()
        .ok_or("no PostgreSQL under /usr/lib/postgresql")?;
    Ok(root.join(newest.to_string()).join("bin"))
}

/// Ports free now; held together so no two are the same.
fn free_ports(n: usize) -> Result<Vec<u16>, String> {
    let held: Vec<std::net::TcpListener> = (0..n)
        .map(|_| std::net::TcpListener::bind("127.0.0.1:0"))
        .collect::<Result<_, _>>()
        .map_err(|e| e.to_string())?;
    held.iter()
        .map(|l| l.local_addr().map(|a| a.port()).map_err(|e| e.to_string()))
        .collect()
}

fn nanos() -> u32 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos())
}

/// GET, with a 2 s bound: status and body.
async fn get(url: &str) -> Result<(u16, String), String> {
    let http = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let request = http::Request::get(url)
        .body(Full::new(Bytes::new()))
        .map_err(|e| e.to_string())?;
    let answered = async {
        let response = http.request(request).await.map_err(|e| e.to_string())?;
        let status = response.status().as_u16();
        let body = response
            .into_body()
            .collect()
            .await
            .map_err(|e| e.to_string())?
            .to_bytes();
        Ok((status, String::from_utf8_lossy(&body).into_owned()))
    };
    tokio::time::timeout(Duration::from_secs(2), answered)
        .await
        .map_err(|_| format!("{url}: no answer in 2 s"))?
}
