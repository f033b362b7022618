//! The `[engines.NAME.process]` section: how edgeway runs an engine itself
//! (command, arguments, environment, working directory, log file, ready
//! check, restart policy, stop grace), and the `${VAR}` expansion of its
//! strings.
//!
//! Owns: the keys of that section, their defaults and rules, and variable
//! expansion. Does not own: starting, watching or stopping the process
//! (`engine::supervisor`).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

use super::validate::{env_var, resolve};
use super::Problems;

/// How to run one engine instance as a child process of edgeway.
#[derive(Debug, Clone, PartialEq)]
pub struct ProcessConfig {
    /// The program: a path (relative ones against the config file's
    /// folder) or a name looked up in `PATH`.
    pub command: String,
    pub args: Vec<String>,
    /// Set on top of edgeway's own environment.
    pub env: Vec<(String, String)>,
    /// Working directory (default: edgeway's).
    pub cwd: Option<PathBuf>,
    /// stdout and stderr of the process, appended (default:
    /// `<data_dir>/engines/<name>.log`, decided by the supervisor).
    pub log_file: Option<PathBuf>,
    /// Path polled on the engine's `base_url` until it answers 2xx (default:
    /// the engine's `health_path`).
    pub ready_path: Option<String>,
    /// A start that is not ready in this time is killed and counts as a
    /// failed start.
    pub ready_timeout: Duration,
    /// Wait before the first restart; doubled for each further failed start
    /// in a row, up to `restart_backoff_max`.
    pub restart_backoff: Duration,
    pub restart_backoff_max: Duration,
    /// Restarts allowed within `restart_window`; one more and the instance
    /// stays down (`failed`, with the reason) until edgeway restarts.
    pub max_restarts: u32,
    pub restart_window: Duration,
    /// On stop: SIGTERM to the process group, SIGKILL after this long.
    pub stop_grace: Duration,
}

#[derive(Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RawProcess {
    /// `false`: the section is validated but edgeway does not run the
    /// engine (something else does: a test harness, a service manager).
    pub enabled: bool,
    pub command: Option<String>,
    pub args: Vec<String>,
    pub env: BTreeMap<String, String>,
    pub cwd: Option<String>,
    pub log_file: Option<String>,
    pub ready_path: Option<String>,
    pub ready_timeout_ms: u64,
    pub restart_backoff_ms: u64,
    pub restart_backoff_max_ms: u64,
    pub max_restarts: u32,
    pub restart_window_s: u64,
    pub stop_grace_ms: u64,
}

impl Default for RawProcess {
    fn default() -> Self {
        RawProcess {
            enabled: true,
            command: None,
            args: Vec::new(),
            env: BTreeMap::new(),
            cwd: None,
            log_file: None,
            ready_path: None,
            ready_timeout_ms: 120_000,
            restart_backoff_ms: 500,
            restart_backoff_max_ms: 30_000,
            max_restarts: 5,
            restart_window_s: 300,
            stop_grace_ms: 5_000,
        }
    }
}

/// Validates `[engines.NAME.process]` (`path` is its key path).
pub(super) fn validate(
    path: &str,
    raw: RawProcess,
    env: &[(String, String)],
    base_dir: &Path,
    p: &mut Problems,
) -> Option<ProcessConfig> {
    let mut ok = true;
    // A disabled section is checked but not expanded: edgeway does not run
    // it, so the variables its command needs need not be set.
    let enabled = raw.enabled;
    let mut expand_at =
        |key: String, s: &str, p: &mut Problems| match if enabled { expand(s, env) } else { Ok(s.to_string()) } {
            Ok(v) => v,
            Err(e) => {
                p.add(key, e);
                ok = false;
                String::new()
            }
        };
    let command = match raw.command.as_deref() {
        None => {
            p.add(format!("{path}.command"), "is required");
            None
        }
        Some(c) => Some(expand_at(format!("{path}.command"), c, p)),
    };
    if command.as_deref().is_some_and(|c| c.trim().is_empty()) {
        p.add(format!("{path}.command"), "must not be empty");
    }
    // A relative path with a folder in it is the config's, like every other
    // file the config names; a bare name is looked up in PATH.
    let command =
        command.map(|c| if c.contains('/') { resolve(base_dir, Path::new(&c)).display().to_string() } else { c });
    let args: Vec<String> =
        raw.args.iter().enumerate().map(|(i, a)| expand_at(format!("{path}.args[{i}]"), a, p)).collect();
    let proc_env: Vec<(String, String)> =
        raw.env.iter().map(|(k, v)| (k.clone(), expand_at(format!("{path}.env.{k}"), v, p))).collect();
    let cwd = raw.cwd.as_deref().map(|c| resolve(base_dir, Path::new(&expand_at(format!("{path}.cwd"), c, p))));
    let log_file =
        raw.log_file.as_deref().map(|l| resolve(base_dir, Path::new(&expand_at(format!("{path}.log_file"), l, p))));
    if raw.ready_path.as_ref().is_some_and(|r| !r.starts_with('/')) {
        p.add(format!("{path}.ready_path"), "must start with '/'");
    }
    if !(100..=3_600_000).contains(&raw.ready_timeout_ms) {
        p.add(format!("{path}.ready_timeout_ms"), "must be 100 to 3600000");
    }
    if !(10..=600_000).contains(&raw.restart_backoff_ms) {
        p.add(format!("{path}.restart_backoff_ms"), "must be 10 to 600000");
    }
    if raw.restart_backoff_max_ms < raw.restart_backoff_ms || raw.restart_backoff_max_ms > 3_600_000 {
        p.add(format!("{path}.restart_backoff_max_ms"), "must be at least restart_backoff_ms and at most 3600000");
    }
    if raw.restart_window_s == 0 || raw.restart_window_s > 86_400 {
        p.add(format!("{path}.restart_window_s"), "must be 1 to 86400");
    }
    if raw.stop_grace_ms > 600_000 {
        p.add(format!("{path}.stop_grace_ms"), "must be at most 600000");
    }
    if !ok {
        return None;
    }
    Some(ProcessConfig {
        command: command?,
        args,
        env: proc_env,
        cwd,
        log_file,
        ready_path: raw.ready_path,
        ready_timeout: Duration::from_millis(raw.ready_timeout_ms),
        restart_backoff: Duration::from_millis(raw.restart_backoff_ms),
        restart_backoff_max: Duration::from_millis(raw.restart_backoff_max_ms),
        max_restarts: raw.max_restarts,
        restart_window: Duration::from_secs(raw.restart_window_s),
        stop_grace: Duration::from_millis(raw.stop_grace_ms),
    })
}

/// Expands `${VAR}` and `${VAR:-default}` (the default expanded in turn)
/// from `env`; `$$` is a literal `$`, and a `$` before anything else stays
/// as written. As in the shell, `${VAR:-default}` takes the default when
/// the variable is not set or empty. A plain `${VAR}` that is not set or
/// empty is an error (each with its own message): a command line with a
/// silently empty path in it would fail far from its cause.
pub fn expand(s: &str, env: &[(String, String)]) -> Result<String, String> {
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while let Some(i) = rest.find('$') {
        out.push_str(&rest[..i]);
        rest = &rest[i..];
        if let Some(r) = rest.strip_prefix("$$") {
            out.push('$');
            rest = r;
            continue;
        }
        let Some(body) = rest.strip_prefix("${") else {
            out.push('$');
            rest = &rest[1..];
            continue;
        };
        let end = closing_brace(body).ok_or_else(|| format!("unclosed ${{ in {s:?}"))?;
        let inner = &body[..end];
        let (name, default) = match inner.split_once(":-") {
            Some((n, d)) => (n, Some(d)),
            None => (inner, None),
        };
        if name.is_empty() || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
            return Err(format!("${{{inner}}}: {name:?} is not a variable name"));
        }
        match (env_var(env, name), default) {
            (Some(v), _) if !v.is_empty() => out.push_str(v),
            (_, Some(d)) => out.push_str(&expand(d, env)?),
            (Some(_), None) => {
                return Err(format!("environment variable {name} is empty (set it, or write ${{{name}:-default}})"))
            }
            (None, None) => return Err(format!("environment variable {name} is not set (write ${{{name}:-default}})")),
        }
        rest = &body[end + 1..];
    }
    out.push_str(rest);
    Ok(out)
}

/// The index of the `}` that closes a `${` whose body starts `s`, counting
/// nested `${…}`.
fn closing_brace(s: &str) -> Option<usize> {
    let mut depth = 0usize;
    let b = s.as_bytes();
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'$' if b.get(i + 1) == Some(&b'{') => {
                depth += 1;
                i += 1;
            }
            b'}' if depth == 0 => return Some(i),
            b'}' => depth -= 1,
            _ => {}
        }
        i += 1;
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    #[test]
    fn expands_variables_with_nested_defaults() {
        let e = env(&[("HOME", "/home/u"), ("EMPTY", "")]);
        assert_eq!(expand("${EDGEWAY_CACHE:-${HOME}/.cache/edgeway}/bin", &e).unwrap(), "/home/u/.cache/edgeway/bin");
        let e2 = env(&[("HOME", "/home/u"), ("EDGEWAY_CACHE", "/c")]);
        assert_eq!(expand("${EDGEWAY_CACHE:-${HOME}/.cache/edgeway}/bin", &e2).unwrap(), "/c/bin");
        assert_eq!(expand("${EMPTY:-x}", &e).unwrap(), "x");
        assert_eq!(expand("a$$b $c", &e).unwrap(), "a$b $c");
        assert!(expand("${NOPE}", &e).unwrap_err().contains("NOPE is not set"));
        // Review L3: an empty variable was reported as "not set".
        assert!(expand("${EMPTY}", &e).unwrap_err().contains("EMPTY is empty"));
        assert!(expand("${HOME", &e).unwrap_err().contains("unclosed"));
        assert!(expand("${A B}", &e).unwrap_err().contains("not a variable name"));
    }
}
