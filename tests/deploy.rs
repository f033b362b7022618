//! deploy/ checked as far as this machine can without Docker (issue 13):
//! the alert rules pass `promtool check rules` and their unit tests
//! (`promtool test rules`), the scrape example passes `promtool check
//! config`, every metric a rule or dashboard panel uses is one edgeway
//! exports (the README table, which tests/metrics_readme.rs holds to the
//! live `/metrics`), the compose file starts the services it should with
//! files that exist and an edgeway configuration that validates, the
//! systemd unit verifies and is sandboxed, and the Dockerfile builds with
//! the quick start's steps.
//!
//! promtool comes from scripts/setup-deps.sh (Debian's prometheus package,
//! the binary alone, in the cache). The promtool tests skip only where it
//! is missing and setup-deps.sh has not run here (no cache); after
//! setup-deps.sh a missing promtool fails them.

#[path = "common/readme_metrics.rs"]
mod readme_metrics;

use std::path::{Path, PathBuf};
use std::process::Command;

use yaml_rust2::{Yaml, YamlLoader};

fn repo(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(rel)
}

fn read(rel: &str) -> String {
    std::fs::read_to_string(repo(rel)).unwrap_or_else(|e| panic!("{rel}: {e}"))
}

/// setup-deps.sh's cache, as scripts/test.sh and the e2e tests find it.
fn cache() -> PathBuf {
    std::env::var_os("EDGEWAY_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(std::env::var_os("HOME").expect("HOME")).join(".cache/edgeway"))
}

/// promtool from the cache or the PATH; `None` (skip) only where
/// setup-deps.sh never ran.
fn promtool() -> Option<PathBuf> {
    let cached = cache().join("bin/promtool");
    if cached.is_file() {
        return Some(cached);
    }
    if Command::new("promtool").arg("--version").output().is_ok_and(|o| o.status.success()) {
        return Some("promtool".into());
    }
    assert!(
        !cache().join("venv").exists(),
        "setup-deps.sh ran ({}) but left no promtool: run it again (it fetches Debian's prometheus package)",
        cache().display()
    );
    eprintln!("SKIPPED: promtool missing and scripts/setup-deps.sh not run");
    None
}

fn run(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{cmd:?} failed:\n{text}");
    text
}

#[test]
fn the_alert_rules_pass_promtool_and_their_unit_tests() {
    let Some(promtool) = promtool() else { return };
    let dir = repo("deploy/prometheus");
    let checked = run(Command::new(&promtool).current_dir(&dir).args(["check", "rules", "rules.yml"]));
    assert!(checked.contains("SUCCESS: 10 rules found"), "{checked}");
    let tested = run(Command::new(&promtool).current_dir(&dir).args(["test", "rules", "rules_test.yml"]));
    assert!(tested.contains("SUCCESS"), "{tested}");
    // The scrape example, with the rule file it names.
    run(Command::new(&promtool).current_dir(&dir).args(["check", "config", "prometheus.yml"]));
}

#[test]
fn every_alert_has_a_unit_test() {
    let rules = YamlLoader::load_from_str(&read("deploy/prometheus/rules.yml")).unwrap();
    let tests = read("deploy/prometheus/rules_test.yml");
    let alerts: Vec<String> = rules[0]["groups"][0]["rules"]
        .as_vec()
        .unwrap()
        .iter()
        .map(|r| r["alert"].as_str().unwrap().to_string())
        .collect();
    // The eight of FR-10.3, breaker-open and degradation.
    assert_eq!(alerts.len(), 10, "{alerts:?}");
    for a in &alerts {
        assert!(tests.contains(&format!("alertname: {a}\n")), "{a} has no test in rules_test.yml");
    }
}

/// The `edgeway_…` names in `text`.
fn metric_names(text: &str) -> Vec<String> {
    let re = regex::Regex::new(r"edgeway_[a-z0-9_]+").unwrap();
    re.find_iter(text).map(|m| m.as_str().to_string()).collect()
}

#[test]
fn every_metric_a_rule_or_a_dashboard_panel_uses_is_one_edgeway_exports() {
    let exported = readme_metrics::series_names();
    let rules = read("deploy/prometheus/rules.yml");
    let dashboard = read("deploy/grafana/dashboards/edgeway.json");
    let panels: serde_json::Value = serde_json::from_str(&dashboard).unwrap();
    let mut exprs = String::new();
    for p in panels["panels"].as_array().unwrap() {
        for t in p["targets"].as_array().into_iter().flatten() {
            exprs.push_str(t["expr"].as_str().unwrap());
            exprs.push('\n');
        }
    }
    let used_by_rules = metric_names(&rules);
    let used_by_panels = metric_names(&exprs);
    assert!(used_by_rules.len() > 10 && used_by_panels.len() > 40, "the expressions were read");
    for (what, names) in [("rules.yml", &used_by_rules), ("the dashboard", &used_by_panels)] {
        let unknown: Vec<_> = names.iter().filter(|n| !exported.contains(*n)).collect();
        assert!(unknown.is_empty(), "{what} uses metrics edgeway does not export: {unknown:?}");
    }
    // The dashboard's sections (issue 13).
    let rows: Vec<&str> = panels["panels"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|p| p["type"] == "row")
        .filter_map(|p| p["title"].as_str())
        .collect();
    for section in
        ["Traffic and errors", "Latency and TTFT", "Queues by priority", "Engines and residency", "GPU", "Devices"]
    {
        assert!(rows.contains(&section), "no {section} row: {rows:?}");
    }
    // Each panel asks the provisioned datasource.
    let ds = read("deploy/grafana/provisioning/datasources/edgeway.yml");
    assert!(ds.contains("uid: edgeway-prometheus"));
    assert!(dashboard.matches("\"uid\": \"edgeway-prometheus\"").count() > 40);
}

#[test]
fn the_compose_file_runs_edgeway_its_engines_nats_prometheus_and_grafana() {
    let compose = &YamlLoader::load_from_str(&read("deploy/compose/docker-compose.yml")).unwrap()[0];
    let services = compose["services"].as_hash().expect("services");
    let names: Vec<&str> = services.keys().filter_map(Yaml::as_str).collect();
    for s in ["edgeway", "llama-server", "nats", "prometheus", "grafana"] {
        assert!(names.contains(&s), "no {s} service: {names:?}");
    }
    // Every file it mounts from the repository exists.
    let base = repo("deploy/compose");
    for (name, svc) in services {
        for v in svc["volumes"].as_vec().into_iter().flatten() {
            let v = v.as_str().unwrap();
            let src = v.split(':').next().unwrap();
            if src.starts_with('.') {
                assert!(base.join(src).exists(), "{}: {v} mounts a file that is not there", name.as_str().unwrap());
            }
        }
        if let Some(df) = svc["build"]["dockerfile"].as_str() {
            let ctx = base.join(svc["build"]["context"].as_str().unwrap());
            assert!(ctx.join(df).is_file(), "{df}");
            let target = svc["build"]["target"].as_str().unwrap();
            assert!(read(df).contains(&format!(" AS {target}\n")), "the Dockerfile has no stage {target}");
        }
    }
    // Prometheus gets the rules, Grafana the dashboard.
    let mounts = |s: &str| format!("{:?}", compose["services"][s]["volumes"]);
    assert!(mounts("prometheus").contains("rules.yml") && mounts("grafana").contains("dashboards"));
    // The edgeway configuration it mounts validates (edgeway check-config).
    let cfg = read("deploy/compose/edgeway.toml");
    let config = edgeway::config::Config::from_toml_str(&cfg, std::iter::empty(), &base)
        .unwrap_or_else(|e| panic!("deploy/compose/edgeway.toml: {e}"));
    assert!(config.nats.is_some(), "NATS on");
    for e in config.engines.values() {
        assert!(e.base_url.contains("llama-"), "engines are compose services: {}", e.base_url);
    }
}

#[test]
fn the_systemd_unit_is_sandboxed_and_verifies() {
    let unit = read("deploy/systemd/edgeway.service");
    for key in [
        "NoNewPrivileges=yes",
        "ProtectSystem=strict",
        "ProtectHome=yes",
        "PrivateTmp=yes",
        "DynamicUser=yes",
        "StateDirectory=edgeway",
        "CapabilityBoundingSet=\n",
        "RestrictAddressFamilies=",
        "SystemCallFilter=@system-service",
        "ExecReload=/bin/kill -HUP $MAINPID",
    ] {
        assert!(unit.contains(key), "{key} missing");
    }
    // systemd-analyze checks the unit against this systemd; ExecStart must
    // name a binary that exists: this build's.
    if Command::new("systemd-analyze").arg("--version").output().is_err() {
        eprintln!("SKIPPED: systemd-analyze verify (no systemd-analyze here)");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("edgeway.service");
    std::fs::write(
        &path,
        unit.replace("/usr/local/bin/edgeway serve", &format!("{} serve", env!("CARGO_BIN_EXE_edgeway"))),
    )
    .unwrap();
    // It exits 0 on keys it does not know or values it cannot parse (it
    // ignores them, as systemd would): any word from it is a finding.
    let said = run(Command::new("systemd-analyze").arg("verify").arg(&path));
    assert!(said.trim().is_empty(), "systemd-analyze verify:\n{said}");
}

#[test]
fn the_dockerfile_builds_with_the_quick_starts_steps() {
    let dockerfile = read("deploy/Dockerfile");
    let quickstart = read("scripts/quickstart.sh");
    // The quick start's two steps, as it writes them.
    for step in ["bash scripts/setup-deps.sh", "cargo build --release --bin edgeway"] {
        assert!(quickstart.contains(step), "scripts/quickstart.sh no longer runs `{step}`: update deploy/Dockerfile");
        assert!(
            dockerfile.lines().any(|l| l.starts_with("RUN ") && l.contains(step)),
            "deploy/Dockerfile does not RUN `{step}`"
        );
    }
    // What the runtime images take from the build is where setup-deps.sh
    // puts it.
    let setup = read("scripts/setup-deps.sh");
    assert!(setup.contains(r#"LLAMA_BIN="$CACHE/bin/llama-server""#));
    assert!(setup.contains(r#"MODEL="$CACHE/models/gemma-3-270m-q4_k_m.gguf""#));
    assert!(dockerfile.contains("COPY --from=build /opt/edgeway-cache/bin/llama-server "));
    assert!(dockerfile.contains("COPY --from=build /opt/edgeway-cache/models/gemma-3-270m-q4_k_m.gguf "));
    assert!(dockerfile.contains("ENV EDGEWAY_CACHE=/opt/edgeway-cache"));
    // Two small runtime stages on a slim base.
    for stage in ["edgeway", "llama-server"] {
        assert!(dockerfile.contains(&format!("FROM debian:bookworm-slim AS {stage}\n")), "{stage}");
    }
}
