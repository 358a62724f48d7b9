//! Server processes the suite starts, freezes and kills, and the HTTP it speaks to them.

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt as _, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use idem_axum::client::{Receipt, Retry, RetryLayer, RetryPolicy};
use tokio::io::{AsyncBufReadExt as _, BufReader};
use tower::{Layer as _, Service as _, ServiceExt as _};

use crate::example;
use crate::server::ROLE;

/// A server process, killed when dropped.
pub struct Proc {
    child: Child,
    pub addr: String,
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Proc {
    /// This binary as the suite's server on `url`, with extra environment.
    pub async fn server(url: &str, env: &[(&str, &str)]) -> Result<Self, String> {
        let exe = std::env::current_exe().map_err(|e| e.to_string())?;
        let mut command = Command::new(exe);
        command.env(ROLE, "server").env("DATABASE_URL", url);
        for (name, value) in env {
            command.env(name, value);
        }
        Self::start(command).await
    }

    /// The payments example on `url`, its provider answering after `latency_ms`.
    pub async fn payments(
        url: &str,
        latency_ms: u64,
        env: &[(&str, &str)],
    ) -> Result<Self, String> {
        let binary = tokio::task::spawn_blocking(example::binary)
            .await
            .map_err(|e| e.to_string())?;
        let mut command = Command::new(binary);
        command
            .env("DATABASE_URL", url)
            .env("BIND", "127.0.0.1:0")
            .env("PROVIDER_LATENCY_MS", latency_ms.to_string())
            .env_remove("FAULT_ABORT_AFTER_COMMIT")
            .current_dir(std::env::temp_dir());
        for (name, value) in env {
            command.env(name, value);
        }
        Self::start(command).await
    }

    async fn start(mut command: Command) -> Result<Self, String> {
        let child = command
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| format!("spawn: {e}"))?;
        let mut proc = Self {
            child,
            addr: String::new(),
        };
        let stdout = proc.child.stdout.take().ok_or("no stdout")?;
        let stdout = tokio::process::ChildStdout::from_std(stdout).map_err(|e| e.to_string())?;
        let mut lines = BufReader::new(stdout).lines();
        let first = tokio::time::timeout(Duration::from_secs(120), lines.next_line())
            .await
            .map_err(|_| "the server printed nothing within 120 s".to_owned())?
            .map_err(|e| e.to_string())?
            .ok_or("the server exited before listening")?;
        proc.addr = first
            .split("http://")
            .nth(1)
            .and_then(|rest| rest.split_whitespace().next())
            .ok_or_else(|| format!("no address in {first:?}"))?
            .to_owned();
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        Ok(proc)
    }

    /// SIGKILL: no cleanup of any kind, as when a machine or container dies.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Whether the process has exited (by itself).
    pub fn exited(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(Some(_)))
    }

    /// SIGSTOP / SIGCONT: the whole process frozen, as in a long GC pause or a
    /// suspended VM, then thawed.
    pub fn signal(&self, signal: &str) {
        let _ = Command::new("kill")
            .args([format!("-{signal}"), self.child.id().to_string()])
            .status();
    }
}

/// One HTTP answer.
#[derive(Debug, Clone)]
pub struct Answer {
    pub status: u16,
    pub content_type: Option<String>,
    pub body: Bytes,
    pub replayed: bool,
    pub attempts: u32,
}

impl Answer {
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

pub type Http = Retry<Client<HttpConnector, Full<Bytes>>>;

/// A client that sends each request once (`attempts` 1), or retries it as the
/// library's retrying client does.
pub fn client(attempts: u32) -> Http {
    let http = Client::builder(TokioExecutor::new())
        .pool_idle_timeout(Duration::from_secs(5))
        .build_http();
    let policy = RetryPolicy::new()
        .max_attempts(attempts)
        .base_delay(Duration::from_millis(50))
        .max_backoff(Duration::from_secs(1))
        .max_delay(Duration::from_secs(40));
    RetryLayer::new(policy).layer(http)
}

/// POSTs `body` with `headers`; `Err` for a transport failure after all attempts.
pub async fn post(
    client: &Http,
    addr: &str,
    path: &str,
    headers: &[(&str, String)],
    body: String,
) -> Result<Answer, String> {
    let mut request = http::Request::post(format!("http://{addr}{path}"));
    for (name, value) in headers {
        request = request.header(*name, value);
    }
    let request = request
        .body(Full::new(Bytes::from(body)))
        .map_err(|e| e.to_string())?;
    let mut client = client.clone();
    let response = client
        .ready()
        .await
        .map_err(|e| e.to_string())?
        .call(request)
        .await
        .map_err(|e| e.to_string())?;
    let receipt = response.extensions().get::<Receipt>().cloned();
    let status = response.status().as_u16();
    let content_type = response
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let body = response
        .into_body()
        .collect()
        .await
        .map_err(|e| e.to_string())?
        .to_bytes();
    Ok(Answer {
        status,
        content_type,
        body,
        replayed: receipt.as_ref().is_some_and(Receipt::replayed),
        attempts: receipt.map_or(1, |r| r.attempts()),
    })
}

/// Waits (up to 20 s) until the server's handler for `note` has made its write.
pub async fn await_started(addr: &str, note: &str) -> Result<(), String> {
    let http = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    for _ in 0..400 {
        let request = http::Request::get(format!("http://{addr}/started/{note}"))
            .body(Full::new(Bytes::new()))
            .map_err(|e| e.to_string())?;
        if let Ok(response) = http.request(request).await
            && response.status() == 200
        {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Err(format!("the handler for {note} never started"))
}

/// GETs a JSON document.
pub async fn get_json(
    addr: &str,
    path: &str,
    user: Option<&str>,
) -> Result<serde_json::Value, String> {
    let http = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let mut request = http::Request::get(format!("http://{addr}{path}"));
    if let Some(user) = user {
        request = request.header("authorization", format!("Bearer {user}"));
    }
    let request = request
        .body(Full::new(Bytes::new()))
        .map_err(|e| e.to_string())?;
    let response = http.request(request).await.map_err(|e| e.to_string())?;
    let body = response
        .into_body()
        .collect()
        .await
        .map_err(|e| e.to_string())?
        .to_bytes();
    serde_json::from_slice(&body).map_err(|e| format!("{e}: {}", String::from_utf8_lossy(&body)))
}
