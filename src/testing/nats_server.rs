//! A real `nats-server` child process on a free port, for tests and
//! benchmarks: started, stopped and restarted on the same port (and the
//! same JetStream directory) while a gateway runs.
//!
//! The binary is `$EDGEWAY_CACHE/bin/nats-server`, else
//! `~/.cache/edgeway/bin/nats-server` (both installed by
//! `scripts/setup-deps.sh`), else `nats-server` on the `PATH`.
//!
//! [`NatsCluster`]: three such servers with JetStream, routed to each
//! other as one cluster, each with its own store directory.

use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

use super::TempDir;

pub struct NatsServer {
    pub port: u16,
    jetstream: bool,
    /// More arguments (the cluster's `--cluster`, `--routes`, `-n`).
    args: Vec<String>,
    child: Option<Child>,
    dir: TempDir,
}

impl NatsServer {
    /// Where the `nats-server` binary is, if anywhere.
    pub fn binary() -> Option<PathBuf> {
        let cache = std::env::var_os("EDGEWAY_CACHE")
            .map(PathBuf::from)
            .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/edgeway")));
        if let Some(p) = cache.map(|c| c.join("bin/nats-server")).filter(|p| p.exists()) {
            return Some(p);
        }
        std::env::var_os("PATH")?
            .to_str()?
            .split(':')
            .map(|d| PathBuf::from(d).join("nats-server"))
            .find(|p| p.exists())
    }

    /// A free TCP port on 127.0.0.1 (nothing listens on it when this returns).
    pub fn free_port() -> u16 {
        std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).expect("free port").port()
    }

    /// Starts a server on a free port (with JetStream when asked) and waits
    /// until it says it is ready.
    pub async fn start(jetstream: bool) -> NatsServer {
        let mut s = NatsServer {
            port: Self::free_port(),
            jetstream,
            args: Vec::new(),
            child: None,
            dir: TempDir::new("edgeway-nats"),
        };
        s.restart().await;
        s
    }

    /// A server that is not running yet, with its port chosen: for a gateway
    /// that must start while the bus is down. [`Self::restart`] starts it.
    pub fn stopped(jetstream: bool) -> NatsServer {
        NatsServer {
            port: Self::free_port(),
            jetstream,
            args: Vec::new(),
            child: None,
            dir: TempDir::new("edgeway-nats"),
        }
    }

    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// Kills the server (the gateway sees the connection drop).
    pub async fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill().await;
        }
    }

    /// Starts the server again on the same port and data directory.
    pub async fn restart(&mut self) {
        self.stop().await;
        let bin = Self::binary().expect("nats-server not found: run scripts/setup-deps.sh");
        let mut cmd = Command::new(bin);
        cmd.args(["-a", "127.0.0.1", "-p", &self.port.to_string()]);
        if self.jetstream {
            cmd.arg("-js").arg("-sd").arg(&self.dir.0);
        }
        cmd.args(&self.args);
        cmd.stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::piped()).kill_on_drop(true);
        let mut child = cmd.spawn().expect("start nats-server");
        let mut lines = BufReader::new(child.stderr.take().expect("stderr")).lines();
        let ready = tokio::time::timeout(Duration::from_secs(20), async {
            let mut log = String::new();
            while let Ok(Some(l)) = lines.next_line().await {
                log.push_str(&l);
                log.push('\n');
                if l.contains("Server is ready") {
                    return Ok(());
                }
            }
            Err(log)
        })
        .await;
        match ready {
            Ok(Ok(())) => {}
            Ok(Err(log)) => panic!("nats-server on port {} did not start:\n{log}", self.port),
            Err(_) => panic!("nats-server on port {} not ready after 20 s", self.port),
        }
        // Keep reading so the server never blocks on a full pipe.
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        self.child = Some(child);
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        if let Some(c) = self.child.as_mut() {
            let _ = c.start_kill();
        }
    }
}

/// Three `nats-server`s with JetStream on free ports, routed into one
/// cluster (`edgeway-test`), each with its own store directory.
pub struct NatsCluster {
    pub servers: Vec<NatsServer>,
}

impl NatsCluster {
    /// Starts the three servers and waits until JetStream answers on each
    /// (a meta leader is elected and every server knows it).
    pub async fn start() -> NatsCluster {
        // Ports are picked free and then released: another test of the same
        // binary may take one before its server binds it, and the cluster
        // never forms. Such a cluster is dropped and made again on others.
        for attempt in 1..=3 {
            let c = Self::start_once().await;
            if c.jetstream_ready(&[0, 1, 2], Duration::from_secs(30)).await {
                return c;
            }
            eprintln!(
                "NATS cluster on {} formed no JetStream quorum (attempt {attempt}); again on other ports",
                c.url()
            );
        }
        panic!("no NATS cluster with JetStream after three attempts");
    }

    async fn start_once() -> NatsCluster {
        let cluster_ports: Vec<u16> = (0..3).map(|_| NatsServer::free_port()).collect();
        let mut servers: Vec<NatsServer> = (0..3).map(|_| NatsServer::stopped(true)).collect();
        for (i, s) in servers.iter_mut().enumerate() {
            let routes: Vec<String> = cluster_ports
                .iter()
                .enumerate()
                .filter(|(j, _)| *j != i)
                .map(|(_, p)| format!("nats://127.0.0.1:{p}"))
                .collect();
            s.args = vec![
                "-n".into(),
                format!("edgeway-test-{i}"),
                "--cluster_name".into(),
                "edgeway-test".into(),
                "--cluster".into(),
                format!("nats://127.0.0.1:{}", cluster_ports[i]),
                "--routes".into(),
                routes.join(","),
            ];
        }
        // Started together: each waits for a JetStream quorum.
        futures::future::join_all(servers.iter_mut().map(|s| s.restart())).await;
        NatsCluster { servers }
    }

    pub fn url(&self) -> String {
        self.servers.iter().map(NatsServer::url).collect::<Vec<_>>().join(",")
    }

    /// Whether JetStream answers an account query on each of the servers
    /// `which` within `limit`.
    async fn jetstream_ready(&self, which: &[usize], limit: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + limit;
        for &i in which {
            let url = self.servers[i].url();
            loop {
                let ok = async {
                    let c = async_nats::connect(&url).await.ok()?;
                    let js = async_nats::jetstream::new(c);
                    tokio::time::timeout(Duration::from_secs(2), js.query_account()).await.ok()?.ok()
                }
                .await;
                if ok.is_some() {
                    break;
                }
                if tokio::time::Instant::now() >= deadline {
                    return false;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
        true
    }
}
