//! Engine self-reports read over plain HTTP: the KV-cache gauge of a
//! Prometheus `/metrics` page, and a back-off for endpoints an engine does
//! not have (so a probe does not ask for them every few seconds forever).
//!
//! Owns: parsing the Prometheus text format, as far as one gauge needs.
//! Does not own: what the scheduler does with a reading.

use std::time::{Duration, Instant};

/// Gauges of KV-cache usage as a fraction (0..=1), by engine: vLLM (newer
/// and older name) and llama.cpp's server started with `--metrics` (older
/// builds; newer ones have no such gauge).
const KV_CACHE_USAGE: &[&str] =
    &["vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "llamacpp:kv_cache_usage_ratio"];

/// The KV-cache usage in a Prometheus text page: the highest value of any
/// known gauge over all its label sets (one per model or engine), or `None`
/// when the page has none. Values outside 0..=1 (or not numbers) are not a
/// fraction and are ignored rather than guessed at.
pub(crate) fn kv_cache_usage(text: &str) -> Option<f64> {
    text.lines().filter_map(sample).filter(|(name, _)| KV_CACHE_USAGE.contains(name)).map(|(_, v)| v).reduce(f64::max)
}

/// One sample line `name{labels} value [timestamp]` as (name, value);
/// `None` for comments, blank lines, garbage and values that are not a
/// fraction.
fn sample(line: &str) -> Option<(&str, f64)> {
    let line = line.trim();
    if line.is_empty() || line.starts_with('#') {
        return None;
    }
    let name_end = line.find(|c: char| c == '{' || c.is_whitespace())?;
    let (name, mut rest) = line.split_at(name_end);
    if rest.starts_with('{') {
        rest = &rest[labels_end(rest)?..];
    }
    let value: f64 = rest.split_whitespace().next()?.parse().ok()?;
    (0.0..=1.0).contains(&value).then_some((name, value))
}

/// The byte index just past the `}` closing the label set that `s` starts
/// with. Label values are quoted and may hold `}` and escaped quotes.
fn labels_end(s: &str) -> Option<usize> {
    let mut quoted = false;
    let mut escaped = false;
    for (i, c) in s.char_indices() {
        match c {
            _ if escaped => escaped = false,
            '\\' if quoted => escaped = true,
            '"' => quoted = !quoted,
            '}' if !quoted => return Some(i + 1),
            _ => {}
        }
    }
    None
}

/// Misses (the engine answered that it has no such endpoint or gauge) that
/// are retried at every probe, in case the engine was still starting.
const FREE_MISSES: u32 = 3;
/// The pause after those, doubled at every further miss up to the cap.
const FIRST_PAUSE: Duration = Duration::from_secs(30);
const MAX_PAUSE: Duration = Duration::from_secs(600);

/// Whether to ask an optional endpoint now. After a few misses in a row it
/// is asked again only after a pause that grows with each miss; one answer
/// resets it. Errors that say nothing about the endpoint (timeouts, 5xx)
/// are neither.
#[derive(Debug, Default)]
pub(crate) struct Backoff {
    misses: u32,
    paused_until: Option<Instant>,
}

impl Backoff {
    pub(crate) fn ready(&self, now: Instant) -> bool {
        self.paused_until.is_none_or(|t| now >= t)
    }

    pub(crate) fn hit(&mut self) {
        *self = Backoff::default();
    }

    pub(crate) fn miss(&mut self, now: Instant) {
        self.misses = self.misses.saturating_add(1);
        if self.misses >= FREE_MISSES {
            let doublings = (self.misses - FREE_MISSES).min(10);
            self.paused_until = Some(now + (FIRST_PAUSE * 2u32.pow(doublings)).min(MAX_PAUSE));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vllm_new_and_old_names_take_the_highest_label_set() {
        let page = r#"
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="Qwen/Qwen3-0.6B"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="Qwen/Qwen3-0.6B"} 0.75
vllm:num_requests_running{engine="0",model_name="Qwen/Qwen3-0.6B"} 3.0
"#;
        assert_eq!(kv_cache_usage(page), Some(0.75));
        let old = "vllm:gpu_cache_usage_perc{model_name=\"m\"} 0.5\nvllm:cpu_cache_usage_perc{model_name=\"m\"} 0.9\n";
        assert_eq!(kv_cache_usage(old), Some(0.5), "the CPU swap cache is not the KV cache");
    }

    #[test]
    fn llama_cpp_gauge_without_labels_and_with_a_timestamp() {
        let page = "# HELP llamacpp:kv_cache_usage_ratio KV-cache usage. 1 means 100 percent usage.\n\
                    # TYPE llamacpp:kv_cache_usage_ratio gauge\n\
                    llamacpp:kv_cache_usage_ratio 0.125\n\
                    llamacpp:requests_processing 1\n";
        assert_eq!(kv_cache_usage(page), Some(0.125));
        assert_eq!(kv_cache_usage("llamacpp:kv_cache_usage_ratio 0.5 1712345678000"), Some(0.5));
    }

    #[test]
    fn labels_may_hold_braces_spaces_and_escaped_quotes() {
        let page = r#"vllm:kv_cache_usage_perc{model_name="odd} \"name\" x",engine="0"} 0.3"#;
        assert_eq!(kv_cache_usage(page), Some(0.3));
    }

    #[test]
    fn pages_without_the_gauge_or_with_garbage_give_none() {
        // Newer llama.cpp builds: metrics, but no KV gauge.
        assert_eq!(kv_cache_usage("llamacpp:prompt_tokens_total 10\nllamacpp:requests_processing 0\n"), None);
        assert_eq!(kv_cache_usage(""), None);
        assert_eq!(kv_cache_usage("<html>404 page not found</html>"), None);
        for bad in [
            "vllm:kv_cache_usage_perc",
            "vllm:kv_cache_usage_perc{engine=\"0\"",
            "vllm:kv_cache_usage_perc{engine=\"0\"} ",
            "vllm:kv_cache_usage_perc{engine=\"0\"} lots",
            "vllm:kv_cache_usage_perc NaN",
            "vllm:kv_cache_usage_perc +Inf",
            "vllm:kv_cache_usage_perc -0.5",
            "vllm:kv_cache_usage_perc 35",
            "# vllm:kv_cache_usage_perc 0.5",
            "vllm:kv_cache_usage_perc_total 0.5",
        ] {
            assert_eq!(kv_cache_usage(bad), None, "{bad:?}");
        }
        // A bad line does not hide a good one.
        assert_eq!(
            kv_cache_usage("vllm:kv_cache_usage_perc{x=\"1\"} oops\nvllm:kv_cache_usage_perc{x=\"2\"} 0.4"),
            Some(0.4)
        );
    }

    #[test]
    fn backoff_pauses_after_a_few_misses_and_resets_on_a_hit() {
        let t0 = Instant::now();
        let mut b = Backoff::default();
        for _ in 0..FREE_MISSES - 1 {
            b.miss(t0);
            assert!(b.ready(t0));
        }
        b.miss(t0);
        assert!(!b.ready(t0));
        assert!(b.ready(t0 + FIRST_PAUSE));
        b.miss(t0 + FIRST_PAUSE);
        assert!(!b.ready(t0 + FIRST_PAUSE * 2), "the pause doubles");
        assert!(b.ready(t0 + FIRST_PAUSE * 3));
        for _ in 0..40 {
            b.miss(t0);
        }
        assert!(b.ready(t0 + MAX_PAUSE), "capped");
        b.hit();
        b.miss(t0);
        assert!(b.ready(t0));
    }
}
