//! The `edgeway` command: `serve`, `check-config`, `hash-key`, `hash-password`,
//! `mqtt-acl`, `status`, `audit verify|export`.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};
use edgeway::config::Config;

/// mimalloc instead of glibc's malloc: a request allocates and frees a few
/// hundred blocks, many freed on another thread than the one that made
/// them (the store's writer, the log writer), where glibc's arenas spent
/// about 15 % of a request's instructions (BENCHMARKS.md, session 16).
/// Only the binary: the library leaves the choice to whoever links it.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
#[command(name = "edgeway", version, about = "Edge AI gateway")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run the gateway.
    Serve {
        #[arg(long, short, default_value = "config/edgeway.toml")]
        config: PathBuf,
    },
    /// Validate a config file (with EDGEWAY__… overrides applied) and explain it.
    CheckConfig { file: PathBuf },
    /// Print the SHA-256 digest of an API key, for `api_key_sha256`.
    HashKey { key: String },
    /// Print a salted Argon2id hash of a device password, for `[devices.ID] password_hash`.
    HashPassword { password: String },
    /// Write an external MQTT broker's ACLs and password file from the device registry
    /// (`[mqtt] mode = "external"`): `mosquitto.acl`, `mosquitto.passwd`, `emqx-acl.conf`.
    /// Device passwords come from the variables their `mqtt_password_env` names.
    MqttAcl {
        #[arg(long, short, default_value = "config/edgeway.toml")]
        config: PathBuf,
        /// The folder to write the files into.
        #[arg(long, default_value = ".")]
        out: PathBuf,
        /// Write the ACL files only (no password file, no device passwords needed).
        #[arg(long)]
        acl_only: bool,
    },
    /// Show what a running edgeway is doing, as text (reads `GET /admin/status`).
    Status {
        /// The gateway's base URL: `http.admin_listen` where it is set, else `http.listen`.
        #[arg(long, default_value = "http://127.0.0.1:8080")]
        url: String,
        /// An admin application's API key; default: the EDGEWAY_ADMIN_KEY environment variable
        /// (which keeps it out of the process list).
        #[arg(long)]
        key: Option<String>,
        /// Print the JSON snapshot instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Check or export the audit trail of a task store (safe while edgeway runs).
    Audit {
        #[command(subcommand)]
        cmd: AuditCmd,
    },
}

#[derive(Subcommand)]
enum AuditCmd {
    /// Walk the hash chain: exit 0 when it holds, 1 naming the first record that
    /// does not (edited, deleted or reordered), 2 when the store cannot be read.
    /// With --config, also warns when the chain's anchor (where retention cut
    /// it) is younger than the configured audit retention allows (a forged
    /// anchor, or records deleted by hand); exit 0 all the same.
    Verify {
        #[arg(long, default_value = "data/edgeway.db")]
        db: PathBuf,
        /// The gateway's configuration, for its audit retention.
        #[arg(long)]
        config: Option<PathBuf>,
    },
    /// Write audit records as JSON lines to stdout, oldest first.
    Export {
        #[arg(long, default_value = "data/edgeway.db")]
        db: PathBuf,
        /// From this time on: unix milliseconds, RFC 3339 or a date (UTC).
        #[arg(long)]
        since: Option<String>,
        /// Before this time (same forms).
        #[arg(long)]
        until: Option<String>,
        /// Only this tenant's records.
        #[arg(long)]
        tenant: Option<String>,
    },
}

/// mimalloc's `purge_delay` option (the same index in its v2 and v3).
const MI_OPTION_PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;

/// Sets mimalloc's purge delay to 0 (it is 10 ms by default, 100 ms for its
/// arenas), unless `MIMALLOC_PURGE_DELAY` says otherwise. A delayed purge
/// only happens at a later allocation or free, and an idle gateway makes
/// few: what start-up and a burst freed stayed resident (an idle gateway
/// configured for 10 000 devices held 66 MiB against glibc's 37; with the
/// purge at once, 25 MiB), at no measured cost per request (BENCHMARKS.md,
/// session 17).
fn return_freed_memory_at_once() {
    if std::env::var_os("MIMALLOC_PURGE_DELAY").is_none() {
        // SAFETY: called first thing in `main`, before any other thread
        // exists (mimalloc's option setters are not thread-safe).
        unsafe { libmimalloc_sys::mi_option_set(MI_OPTION_PURGE_DELAY, 0) };
    }
}

fn main() -> ExitCode {
    return_freed_memory_at_once();
    let cli = Cli::parse();
    match cli.cmd {
        Cmd::CheckConfig { file } => match Config::load(&file) {
            Ok(c) => {
                print!("{} is valid.\n{}", file.display(), c.explain());
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprint!("{}: {e}", file.display());
                ExitCode::from(2)
            }
        },
        Cmd::HashKey { key } => {
            println!("{}", hex::encode(edgeway::config::hash_api_key(&key)));
            ExitCode::SUCCESS
        }
        Cmd::HashPassword { password } => {
            println!("{}", edgeway::ingress::mqtt::auth::hash_password(&password));
            ExitCode::SUCCESS
        }
        Cmd::Status { url, key, json } => {
            let Some(key) = key.or_else(|| std::env::var("EDGEWAY_ADMIN_KEY").ok()) else {
                eprintln!("edgeway status: an admin application's key is needed (--key or EDGEWAY_ADMIN_KEY)");
                return ExitCode::from(2);
            };
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("tokio runtime");
            match rt.block_on(status(&url, &key)) {
                Ok(v) if json => {
                    println!("{v:#}");
                    ExitCode::SUCCESS
                }
                Ok(v) => {
                    print!("{}", edgeway::ingress::http::render_status_text(&v));
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    eprintln!("edgeway status: {e}");
                    ExitCode::FAILURE
                }
            }
        }
        Cmd::Audit { cmd } => audit(cmd),
        Cmd::MqttAcl { config, out, acl_only } => mqtt_acl(&config, &out, acl_only),
        Cmd::Serve { config } => {
            let cfg = match Config::load(&config) {
                Ok(c) => c,
                Err(e) => {
                    eprint!("{}: {e}", config.display());
                    return ExitCode::from(2);
                }
            };
            let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build().expect("tokio runtime");
            rt.block_on(serve(cfg))
        }
    }
}

/// `GET {url}/admin/status` with `key`: the snapshot, or why not.
async fn status(url: &str, key: &str) -> Result<serde_json::Value, String> {
    edgeway::tls::install_default_provider();
    let client = reqwest::Client::builder().timeout(Duration::from_secs(10)).build().map_err(|e| e.to_string())?;
    let endpoint = format!("{}/admin/status", url.trim_end_matches('/'));
    let resp = client.get(&endpoint).bearer_auth(key).send().await.map_err(|e| format!("{endpoint}: {e}"))?;
    let code = resp.status();
    let body: serde_json::Value = resp.json().await.map_err(|e| format!("{endpoint}: {code}: {e}"))?;
    if !code.is_success() {
        let msg = body["error"]["message"].as_str().unwrap_or("");
        return Err(format!("{endpoint}: {code} {}: {msg}", body["error"]["code"].as_str().unwrap_or("")));
    }
    Ok(body)
}

/// `edgeway mqtt-acl`: exit 0 with the files written, 2 when the config or
/// a device password is not usable, 1 when a file cannot be written.
fn mqtt_acl(config: &std::path::Path, out: &std::path::Path, acl_only: bool) -> ExitCode {
    let cfg = match Config::load(config) {
        Ok(c) => c,
        Err(e) => {
            eprint!("{}: {e}", config.display());
            return ExitCode::from(2);
        }
    };
    let files = match edgeway::ingress::mqtt::acl::broker_files(&cfg, |v| std::env::var(v).ok(), !acl_only) {
        Ok(f) => f,
        Err(e) => {
            eprintln!("edgeway mqtt-acl: {e}");
            return ExitCode::from(2);
        }
    };
    match edgeway::ingress::mqtt::acl::write_files(out, &files) {
        Ok(written) => {
            for f in written {
                println!("wrote {}", f.display());
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("edgeway mqtt-acl: {e}");
            ExitCode::FAILURE
        }
    }
}

fn audit(cmd: AuditCmd) -> ExitCode {
    use edgeway::store::audit;
    let open = |db: &PathBuf| {
        // Read-only and never created: a wrong path is an error, not an empty chain.
        audit::open_read_only(db).map_err(|e| eprintln!("cannot open the task store {}: {e}", db.display())).ok()
    };
    match cmd {
        AuditCmd::Verify { db, config } => {
            let retention = match config.as_deref().map(Config::load).transpose() {
                Ok(c) => c.map(|c| c.store.retention_audit),
                Err(e) => {
                    eprintln!("{e}");
                    return ExitCode::from(2);
                }
            };
            let Some(c) = open(&db) else { return ExitCode::from(2) };
            match audit::verify(&c) {
                Ok(n) => {
                    println!("audit chain intact: {n} records");
                    let now = edgeway::task::now_ms();
                    match retention.map(|r| audit::anchor_warning(&c, now, r)) {
                        Some(Ok(Some(w))) => eprintln!("warning: {w}"),
                        Some(Err(e)) => eprintln!("warning: cannot read the anchor: {e}"),
                        _ => {}
                    }
                    ExitCode::SUCCESS
                }
                Err(audit::VerifyError::Broken(b)) => {
                    eprintln!("audit chain broken at {b}");
                    ExitCode::from(1)
                }
                Err(e) => {
                    eprintln!("{e}");
                    ExitCode::from(2)
                }
            }
        }
        AuditCmd::Export { db, since, until, tenant } => {
            let time = |s: Option<String>, what: &str| match s {
                None => Ok(None),
                Some(s) => edgeway::gateway::parse_time(&s)
                    .map(Some)
                    .ok_or_else(|| eprintln!("--{what} {s:?}: expected unix milliseconds, RFC 3339 or YYYY-MM-DD")),
            };
            let (Ok(since_ms), Ok(until_ms)) = (time(since, "since"), time(until, "until")) else {
                return ExitCode::from(2);
            };
            let Some(c) = open(&db) else { return ExitCode::from(2) };
            let mut q = audit::AuditQuery { tenant, since_ms, until_ms, after_seq: None, limit: 1000 };
            let mut out = std::io::BufWriter::new(std::io::stdout().lock());
            loop {
                let page = match audit::query(&c, &q) {
                    Ok(p) => p,
                    Err(e) => {
                        eprintln!("cannot read the audit log: {e}");
                        return ExitCode::from(2);
                    }
                };
                for r in &page {
                    use std::io::Write;
                    if serde_json::to_writer(&mut out, r).is_err() || out.write_all(b"\n").is_err() {
                        return ExitCode::from(2);
                    }
                }
                match page.last() {
                    Some(r) if page.len() == q.limit => q.after_seq = Some(r.seq),
                    _ => break,
                }
            }
            ExitCode::SUCCESS
        }
    }
}

async fn serve(cfg: Config) -> ExitCode {
    use tokio::signal::unix::{signal, SignalKind};
    // Before any start-up work: a SIGHUP meanwhile (logrotate, an early
    // `systemctl reload`) would otherwise meet the default disposition and
    // end the process. One that arrives during start-up is taken as a
    // reload once edgeway runs (the file may have changed meanwhile).
    let hup = signal(SignalKind::hangup()).expect("SIGHUP handler");
    // Held to the end of `serve`: its drop writes the lines still queued.
    let _log_writer = edgeway::telemetry::init_logging(&cfg.log);
    let drain = cfg.server.drain_timeout;
    let running = match edgeway::server::start(cfg).await {
        Ok(r) => r,
        Err(e) => {
            tracing::error!(error = %e, "edgeway could not start");
            eprintln!("edgeway could not start: {e:#}");
            return ExitCode::FAILURE;
        }
    };
    wait_for_signal(&running.gateway, hup).await;
    tracing::info!(drain_s = drain.as_secs(), "shutting down: draining (new calls refused, running tasks may finish)");
    running.drain_and_shutdown(drain, Duration::from_secs(10)).await;
    tracing::info!("stopped");
    ExitCode::SUCCESS
}

/// SIGTERM (service managers, `docker stop`) or SIGINT (Ctrl-C): both
/// start the graceful stop. SIGHUP meanwhile reloads the configuration
/// file (refused with its errors logged, and nothing changed, when it is
/// invalid or changes what needs a restart).
async fn wait_for_signal(gateway: &edgeway::gateway::Gateway, mut hup: tokio::signal::unix::Signal) {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).expect("SIGTERM handler");
    loop {
        tokio::select! {
            _ = tokio::signal::ctrl_c() => return,
            _ = term.recv() => return,
            _ = hup.recv() => {
                tracing::info!("SIGHUP: reloading the configuration");
                // Logged and counted by the reload itself.
                let _ = gateway.reload().await;
            }
        }
    }
}
