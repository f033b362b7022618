//! The shape of `src/`: imports follow the data, one way.
//!
//! ```text
//! server (wiring, listeners) ─▶ ingress ─▶ gateway (facade) ─▶ admission ─▶ context
//!   ─▶ scheduler ─▶ router ─▶ engine ─▶ telemetry ─▶ store ─▶ config ─▶ task ─▶ error, tls
//! ```
//!
//! Reads every `crate::` path of `src/` (outside `#[cfg(test)]` modules and
//! the `tests.rs` files they load) and fails, naming the file, the line and
//! the rule, on any import against that direction. The Rust compiler does
//! not check this between modules of one crate; this test is how the shape
//! stays. A new top-level module must be given its place in [`LAYERS`].

use std::path::{Path, PathBuf};

/// Top-level modules of `src/`, lowest first. A module may use modules of a
/// lower layer only; modules of one layer do not use each other.
const LAYERS: &[&[&str]] = &[
    &["error", "tls"],
    &["task"],
    &["config"],
    &["store"],
    &["telemetry"],
    &["engine"],
    &["router"],
    &["scheduler"],
    &["context"],
    &["admission"],
    &["gateway"],
    &["ingress"],
    &["server"],
];

/// Test support, compiled only for tests (`testing` feature): may use
/// anything, and nothing may use it.
const EXEMPT: &[&str] = &["testing"];

/// What an ingress may use: the facade, and the plain data and telemetry
/// below everything. Never the scheduler, router, engines or store
/// directly.
const INGRESS_MAY_USE: &[&str] = &["gateway", "telemetry", "config", "task", "error", "tls"];

/// Crates that speak a wire protocol to clients: only the ingresses and the
/// server that starts their listeners may use them (the facade and
/// everything below it know no protocol). Config may use their parsers to
/// validate an address (a NATS URL), as it uses `SocketAddr`.
const PROTOCOL_CRATES: &[&str] = &["axum", "rumqttd", "async_nats"];
const MAY_SPEAK_PROTOCOLS: &[&str] = &["ingress", "server", "testing", "config"];

fn layer_of(module: &str) -> Option<usize> {
    LAYERS.iter().position(|l| l.contains(&module))
}

/// One violation, as the test prints it.
#[derive(Debug, PartialEq)]
struct Violation {
    file: String,
    line: usize,
    message: String,
}

/// The top-level module a file of `src/` belongs to (`src/router/pick.rs`
/// → `router`, `src/gateway.rs` → `gateway`); `None` for the crate roots.
fn module_of(rel: &Path) -> Option<String> {
    let first = rel.components().next()?.as_os_str().to_str()?;
    let name = first.strip_suffix(".rs").unwrap_or(first);
    match name {
        "lib" | "main" => None,
        n => Some(n.to_string()),
    }
}

/// The top-level modules named by every `crate::` path on a line, with
/// grouped imports expanded (`use crate::{a, b::c}` names `a` and `b`).
fn crate_paths(line: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = line;
    while let Some(i) = rest.find("crate::") {
        // `edgeway_crate::` or `$crate::` are not this crate's paths.
        let before = rest[..i].chars().next_back();
        rest = &rest[i + "crate::".len()..];
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == '$') {
            continue;
        }
        if let Some(group) = rest.strip_prefix('{') {
            let end = matching_brace(group).unwrap_or(group.len());
            let mut depth = 0;
            let mut start = 0;
            for (j, c) in group[..end].char_indices() {
                match c {
                    '{' => depth += 1,
                    '}' => depth -= 1,
                    ',' if depth == 0 => {
                        out.extend(first_segment(&group[start..j]));
                        start = j + 1;
                    }
                    _ => {}
                }
            }
            out.extend(first_segment(&group[start..end]));
            rest = &group[end..];
        } else {
            out.extend(first_segment(rest));
        }
    }
    out
}

fn matching_brace(s: &str) -> Option<usize> {
    let mut depth = 0;
    for (i, c) in s.char_indices() {
        match c {
            '{' => depth += 1,
            '}' if depth == 0 => return Some(i),
            '}' => depth -= 1,
            _ => {}
        }
    }
    None
}

fn first_segment(s: &str) -> Option<String> {
    let seg: String = s.trim_start().chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
    (!seg.is_empty() && seg != "self").then_some(seg)
}

/// The external crates a line uses (`use axum::…`, `axum::Router`), among
/// `names`.
fn external_uses<'a>(line: &str, names: &[&'a str]) -> Vec<&'a str> {
    names
        .iter()
        .copied()
        .filter(|n| {
            let pat = format!("{n}::");
            line.match_indices(&pat).any(|(i, _)| {
                let before = line[..i].chars().next_back();
                !before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == ':')
            })
        })
        .collect()
}

/// Lines of `source` that are not comments and not inside a `#[cfg(test)]`
/// item, with their 1-based numbers.
fn code_lines(source: &str) -> Vec<(usize, &str)> {
    let mut out = Vec::new();
    let mut skip_depth: Option<i64> = None;
    let mut depth: i64 = 0;
    let mut cfg_test_pending = false;
    for (n, raw) in source.lines().enumerate() {
        let line = raw.trim();
        let code = line.split("//").next().unwrap_or("");
        let opens = code.matches('{').count() as i64;
        let closes = code.matches('}').count() as i64;
        if skip_depth.is_none() && cfg_test_pending && !line.starts_with("#[") && !line.is_empty() {
            cfg_test_pending = false;
            if opens > closes {
                skip_depth = Some(depth);
            } else {
                // A single-line item (`mod tests;`, `use …;`) under the cfg.
                depth += opens - closes;
                continue;
            }
        }
        if line.starts_with("#[cfg(test)]") {
            cfg_test_pending = true;
        }
        let was_skipping = skip_depth.is_some();
        depth += opens - closes;
        if let Some(d) = skip_depth {
            if depth <= d {
                skip_depth = None;
            }
        }
        if was_skipping || line.starts_with("//") || line.is_empty() {
            continue;
        }
        out.push((n + 1, code));
    }
    out
}

/// Checks one file of `src/` (`rel` is its path below `src/`).
fn check_file(rel: &Path, source: &str) -> Vec<Violation> {
    let file = format!("src/{}", rel.display());
    let Some(module) = module_of(rel) else { return Vec::new() };
    // `tests.rs` files are the bodies of `#[cfg(test)] mod tests;`.
    if EXEMPT.contains(&module.as_str()) || rel.file_name().is_some_and(|f| f == "tests.rs") {
        return Vec::new();
    }
    let mut out = Vec::new();
    let Some(own) = layer_of(&module) else {
        out.push(Violation {
            file,
            line: 1,
            message: format!(
                "top-level module `{module}` has no place in the layers: add it to LAYERS in tests/architecture.rs"
            ),
        });
        return out;
    };
    for (line, code) in code_lines(source) {
        for used in crate_paths(code) {
            if used == module || used == "self" || used == "super" {
                continue;
            }
            let message = if EXEMPT.contains(&used.as_str()) {
                format!("`{module}` uses `{used}`: test support is for tests only")
            } else if module == "ingress" && !INGRESS_MAY_USE.contains(&used.as_str()) {
                format!(
                    "`ingress` uses `{used}`: an ingress goes through the gateway facade and may use only {}",
                    INGRESS_MAY_USE.join(", ")
                )
            } else {
                match layer_of(&used) {
                    None => continue, // a macro or an item of the crate root
                    Some(l) if l < own => continue,
                    Some(_) => format!(
                        "`{module}` uses `{used}`, which is not below it: imports run ingress → gateway → admission → context → scheduler → router → engine → telemetry → store → config → task → error"
                    ),
                }
            };
            out.push(Violation { file: file.clone(), line, message });
        }
        if !MAY_SPEAK_PROTOCOLS.contains(&module.as_str()) {
            for c in external_uses(code, PROTOCOL_CRATES) {
                out.push(Violation {
                    file: file.clone(),
                    line,
                    message: format!(
                        "`{module}` uses the protocol crate `{c}`: only {} may",
                        MAY_SPEAK_PROTOCOLS.join(", ")
                    ),
                });
            }
        }
    }
    out
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("read src/") {
        let path = entry.expect("dir entry").path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

#[test]
fn imports_follow_the_pipeline() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    files.sort();
    assert!(files.len() > 20, "found the sources: {files:?}");
    let mut violations = Vec::new();
    for path in &files {
        let source = std::fs::read_to_string(path).expect("read source");
        violations.extend(check_file(path.strip_prefix(&src).expect("below src/"), &source));
    }
    let report: Vec<String> = violations.iter().map(|v| format!("{}:{}: {}", v.file, v.line, v.message)).collect();
    assert!(report.is_empty(), "imports against the direction of the pipeline:\n{}", report.join("\n"));
}

// The checker itself: each rule catches what it is for, and lets the rest pass.

#[test]
fn an_upward_import_is_named_with_its_file_line_and_rule() {
    let v = check_file(Path::new("engine/openai.rs"), "//! doc\n\nuse crate::scheduler::SchedulerHandle;\n");
    assert_eq!(v.len(), 1, "{v:?}");
    assert_eq!(v[0].file, "src/engine/openai.rs");
    assert_eq!(v[0].line, 3);
    assert!(v[0].message.contains("`engine` uses `scheduler`"), "{}", v[0].message);
}

#[test]
fn grouped_and_inline_paths_are_read() {
    let src = "use crate::{error::GatewayError, task::{Priority, TaskState}};\nfn f() { crate::router::pick(); }\n";
    let v = check_file(Path::new("store/mod.rs"), src);
    assert_eq!(v.len(), 1, "{v:?}");
    assert!(v[0].message.contains("`store` uses `router`"));
    assert_eq!(v[0].line, 2);
}

#[test]
fn a_cycle_between_two_modules_fails_on_one_side() {
    let down = check_file(Path::new("telemetry/mod.rs"), "use crate::store::Store;\n");
    let up = check_file(Path::new("store/mod.rs"), "use crate::telemetry::Metrics;\n");
    assert!(down.is_empty(), "{down:?}");
    assert_eq!(up.len(), 1, "{up:?}");
}

#[test]
fn ingress_goes_through_the_facade() {
    assert!(check_file(Path::new("ingress/http/mod.rs"), "use crate::gateway::Gateway;\nuse crate::task::Priority;\n")
        .is_empty());
    let v = check_file(Path::new("ingress/mqtt/streams.rs"), "use crate::scheduler::TaskStream;\n");
    assert_eq!(v.len(), 1, "{v:?}");
    assert!(v[0].message.contains("gateway facade"));
}

#[test]
fn only_ingress_and_server_speak_protocols() {
    let v = check_file(Path::new("gateway/mod.rs"), "use axum::Router;\n");
    assert_eq!(v.len(), 1, "{v:?}");
    assert!(v[0].message.contains("protocol crate `axum`"));
    assert!(check_file(Path::new("ingress/http/mod.rs"), "use axum::Router;\n").is_empty());
    // A path that merely ends in a protocol crate's name is not a use of it.
    assert!(check_file(Path::new("gateway/mod.rs"), "let x = my_axum::y;\n").is_empty());
}

#[test]
fn test_modules_comments_and_test_support_are_exempt() {
    let src = "//! uses crate::ingress in a comment\nfn f() {}\n\n#[cfg(test)]\nmod tests {\n    use crate::ingress::x;\n    fn g() { if true { } }\n}\n";
    assert!(check_file(Path::new("engine/mod.rs"), src).is_empty());
    assert!(check_file(Path::new("testing/mod.rs"), "use crate::ingress::x;\n").is_empty());
    assert!(check_file(Path::new("config/tests.rs"), "use crate::testing::x;\n").is_empty());
    // Code after a test module is read again.
    let after = format!("{src}fn h() {{ crate::ingress::y(); }}\n");
    assert_eq!(check_file(Path::new("engine/mod.rs"), &after).len(), 1);
    // Nothing outside tests may use test support.
    assert_eq!(check_file(Path::new("gateway/mod.rs"), "use crate::testing::FakeEngine;\n").len(), 1);
}

#[test]
fn a_new_top_level_module_must_be_placed() {
    let v = check_file(Path::new("cache/mod.rs"), "use crate::task::Priority;\n");
    assert_eq!(v.len(), 1);
    assert!(v[0].message.contains("no place in the layers"));
}
