//! A real Mosquitto broker child process on a free port, for the tests of
//! `[mqtt] mode = "external"`: anonymous, or with a password file and an
//! ACL file (those `edgeway mqtt-acl` writes).
//!
//! The binary is `$EDGEWAY_MOSQUITTO`, else `/usr/sbin/mosquitto`, else
//! `mosquitto` on the `PATH`.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use tokio::process::{Child, Command};

use super::nats_server::NatsServer;
use super::TempDir;

pub struct Mosquitto {
    pub port: u16,
    /// A second listener with TLS ([`Mosquitto::with_acl_and_tls`]).
    pub tls_port: Option<u16>,
    child: Option<Child>,
    /// The config file and the broker's log (`mosquitto.log`).
    pub dir: TempDir,
}

impl Mosquitto {
    /// Where the `mosquitto` binary is, if anywhere.
    pub fn binary() -> Option<PathBuf> {
        if let Some(p) = std::env::var_os("EDGEWAY_MOSQUITTO").map(PathBuf::from).filter(|p| p.exists()) {
            return Some(p);
        }
        let sbin = PathBuf::from("/usr/sbin/mosquitto");
        if sbin.exists() {
            return Some(sbin);
        }
        std::env::var_os("PATH")?.to_str()?.split(':').map(|d| PathBuf::from(d).join("mosquitto")).find(|p| p.exists())
    }

    /// Starts a broker on a free port that takes anyone.
    pub async fn anonymous() -> Mosquitto {
        Self::start("allow_anonymous true\n").await
    }

    /// Starts a broker that takes only the users of `password_file`, each
    /// limited by `acl_file` (both copied: the broker reads them again at
    /// a restart).
    pub async fn with_acl(password_file: &Path, acl_file: &Path) -> Mosquitto {
        Self::start_with(|dir| {
            let (passwd, acl) = (dir.join("mosquitto.passwd"), dir.join("mosquitto.acl"));
            std::fs::copy(password_file, &passwd).expect("copy the password file");
            std::fs::copy(acl_file, &acl).expect("copy the ACL file");
            format!("allow_anonymous false\npassword_file {}\nacl_file {}\n", passwd.display(), acl.display())
        })
        .await
    }

    /// [`Self::with_acl`] with a second listener, on `tls_port`, that
    /// speaks TLS with this certificate and key (PEM).
    pub async fn with_acl_and_tls(password_file: &Path, acl_file: &Path, cert: &Path, key: &Path) -> Mosquitto {
        let tls_port = NatsServer::free_port();
        let mut m = Self::start_with(|dir| {
            let (passwd, acl) = (dir.join("mosquitto.passwd"), dir.join("mosquitto.acl"));
            std::fs::copy(password_file, &passwd).expect("copy the password file");
            std::fs::copy(acl_file, &acl).expect("copy the ACL file");
            format!(
                "allow_anonymous false\npassword_file {}\nacl_file {}\nlistener {tls_port} 127.0.0.1\ncertfile {}\nkeyfile {}\n",
                passwd.display(),
                acl.display(),
                cert.display(),
                key.display()
            )
        })
        .await;
        m.tls_port = Some(tls_port);
        m
    }

    /// Starts a broker with these config lines (besides its listener and
    /// log) and waits until it takes connections.
    pub async fn start(lines: &str) -> Mosquitto {
        Self::start_with(|_| lines.to_string()).await
    }

    /// [`Self::start`] with config lines made knowing the broker's folder.
    async fn start_with(lines: impl FnOnce(&Path) -> String) -> Mosquitto {
        let dir = TempDir::new("edgeway-mosquitto");
        let lines = lines(&dir.0);
        let port = NatsServer::free_port();
        let conf = dir.0.join("mosquitto.conf");
        let log = dir.0.join("mosquitto.log");
        // As root, Mosquitto 2 switches to user `mosquitto`, which cannot
        // read this private folder: stay.
        // SAFETY: geteuid has no preconditions and cannot fail.
        let root = unsafe { libc::geteuid() } == 0;
        let text = format!(
            "listener {port} 127.0.0.1\nset_tcp_nodelay true\npersistence false\nlog_dest file {}\nlog_type all\n{}{lines}",
            log.display(),
            if root { "user root\n" } else { "" }
        );
        std::fs::write(&conf, text).expect("write mosquitto.conf");
        let mut m = Mosquitto { port, tls_port: None, child: None, dir };
        m.restart().await;
        m
    }

    /// Starts the broker (again) on its port with its config, and waits
    /// until it takes connections.
    pub async fn restart(&mut self) {
        self.stop().await;
        let bin = Self::binary().expect("mosquitto not found (apt-get install mosquitto)");
        let mut cmd = Command::new(bin);
        cmd.arg("-c").arg(self.dir.0.join("mosquitto.conf"));
        cmd.stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::null()).kill_on_drop(true);
        self.child = Some(cmd.spawn().expect("start mosquitto"));
        let port = self.port;
        let up = tokio::time::timeout(Duration::from_secs(20), async {
            while tokio::net::TcpStream::connect(("127.0.0.1", port)).await.is_err() {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
        .await;
        if up.is_err() {
            panic!("mosquitto on port {port} not ready after 20 s:\n{}", self.log());
        }
    }

    pub fn addr(&self) -> std::net::SocketAddr {
        std::net::SocketAddr::from(([127, 0, 0, 1], self.port))
    }

    /// What the broker logged so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.0.join("mosquitto.log")).unwrap_or_default()
    }

    /// Kills the broker (clients see their connections drop).
    pub async fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill().await;
        }
    }
}

impl Drop for Mosquitto {
    fn drop(&mut self) {
        if let Some(c) = self.child.as_mut() {
            let _ = c.start_kill();
        }
    }
}
