//! The metrics table of README.md ("## Metrics"), read for the tests that
//! compare it with a live `/metrics` (tests/metrics_readme.rs) and with
//! what the alert rules and the dashboard use (tests/deploy.rs). Included
//! with `#[path = "common/readme_metrics.rs"] mod readme_metrics;`.
#![allow(dead_code)]

/// One row: its metric names, type (`counter`, `gauge`, `histogram`) and
/// when it shows (`always`, `event`, `gpu`, `supervised`, `model_api`,
/// `nats`, `expiring_key`).
#[derive(Debug)]
pub struct Row {
    pub names: Vec<String>,
    pub kind: String,
    /// The label names of the `labels` cell (what is in parentheses is
    /// their values or a note, not a label).
    pub labels: Vec<String>,
    pub shown: String,
}

/// The backticked names of a `labels` cell outside parentheses.
fn label_names(cell: &str) -> Vec<String> {
    let mut depth = 0;
    let mut outside = String::new();
    for c in cell.chars() {
        match c {
            '(' => depth += 1,
            ')' => depth -= 1,
            c if depth == 0 => outside.push(c),
            _ => {}
        }
    }
    outside.split('`').skip(1).step_by(2).map(str::to_string).collect()
}

pub const SHOWN: [&str; 8] =
    ["always", "event", "gpu", "supervised", "model_api", "nats", "expiring_key", "external_broker"];

/// The rows of the table, checked for form (five cells, known types and
/// markers, `edgeway_` names, none twice).
pub fn rows() -> Vec<Row> {
    let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md")).unwrap();
    let section = readme.split("\n## Metrics\n").nth(1).expect("a Metrics section");
    let section = section.split("\n## ").next().unwrap();
    let mut rows = Vec::new();
    let mut seen = std::collections::BTreeSet::new();
    let mut lines = section.lines().filter(|l| l.starts_with('|'));
    let header: Vec<&str> = lines.next().expect("a table").trim_matches('|').split('|').map(str::trim).collect();
    assert_eq!(header, ["metric", "type", "labels", "shown", "meaning"], "the table's header");
    for line in lines.filter(|l| !l.starts_with("|---")) {
        let cells: Vec<&str> = line.trim_matches('|').split('|').map(str::trim).collect();
        assert_eq!(cells.len(), 5, "five cells: {line}");
        let names: Vec<String> = cells[0].split(", ").map(|n| n.trim_matches('`').to_string()).collect();
        for n in &names {
            assert!(n.starts_with("edgeway_") && !n.contains(' '), "a metric name: {n} in {line}");
            assert!(seen.insert(n.clone()), "{n} is in the table twice");
        }
        assert!(["counter", "gauge", "histogram"].contains(&cells[1]), "a type: {line}");
        assert!(SHOWN.contains(&cells[3]), "a `shown` marker: {line}");
        rows.push(Row {
            names,
            kind: cells[1].to_string(),
            labels: label_names(cells[2]),
            shown: cells[3].to_string(),
        });
    }
    assert!(rows.len() > 30, "the table was read: {rows:?}");
    rows
}

/// Every metric name the table has, with the series names of histograms
/// (`_bucket`, `_sum`, `_count`), which queries use.
pub fn series_names() -> std::collections::BTreeSet<String> {
    let mut out = std::collections::BTreeSet::new();
    for r in rows() {
        for n in r.names {
            if r.kind == "histogram" {
                for s in ["_bucket", "_sum", "_count"] {
                    out.insert(format!("{n}{s}"));
                }
            }
            out.insert(n);
        }
    }
    out
}
