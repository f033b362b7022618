//! Supervised engine processes (NFR-5): edgeway starts the engines whose
//! config has an `[engines.NAME.process]` section, waits until each is
//! ready before it takes work, restarts one that exits (exponential
//! backoff, at most `max_restarts` per `restart_window`, after which it
//! stays down and says why), and stops them all on shutdown.
//!
//! Owns: the child processes, their process groups, pidfiles and logs,
//! the state of each (`starting`, `ready`, `restarting`, `failed`,
//! `stopped`), the `edgeway_engine_process_*` metrics, and the adapter
//! wrapper ([`Processes::wrap`]) through which routing sees a process that
//! is not ready as an engine that is down. Does not own: what routing does
//! with a down instance (it falls back as for any engine outage, and work
//! with nowhere else to go queues while the process is `starting` or
//! `restarting`, see [`Engine::process_restarting`]; `router`,
//! `scheduler`), or when edgeway stops (`server` calls [`Processes::stop`]
//! after its drain).
//!
//! # No orphans
//! Each engine runs in its own process group (its pid is the group id), so
//! a stop reaches whatever it started. A pidfile per engine under
//! `<data_dir>/engines/` records the pid, its start time (field 22 of
//! `/proc/<pid>/stat`) and a random token that edgeway puts in the
//! engine's environment (`EDGEWAY_ENGINE_TOKEN`, inherited by its
//! children). At start, a group left by an edgeway that was killed with
//! `kill -9` is killed before the new engine starts, and only when it is
//! provably ours: its leader has the recorded start time, or a member has
//! the token in its environment. A reused pid is never signalled. On Linux
//! the engine also gets `PR_SET_PDEATHSIG` (SIGKILL when edgeway dies), a
//! second line that does not reach the engine's own children; the pidfile
//! check is the guarantee. The signal fires when the forking *thread*
//! exits, so engines are forked from one dedicated thread that lives as
//! long as edgeway, never from a tokio worker (which may exit).

use std::collections::VecDeque;
use std::fs::OpenOptions;
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use prometheus::core::{Collector, Desc};
use prometheus::proto::MetricFamily;
use prometheus::{GaugeVec, IntCounterVec, IntGaugeVec, Opts};
use serde::Serialize;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::{Capabilities, Engine, EngineError, EngineHealth, EngineLoad, EngineRequest, EngineStream};
use crate::config::{Config, EngineConfig, EngineKind, ProcessConfig};
use crate::telemetry::Metrics;

/// The environment variable that marks an engine's processes as ours.
pub const TOKEN_VAR: &str = "EDGEWAY_ENGINE_TOKEN";

/// The longest a health probe of a supervised instance whose process is
/// down waits for it to be ready (or failed) before it answers again.
const HEALTH_WAIT_MAX: Duration = Duration::from_secs(30);

/// How often edgeway checks whether an external engine (see
/// [`ProcessState::External`]) still answers.
const EXTERNAL_POLL: Duration = Duration::from_secs(5);

/// How often a starting engine's ready check is polled.
const READY_POLL: Duration = Duration::from_millis(100);

/// Where a supervised engine process is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ProcessState {
    /// Started, not ready yet (no work is sent to it).
    Starting,
    /// Passed its ready check: takes work.
    Ready,
    /// Exited (or never got ready); waits its backoff before the next start.
    Restarting,
    /// Restarted too often: stays down until edgeway restarts.
    Failed,
    /// Stopped by edgeway's shutdown.
    Stopped,
    /// Something edgeway did not start already answered at the engine's
    /// address (an engine the user runs themselves): used as an ordinary
    /// engine, not started or supervised; edgeway starts its own once the
    /// address stops answering.
    External,
}

impl ProcessState {
    pub fn as_str(self) -> &'static str {
        match self {
            ProcessState::Starting => "starting",
            ProcessState::Ready => "ready",
            ProcessState::Restarting => "restarting",
            ProcessState::Failed => "failed",
            ProcessState::Stopped => "stopped",
            ProcessState::External => "external",
        }
    }
}

/// One engine process as `/ready` shows it.
#[derive(Debug, Clone, Serialize)]
pub struct ProcessReport {
    pub instance: String,
    pub state: ProcessState,
    /// Why it is not ready (the last exit, a failed start), while it is not.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pid: Option<u32>,
    /// Restarts since edgeway started.
    pub restarts: u64,
    /// Seconds since it became ready (while it is).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub uptime_s: Option<f64>,
    pub log_file: String,
}

#[derive(Debug, Clone)]
struct Snapshot {
    state: ProcessState,
    reason: Option<String>,
    pid: Option<u32>,
    restarts: u64,
    ready_since: Option<Instant>,
}

/// The live state of one engine process, shared by its supervisor (the
/// only writer), the adapter wrapper, `/ready` and the metrics.
#[derive(Debug)]
pub struct ProcessStatus {
    name: String,
    log_file: PathBuf,
    tx: watch::Sender<Snapshot>,
}

impl ProcessStatus {
    fn new(name: &str, log_file: PathBuf) -> ProcessStatus {
        let (tx, _) = watch::channel(Snapshot {
            state: ProcessState::Starting,
            reason: None,
            pid: None,
            restarts: 0,
            ready_since: None,
        });
        ProcessStatus { name: name.to_string(), log_file, tx }
    }

    pub fn state(&self) -> ProcessState {
        self.tx.borrow().state
    }

    /// Whether the instance takes work: our process is ready, or an engine
    /// edgeway did not start answers at its address.
    fn usable(&self) -> bool {
        matches!(self.state(), ProcessState::Ready | ProcessState::External)
    }

    pub fn report(&self) -> ProcessReport {
        let s = self.tx.borrow().clone();
        ProcessReport {
            instance: self.name.clone(),
            state: s.state,
            reason: s.reason,
            pid: s.pid,
            restarts: s.restarts,
            uptime_s: s.ready_since.map(|t| t.elapsed().as_secs_f64()),
            log_file: self.log_file.display().to_string(),
        }
    }

    /// Waits until the process is in `state` (true) or `timeout` passes
    /// (false): for tests and tools that wait for a transition rather than
    /// poll.
    pub async fn wait_for(&self, state: ProcessState, timeout: Duration) -> bool {
        let mut rx = self.tx.subscribe();
        tokio::time::timeout(timeout, rx.wait_for(|s| s.state == state)).await.is_ok_and(|r| r.is_ok())
    }

    /// Records a transition and logs it (one line per change).
    fn set(&self, state: ProcessState, reason: Option<String>, pid: Option<u32>) {
        self.tx.send_modify(|s| {
            if state == ProcessState::Ready && s.state != ProcessState::Ready {
                s.ready_since = Some(Instant::now());
            } else if state != ProcessState::Ready {
                s.ready_since = None;
            }
            s.state = state;
            s.reason = reason.clone();
            s.pid = pid;
        });
        let why = reason.as_deref().unwrap_or("");
        match state {
            ProcessState::Failed | ProcessState::Restarting => {
                tracing::warn!(engine = %self.name, state = state.as_str(), pid, reason = why, log = %self.log_file.display(), "engine process state")
            }
            _ => tracing::info!(engine = %self.name, state = state.as_str(), pid, reason = why, "engine process state"),
        }
    }

    fn restarted(&self) {
        self.tx.send_modify(|s| s.restarts += 1);
    }

    /// For the wrapper's health detail and errors: the state and why.
    fn summary(&self) -> String {
        let s = self.tx.borrow();
        match &s.reason {
            Some(r) => format!("engine process {}: {r}", s.state.as_str()),
            None => format!("engine process {}", s.state.as_str()),
        }
    }
}

/// The supervised engine processes of one edgeway (none when no engine has
/// a `process` section). Cheap to clone.
#[derive(Clone, Default)]
pub struct Processes {
    inner: Arc<Inner>,
}

#[derive(Default)]
struct Inner {
    /// `<data_dir>/edgeway.lock`, locked (`flock`) while engines run: a
    /// second edgeway with the same data directory refuses to start its
    /// engines, even while ours restart (their pidfiles are gone then).
    /// The kernel drops the lock when edgeway dies, however it dies.
    lock: Mutex<Option<std::fs::File>>,
    /// The status of each engine's process, the latest per name (a
    /// changed engine's replaces the one before); shared with the metrics.
    statuses: Arc<Mutex<Vec<Arc<ProcessStatus>>>>,
    stop: CancellationToken,
    tracker: TaskTracker,
    /// Per engine: what stops its supervisor alone (a child of `stop`) and
    /// what says it ended ([`Processes::stop_one`]).
    each: Mutex<std::collections::HashMap<String, (CancellationToken, CancellationToken)>>,
    /// Supervisors a reload prepared and has not launched yet.
    prepared: Mutex<std::collections::HashMap<String, Supervisor>>,
    /// Where pidfiles go and whom the metrics are registered with: what
    /// a reload's [`Processes::prepare`] needs. `None` for the default.
    base: Option<Base>,
    /// The other nodes of the pool, for the `pool` instances of this
    /// edgeway (those of reloads too); the NATS ingress sets them.
    peers: Arc<super::pool::PeerSlot>,
}

struct Base {
    data_dir: PathBuf,
    client: reqwest::Client,
    registry: prometheus::Registry,
    metrics_registered: std::sync::atomic::AtomicBool,
}

fn locked<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // Every change is one step: a panic cannot leave half of one.
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl Processes {
    /// Kills what an earlier edgeway left (pidfiles), then starts every
    /// engine that has a `process` section, each under its own supervisor.
    /// Returns once they are started, not ready: each instance is down for
    /// routing until its ready check passes. The supervisors' metrics are
    /// registered on `metrics`.
    pub async fn start(config: &Config, metrics: &Metrics) -> anyhow::Result<Processes> {
        let client = super::http_client(Duration::from_secs(2)).map_err(|e| anyhow::anyhow!("{e}"))?;
        let processes = Processes {
            inner: Arc::new(Inner {
                base: Some(Base {
                    data_dir: config.store.data_dir.clone(),
                    client,
                    registry: metrics.registry.clone(),
                    metrics_registered: false.into(),
                }),
                ..Inner::default()
            }),
        };
        let mut names = Vec::new();
        for e in config.engines.values().filter(|e| e.process.is_some()) {
            processes.prepare(e).await?;
            names.push(e.name.clone());
        }
        for name in names {
            processes.launch(&name);
        }
        Ok(processes)
    }

    /// Makes ready to run engine `e`'s process (its status, `starting`,
    /// is what [`Processes::wrap`] hands its instance from now on) without
    /// starting it: [`Processes::launch`] does. Kills what an earlier
    /// edgeway left of it first, and takes the data directory's lock.
    /// Nothing for an engine without a `process` section.
    pub async fn prepare(&self, e: &EngineConfig) -> anyhow::Result<()> {
        let Some(p) = &e.process else { return Ok(()) };
        let base = self.inner.base.as_ref().ok_or_else(|| anyhow::anyhow!("no supervisor was started"))?;
        {
            let mut lock = locked(&self.inner.lock);
            if lock.is_none() {
                // Before anything is reaped or started.
                *lock = Some(lock_data_dir(&base.data_dir)?);
            }
        }
        let dir = base.data_dir.join("engines");
        std::fs::create_dir_all(&dir)
            .map_err(|err| anyhow::anyhow!("cannot create {} for engine pidfiles: {err}", dir.display()))?;
        let log_file = p.log_file.clone().unwrap_or_else(|| dir.join(format!("{}.log", e.name)));
        let pidfile = dir.join(format!("{}.pid", e.name));
        // An engine being replaced still runs under our own supervisor,
        // which owns its pidfile: only a stranger's is reaped.
        if !locked(&self.inner.each).contains_key(&e.name) {
            reap_stale(&e.name, &pidfile, p.stop_grace).await?;
        }
        let status = Arc::new(ProcessStatus::new(&e.name, log_file.clone()));
        let ready_path = p.ready_path.clone().unwrap_or_else(|| e.health_path.clone());
        // Registered before any engine starts: an error here leaves nothing
        // running.
        if !base.metrics_registered.swap(true, std::sync::atomic::Ordering::SeqCst) {
            base.registry
                .register(Box::new(ProcessMetrics::new(self.inner.statuses.clone())))
                .map_err(|e| anyhow::anyhow!("engine process metrics: {e}"))?;
        }
        {
            let mut statuses = locked(&self.inner.statuses);
            statuses.retain(|s| s.name != e.name);
            statuses.push(status.clone());
        }
        locked(&self.inner.prepared).insert(
            e.name.clone(),
            Supervisor {
                cfg: p.clone(),
                ready_url: format!("{}{}", e.base_url, ready_path),
                pidfile,
                log_file,
                status,
                client: base.client.clone(),
            },
        );
        Ok(())
    }

    /// What [`Processes::prepare`] replaces for engine `name` (its status
    /// in force, if any), for [`Processes::unprepare`].
    pub fn before_prepare(&self, name: &str) -> Option<Arc<ProcessStatus>> {
        self.status(name)
    }

    /// Undoes [`Processes::prepare`] for engine `name` (a reload refused
    /// after it): the prepared process is dropped and `before`, the status
    /// in force until then, is put back (review 15 M5).
    pub fn unprepare(&self, name: &str, before: Option<Arc<ProcessStatus>>) {
        locked(&self.inner.prepared).remove(name);
        let mut statuses = locked(&self.inner.statuses);
        match (statuses.iter().position(|s| s.name == name), before) {
            (Some(at), Some(old)) => statuses[at] = old,
            (Some(at), None) => {
                statuses.remove(at);
            }
            (None, Some(old)) => statuses.push(old),
            (None, None) => {}
        }
    }

    /// Starts the process [`Processes::prepare`] made ready for engine
    /// `name` under its own supervisor (an engine changed at reload: once
    /// the old process stopped). Nothing when none was prepared.
    pub fn launch(&self, name: &str) {
        let Some(s) = locked(&self.inner.prepared).remove(name) else { return };
        let (stop, ended) = (self.inner.stop.child_token(), CancellationToken::new());
        locked(&self.inner.each).insert(name.to_string(), (stop.clone(), ended.clone()));
        self.inner.tracker.spawn(async move {
            s.run(stop).await;
            ended.cancel();
        });
    }

    /// The supervised processes, in config order (then those a reload
    /// added).
    pub fn reports(&self) -> Vec<ProcessReport> {
        locked(&self.inner.statuses).iter().map(|s| s.report()).collect()
    }

    pub fn status(&self, instance: &str) -> Option<Arc<ProcessStatus>> {
        locked(&self.inner.statuses).iter().find(|s| s.name == instance).cloned()
    }

    /// The adapter routing uses for `cfg`: a supervised instance answers
    /// health probes as down, and refuses requests as unreachable, while
    /// its process is not ready, so a restart is an outage routing sees
    /// (it falls back or queues) without sending work to a dead port.
    /// Where this edgeway's pool instances find the other nodes.
    pub fn peers(&self) -> &Arc<super::pool::PeerSlot> {
        &self.inner.peers
    }

    pub fn wrap(&self, cfg: &EngineConfig, engine: Arc<dyn Engine>) -> Arc<dyn Engine> {
        match self.status(&cfg.name).filter(|_| cfg.process.is_some()) {
            Some(status) => Arc::new(Supervised { inner: engine, status, told_down: false.into() }),
            None => engine,
        }
    }

    /// Stops one engine's process as [`Processes::stop`] stops them all,
    /// and waits until it is gone: an engine a reload removed or changed,
    /// once it drained. Nothing for an engine edgeway does not run. A
    /// status prepared since (a changed engine's) stays.
    pub async fn stop_one(&self, instance: &str) {
        let one = locked(&self.inner.each).remove(instance);
        if let Some((stop, ended)) = one {
            stop.cancel();
            ended.cancelled().await;
        }
    }

    /// Stops every engine (SIGTERM to its group, SIGKILL after its
    /// `stop_grace`) and waits until they are gone. Idempotent.
    pub async fn stop(&self) {
        self.inner.stop.cancel();
        self.inner.tracker.close();
        self.inner.tracker.wait().await;
    }
}

/// The adapter of a supervised instance.
struct Supervised {
    inner: Arc<dyn Engine>,
    status: Arc<ProcessStatus>,
    /// A probe was told the process is down: the next one waits for the
    /// process to change state, so the instance is back in dispatch the
    /// moment its process is ready rather than a probe interval later.
    told_down: std::sync::atomic::AtomicBool,
}

#[async_trait]
impl Engine for Supervised {
    fn name(&self) -> &str {
        self.inner.name()
    }
    fn kind(&self) -> EngineKind {
        self.inner.kind()
    }
    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }
    async fn stream(&self, req: &EngineRequest) -> Result<EngineStream, EngineError> {
        if !self.status.usable() {
            return Err(EngineError::Unreachable(self.status.summary()));
        }
        let pid = self.status.tx.borrow().pid;
        match self.inner.stream(req).await {
            Err(e) if matches!(e, EngineError::Unreachable(_) | EngineError::ConnectionLost(_)) => {
                // The process died under the request (a kill -9), and its
                // supervisor may not have seen the exit yet: wait until it
                // has, so dispatch sees a process that is down (a planned
                // outage: no breaker failure, no retry budget spent) rather
                // than an engine that failed. Only when the process is
                // provably gone or going, so a live engine that refused a
                // connection costs no wait.
                if pid.is_some_and(exited_or_exiting) {
                    let mut rx = self.status.tx.subscribe();
                    let _ =
                        tokio::time::timeout(HEALTH_WAIT_MAX, rx.wait_for(|s| s.state != ProcessState::Ready)).await;
                }
                if self.status.usable() {
                    Err(e)
                } else {
                    Err(EngineError::Unreachable(self.status.summary()))
                }
            }
            r => r,
        }
    }
    async fn health(&self) -> EngineHealth {
        use std::sync::atomic::Ordering;
        if !self.status.usable() && self.told_down.load(Ordering::Relaxed) {
            // Cancel-safe: the probe drops this wait when edgeway stops.
            let mut rx = self.status.tx.subscribe();
            let settled =
                |s: &Snapshot| matches!(s.state, ProcessState::Ready | ProcessState::Failed | ProcessState::External);
            let _ = tokio::time::timeout(HEALTH_WAIT_MAX, rx.wait_for(settled)).await;
        }
        if !self.status.usable() {
            self.told_down.store(true, Ordering::Relaxed);
            return EngineHealth { up: false, detail: self.status.summary(), model_resident: None };
        }
        self.told_down.store(false, Ordering::Relaxed);
        self.inner.health().await
    }
    fn process_down(&self) -> bool {
        !self.status.usable()
    }
    fn process_restarting(&self) -> bool {
        matches!(self.status.state(), ProcessState::Starting | ProcessState::Restarting)
    }
    async fn model_state(&self) -> Option<Result<super::residency::ModelState, EngineError>> {
        if !self.status.usable() {
            return Some(Err(EngineError::Unreachable(self.status.summary())));
        }
        self.inner.model_state().await
    }
    async fn load_model(&self) -> Result<(), EngineError> {
        if !self.status.usable() {
            return Err(EngineError::Unreachable(self.status.summary()));
        }
        self.inner.load_model().await
    }
    async fn unload_model(&self) -> Result<(), EngineError> {
        self.inner.unload_model().await
    }
    async fn load(&self) -> EngineLoad {
        if !self.status.usable() {
            return EngineLoad::default();
        }
        self.inner.load().await
    }
}

/// How one run of the process ended.
enum End {
    /// edgeway is stopping.
    Stop,
    Exited(std::io::Result<ExitStatus>),
    NotReady,
}

struct Supervisor {
    cfg: ProcessConfig,
    ready_url: String,
    pidfile: PathBuf,
    log_file: PathBuf,
    status: Arc<ProcessStatus>,
    client: reqwest::Client,
}

impl Supervisor {
    async fn run(self, stop: CancellationToken) {
        let mut restarts: VecDeque<Instant> = VecDeque::new();
        let mut failed_in_row = 0u32;
        loop {
            if self.answered_before_start().await {
                if !self.while_external(&stop).await {
                    self.status.set(ProcessState::Stopped, None, None);
                    return;
                }
                continue;
            }
            let reason = match self.spawn().await {
                Err(e) => format!("cannot start {:?}: {e}", self.cfg.command),
                Ok((mut child, pid)) => {
                    self.status.set(ProcessState::Starting, None, Some(pid));
                    let first = tokio::select! {
                        _ = stop.cancelled() => Some(End::Stop),
                        st = child.wait() => Some(End::Exited(st)),
                        // `None`: ready.
                        ready = self.wait_ready() => (!ready).then_some(End::NotReady),
                    };
                    let end = match first {
                        None => {
                            self.status.set(ProcessState::Ready, None, Some(pid));
                            failed_in_row = 0;
                            tokio::select! {
                                _ = stop.cancelled() => End::Stop,
                                st = child.wait() => End::Exited(st),
                            }
                        }
                        Some(end) => end,
                    };
                    let reason = match end {
                        End::Stop => {
                            terminate(&mut child, pid, self.cfg.stop_grace).await;
                            let _ = std::fs::remove_file(&self.pidfile);
                            self.status.set(ProcessState::Stopped, None, None);
                            return;
                        }
                        End::NotReady => {
                            terminate(&mut child, pid, self.cfg.stop_grace).await;
                            format!(
                                "not ready within {} s (GET {} never answered 2xx)",
                                self.cfg.ready_timeout.as_secs_f64(),
                                self.ready_url
                            )
                        }
                        End::Exited(st) => {
                            // The leader is gone; what it started may not be.
                            kill_group_leftovers(pid).await;
                            describe(st)
                        }
                    };
                    let _ = std::fs::remove_file(&self.pidfile);
                    reason
                }
            };
            let now = Instant::now();
            while restarts.front().is_some_and(|t| now.duration_since(*t) >= self.cfg.restart_window) {
                restarts.pop_front();
            }
            if restarts.len() >= self.cfg.max_restarts as usize {
                let why = format!(
                    "{reason}; restarted {} time(s) within {} s, not restarted again until edgeway restarts (log: {})",
                    restarts.len(),
                    self.cfg.restart_window.as_secs(),
                    self.log_file.display()
                );
                self.status.set(ProcessState::Failed, Some(why), None);
                stop.cancelled().await;
                return;
            }
            restarts.push_back(now);
            let backoff = self
                .cfg
                .restart_backoff
                .saturating_mul(1u32 << failed_in_row.min(20))
                .min(self.cfg.restart_backoff_max);
            failed_in_row += 1;
            self.status.restarted();
            self.status.set(
                ProcessState::Restarting,
                Some(format!("{reason}; restarting in {} ms", backoff.as_millis())),
                None,
            );
            tokio::select! {
                _ = stop.cancelled() => {
                    self.status.set(ProcessState::Stopped, None, None);
                    return;
                }
                _ = tokio::time::sleep(backoff) => {}
            }
        }
    }

    /// Starts the process in its own group with its log and token, and
    /// writes the pidfile.
    async fn spawn(&self) -> std::io::Result<(tokio::process::Child, u32)> {
        if let Some(dir) = self.log_file.parent() {
            std::fs::create_dir_all(dir)?;
        }
        let log = OpenOptions::new().create(true).append(true).open(&self.log_file)?;
        let token = uuid::Uuid::new_v4().simple().to_string();
        let mut cmd = tokio::process::Command::new(&self.cfg.command);
        cmd.args(&self.cfg.args)
            .envs(self.cfg.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .env(TOKEN_VAR, &token)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            // A supervisor dropped without its stop (a panic) still kills
            // the leader.
            .kill_on_drop(true)
            .process_group(0);
        if let Some(cwd) = &self.cfg.cwd {
            cmd.current_dir(cwd);
        }
        #[cfg(target_os = "linux")]
        {
            let parent = std::process::id();
            // SAFETY: only async-signal-safe calls (prctl, getppid) between
            // fork and exec.
            unsafe {
                cmd.pre_exec(move || {
                    if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    // edgeway died between fork and prctl: do not run.
                    if libc::getppid() as u32 != parent {
                        return Err(std::io::Error::other("edgeway exited while starting the engine"));
                    }
                    Ok(())
                });
            }
        }
        let child = spawn_from_forker(cmd).await?;
        let pid = child.id().ok_or_else(|| std::io::Error::other("engine exited at once"))?;
        let start = proc_stat(pid).map(|s| s.start_time).unwrap_or(0);
        let me = std::process::id();
        let my_start = proc_stat(me).map(|s| s.start_time).unwrap_or(0);
        // Written whole or not at all (temp file + rename): a reader never
        // sees half a pidfile.
        let tmp = self.pidfile.with_extension("pid.tmp");
        std::fs::write(
            &tmp,
            format!("pid={pid}\nstart_time={start}\ntoken={token}\nowner_pid={me}\nowner_start_time={my_start}\n"),
        )?;
        std::fs::rename(&tmp, &self.pidfile)?;
        Ok((child, pid))
    }

    /// Whether something already answers on the engine's address before
    /// edgeway started it (an engine started by hand, another program on
    /// the port): the ready check would take it for ours, and ours could
    /// not bind.
    async fn answered_before_start(&self) -> bool {
        self.client.get(&self.ready_url).timeout(Duration::from_secs(1)).send().await.is_ok()
    }

    /// An engine edgeway did not start answers at the address: it is used
    /// as an external engine (the router's health probes judge it, as for
    /// any engine without a `process` section), nothing is started and no
    /// failed start is counted. Returns `true` once the address no longer
    /// answers (edgeway then starts its own), `false` on stop.
    async fn while_external(&self, stop: &CancellationToken) -> bool {
        tracing::warn!(
            engine = %self.status.name,
            url = %self.ready_url,
            "another process already answers at the engine's address: used as an external engine, not started or supervised by edgeway"
        );
        self.status.set(
            ProcessState::External,
            Some(format!("another process already answers at {}; not started by edgeway", self.ready_url)),
            None,
        );
        loop {
            tokio::select! {
                _ = stop.cancelled() => return false,
                _ = tokio::time::sleep(EXTERNAL_POLL) => {}
            }
            if !self.answered_before_start().await {
                tracing::info!(engine = %self.status.name, "the external engine no longer answers: edgeway starts its own");
                return true;
            }
        }
    }

    /// Polls the ready URL until it answers 2xx (`true`) or the ready
    /// timeout passes (`false`).
    async fn wait_ready(&self) -> bool {
        let deadline = tokio::time::Instant::now() + self.cfg.ready_timeout;
        loop {
            let attempt = self.client.get(&self.ready_url).timeout(Duration::from_secs(2)).send();
            if let Ok(Ok(r)) = tokio::time::timeout_at(deadline, attempt).await {
                if r.status().is_success() {
                    return true;
                }
            }
            if tokio::time::Instant::now() + READY_POLL >= deadline {
                return false;
            }
            tokio::time::sleep(READY_POLL).await;
        }
    }
}

/// A request to the forker thread: the command, the runtime the child is
/// registered with (for `wait`), and where the child goes.
type ForkRequest = (
    tokio::process::Command,
    tokio::runtime::Handle,
    tokio::sync::oneshot::Sender<std::io::Result<tokio::process::Child>>,
);

/// Starts `cmd` from one dedicated thread that lives as long as edgeway.
/// Why: on Linux `PR_SET_PDEATHSIG` fires when the *thread* that forked the
/// child exits, not the process. A tokio worker thread can exit at any
/// time (after `block_in_place` it becomes a blocking-pool thread that
/// exits when idle for 10 s), which would SIGKILL an engine forked from it.
async fn spawn_from_forker(cmd: tokio::process::Command) -> std::io::Result<tokio::process::Child> {
    static FORKER: std::sync::OnceLock<std::sync::mpsc::Sender<ForkRequest>> = std::sync::OnceLock::new();
    let forker = FORKER.get_or_init(|| {
        let (tx, rx) = std::sync::mpsc::channel::<ForkRequest>();
        // The static keeps the sender, so `recv` never fails and the thread
        // never returns: it lives until the process exits.
        std::thread::Builder::new()
            .name("edgeway-engine-forker".into())
            .spawn(move || {
                while let Ok((mut cmd, runtime, reply)) = rx.recv() {
                    let _entered = runtime.enter();
                    let _ = reply.send(cmd.spawn());
                }
            })
            .expect("cannot start the engine forker thread");
        tx
    });
    let (reply, child) = tokio::sync::oneshot::channel();
    let sent = forker.send((cmd, tokio::runtime::Handle::current(), reply));
    sent.map_err(|_| std::io::Error::other("the engine forker thread is gone"))?;
    child.await.map_err(|_| std::io::Error::other("the engine forker thread is gone"))?
}

fn describe(st: std::io::Result<ExitStatus>) -> String {
    use std::os::unix::process::ExitStatusExt;
    match st {
        Err(e) => format!("lost track of the process: {e}"),
        Ok(s) => match (s.code(), s.signal()) {
            (Some(c), _) => format!("exited with status {c}"),
            (None, Some(sig)) => format!("killed by signal {sig}"),
            _ => "exited".to_string(),
        },
    }
}

/// SIGTERM to the group of `pid`, SIGKILL to what is left after `grace`;
/// returns once the leader is reaped and the group is empty (or a short
/// while after the SIGKILL).
async fn terminate(child: &mut tokio::process::Child, pid: u32, grace: Duration) {
    signal_group(pid, libc::SIGTERM);
    let deadline = tokio::time::Instant::now() + grace;
    let _ = tokio::time::timeout_at(deadline, child.wait()).await;
    wait_group_empty(pid, deadline).await;
    if group_live(pid).await || child.try_wait().ok().flatten().is_none() {
        signal_group(pid, libc::SIGKILL);
        let _ = child.wait().await;
        wait_group_empty(pid, tokio::time::Instant::now() + Duration::from_secs(2)).await;
    }
}

/// The leader of group `pid` exited on its own: SIGKILL to anything it
/// left in its group (a shell's children, a server's workers), which would
/// hold its port against the next start.
async fn kill_group_leftovers(pid: u32) {
    if group_live(pid).await {
        signal_group(pid, libc::SIGKILL);
    }
}

fn signal_group(pgid: u32, sig: libc::c_int) {
    let Ok(pgid) = libc::pid_t::try_from(pgid) else { return };
    // SAFETY: plain syscall; a group that no longer exists gives ESRCH.
    unsafe {
        libc::killpg(pgid, sig);
    }
}

async fn wait_group_empty(pgid: u32, deadline: tokio::time::Instant) {
    // No event tells when the last member of a group is gone (they are not
    // our children): poll /proc, briefly.
    while group_live(pgid).await && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// What edgeway reads of `/proc/<pid>/stat`.
struct ProcStat {
    zombie: bool,
    pgrp: u32,
    /// The kernel's `PF_*` flags of the leader thread (field 9).
    flags: u32,
    start_time: u64,
}

/// `PF_EXITING` (include/linux/sched.h): the thread has begun to exit. It
/// is set before the process closes its files, so an engine whose socket
/// refused a connection because it died has it, or is a zombie or gone.
const PF_EXITING: u32 = 0x4;

/// Whether process `pid` has exited or is exiting.
fn exited_or_exiting(pid: u32) -> bool {
    proc_stat(pid).is_none_or(|s| s.zombie || s.flags & PF_EXITING != 0)
}

fn proc_stat(pid: u32) -> Option<ProcStat> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) is in parentheses and may hold spaces or
    // parentheses itself: the fields that follow start after the last ')'.
    let rest = &text[text.rfind(')')? + 1..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    Some(ProcStat {
        zombie: f.first()? == &"Z",
        pgrp: f.get(2)?.parse().ok()?,
        flags: f.get(6)?.parse().ok()?,
        start_time: f.get(19)?.parse().ok()?,
    })
}

/// Whether group `pgid` has a live member. [`group_members`] reads all of
/// `/proc`, which blocks: it runs on the blocking pool, off the workers.
async fn group_live(pgid: u32) -> bool {
    tokio::task::spawn_blocking(move || !group_members(pgid).is_empty()).await.unwrap_or(false)
}

/// Live (not zombie) processes of group `pgid`.
fn group_members(pgid: u32) -> Vec<u32> {
    let Ok(dir) = std::fs::read_dir("/proc") else { return Vec::new() };
    dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|&pid| proc_stat(pid).is_some_and(|s| s.pgrp == pgid && !s.zombie))
        .collect()
}

fn has_token(pid: u32, token: &str) -> bool {
    let Ok(env) = std::fs::read(format!("/proc/{pid}/environ")) else { return false };
    let want = format!("{TOKEN_VAR}={token}");
    env.split(|&b| b == 0).any(|kv| kv == want.as_bytes())
}

/// Takes `<data_dir>/edgeway.lock` (an exclusive `flock`, not waited
/// for), or says another edgeway holds it. The file is opened close-on-exec
/// (std's default), so the engines do not inherit, and hold, the lock.
fn lock_data_dir(data_dir: &Path) -> anyhow::Result<std::fs::File> {
    use std::os::fd::AsRawFd;
    let path = data_dir.join("edgeway.lock");
    std::fs::create_dir_all(data_dir).map_err(|e| anyhow::anyhow!("cannot create {}: {e}", data_dir.display()))?;
    let file = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(|e| anyhow::anyhow!("cannot open {}: {e}", path.display()))?;
    // SAFETY: plain syscall on a descriptor this function owns.
    if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        let err = std::io::Error::last_os_error();
        if err.raw_os_error() == Some(libc::EWOULDBLOCK) {
            anyhow::bail!(
                "another edgeway runs engines with this data directory ({} is locked): stop it first, or give this one its own store.data_dir",
                path.display()
            );
        }
        anyhow::bail!("cannot lock {}: {err}", path.display());
    }
    Ok(file)
}

/// Kills the engine process group recorded in `pidfile` by an earlier
/// edgeway, if it still runs and is provably the one that edgeway
/// started; removes the pidfile. An error when the edgeway that started it
/// still runs (two edgeways on one data directory): that engine is not
/// ours to kill.
async fn reap_stale(name: &str, pidfile: &Path, grace: Duration) -> anyhow::Result<()> {
    let Ok(text) = std::fs::read_to_string(pidfile) else { return Ok(()) };
    let field = |k: &str| text.lines().find_map(|l| l.strip_prefix(k)?.strip_prefix('=')).map(str::to_string);
    let (Some(pid), start, token) =
        (field("pid").and_then(|p| p.parse::<u32>().ok()), field("start_time"), field("token"))
    else {
        let _ = std::fs::remove_file(pidfile);
        return Ok(());
    };
    let owner = field("owner_pid").and_then(|p| p.parse::<u32>().ok()).filter(|&o| o != std::process::id());
    if let Some(owner) = owner {
        if proc_stat(owner).is_some_and(|s| Some(s.start_time.to_string()) == field("owner_start_time")) {
            anyhow::bail!(
                "engine {name} is run by another edgeway (pid {owner}) with this data directory ({})",
                pidfile.display()
            );
        }
    }
    let members = tokio::task::spawn_blocking(move || group_members(pid)).await.unwrap_or_default();
    let ours = members.iter().any(|&m| {
        (m == pid && proc_stat(m).map(|s| s.start_time.to_string()) == start)
            || token.as_deref().is_some_and(|t| has_token(m, t))
    });
    if ours {
        tracing::warn!(
            engine = name,
            pid,
            processes = members.len(),
            "killing the engine process group an earlier edgeway left running"
        );
        signal_group(pid, libc::SIGTERM);
        wait_group_empty(pid, tokio::time::Instant::now() + grace).await;
        if group_live(pid).await {
            signal_group(pid, libc::SIGKILL);
            wait_group_empty(pid, tokio::time::Instant::now() + Duration::from_secs(2)).await;
        }
    } else if !members.is_empty() {
        tracing::info!(engine = name, pid, "pidfile names a process group that is not ours (pid reused); left alone");
    }
    let _ = std::fs::remove_file(pidfile);
    Ok(())
}

/// `edgeway_engine_process_{up,restarts_total,uptime_seconds}{engine}`,
/// read from the statuses whenever the registry is gathered. The label is
/// `engine`, as on `edgeway_engine_up`: Prometheus itself sets `instance`
/// on every scraped series.
struct ProcessMetrics {
    statuses: Arc<Mutex<Vec<Arc<ProcessStatus>>>>,
    up: IntGaugeVec,
    restarts: IntCounterVec,
    uptime: GaugeVec,
}

impl ProcessMetrics {
    fn new(statuses: Arc<Mutex<Vec<Arc<ProcessStatus>>>>) -> ProcessMetrics {
        let o = |n: &str, h: &str| Opts::new(n, h).namespace("edgeway");
        ProcessMetrics {
            statuses,
            up: IntGaugeVec::new(o("engine_process_up", "1 while the supervised engine process is ready"), &["engine"])
                .expect("valid metric"),
            restarts: IntCounterVec::new(
                o("engine_process_restarts_total", "Restarts of the supervised engine process"),
                &["engine"],
            )
            .expect("valid metric"),
            uptime: GaugeVec::new(
                o(
                    "engine_process_uptime_seconds",
                    "Seconds since the supervised engine process became ready (0 while not)",
                ),
                &["engine"],
            )
            .expect("valid metric"),
        }
    }
}

impl Collector for ProcessMetrics {
    fn desc(&self) -> Vec<&Desc> {
        self.up.desc().into_iter().chain(self.restarts.desc()).chain(self.uptime.desc()).collect()
    }

    fn collect(&self) -> Vec<MetricFamily> {
        let statuses = locked(&self.statuses).clone();
        for s in &statuses {
            let r = s.report();
            self.up.with_label_values(&[&r.instance]).set(i64::from(r.state == ProcessState::Ready));
            let c = self.restarts.with_label_values(&[&r.instance]);
            c.inc_by(r.restarts.saturating_sub(c.get()));
            self.uptime.with_label_values(&[&r.instance]).set(r.uptime_s.unwrap_or(0.0));
        }
        self.up.collect().into_iter().chain(self.restarts.collect()).chain(self.uptime.collect()).collect()
    }
}
