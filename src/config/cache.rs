//! `[cache]`: the response cache's settings (see `scheduler::cache` for
//! what is cached and when), as written and as validated.
//!
//! Owns: the section's keys, defaults and rules. Does not own: the cache
//! itself. Applications opt out with their own key (`applications.X.cache
//! = false`, in `raw.rs`).

use std::time::Duration;

use serde::Deserialize;

use super::raw::Field;
use super::Problems;
use crate::task::DataClass;

/// The most `max_bytes` may be: the cache lives in the gateway's memory.
const MAX_BYTES_CEILING: u64 = 16 * 1024 * 1024 * 1024;
/// The most `ttl_s` and `stale_ttl_s` may be: 30 days.
const MAX_TTL_S: u64 = 30 * 24 * 3600;

#[derive(Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RawCache {
    pub enabled: bool,
    pub ttl_s: u64,
    pub stale_ttl_s: u64,
    pub max_bytes: u64,
    pub max_data_class: Field<DataClass>,
}

impl Default for RawCache {
    fn default() -> Self {
        RawCache {
            enabled: false,
            ttl_s: 300,
            stale_ttl_s: 86_400,
            max_bytes: 64 * 1024 * 1024,
            max_data_class: Field::Valid(DataClass::Personal),
        }
    }
}

/// The validated section.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CacheConfig {
    /// Off by default: a cache changes what a repeated call costs and
    /// returns, so an operator turns it on.
    pub enabled: bool,
    /// A hit is fresh this long after its answer was stored.
    pub ttl: Duration,
    /// The routing chain's cached step (every engine step failed) may
    /// serve an answer up to this old, marked stale.
    pub stale_ttl: Duration,
    /// Bytes of answers held at most; least recently used go first.
    pub max_bytes: usize,
    /// The most sensitive data class cached: `public` or `personal`
    /// (sensitive and secret data are never cached).
    pub max_data_class: DataClass,
}

pub(super) fn validate(raw: RawCache, p: &mut Problems) -> CacheConfig {
    if raw.ttl_s == 0 || raw.ttl_s > MAX_TTL_S {
        p.add("cache.ttl_s", format!("must be 1..{MAX_TTL_S} seconds"));
    }
    if raw.stale_ttl_s > MAX_TTL_S {
        p.add("cache.stale_ttl_s", format!("must be at most {MAX_TTL_S} seconds"));
    }
    if raw.max_bytes < 1024 || raw.max_bytes > MAX_BYTES_CEILING {
        p.add("cache.max_bytes", format!("must be 1024..{MAX_BYTES_CEILING} bytes"));
    }
    let class = raw.max_data_class.get("cache.max_data_class", p).unwrap_or(DataClass::Personal);
    if class > DataClass::Personal {
        p.add("cache.max_data_class", "must be \"public\" or \"personal\": sensitive and secret data are never cached");
    }
    CacheConfig {
        enabled: raw.enabled,
        ttl: Duration::from_secs(raw.ttl_s),
        stale_ttl: Duration::from_secs(raw.stale_ttl_s),
        max_bytes: raw.max_bytes.min(MAX_BYTES_CEILING) as usize,
        max_data_class: class.min(DataClass::Personal),
    }
}

#[cfg(test)]
mod tests {
    use crate::config::Config;

    fn load(cache: &str) -> Result<Config, String> {
        let text = format!(
            r#"
[applications.a]
tenant = "t1"
api_key_sha256 = ["{k}"]
cache = false
[engines.e]
type = "openai"
base_url = "http://127.0.0.1:1"
model = "m"
[models.general-chat]
instances = ["e"]
context_tokens = 2048
max_output_tokens = 256
[cache]
{cache}
"#,
            k = "0".repeat(64)
        );
        Config::from_toml_str(&text, std::iter::empty(), std::path::Path::new(".")).map_err(|e| e.to_string())
    }

    #[test]
    fn defaults_and_rules() {
        let c = load("").unwrap();
        assert!(!c.cache.enabled);
        assert_eq!(c.cache.ttl.as_secs(), 300);
        assert_eq!(c.cache.max_data_class, crate::task::DataClass::Personal);
        assert!(!c.applications["a"].cache, "an application opts out");
        let c =
            load("enabled = true\nttl_s = 5\nstale_ttl_s = 60\nmax_bytes = 2048\nmax_data_class = \"public\"").unwrap();
        assert!(c.cache.enabled && c.cache.max_bytes == 2048 && c.cache.stale_ttl.as_secs() == 60);
        let e = load("ttl_s = 0\nmax_bytes = 10\nmax_data_class = \"secret\"\ncolour = 1").unwrap_err();
        assert!(e.contains("colour"), "{e}");
        let e = load("ttl_s = 0\nmax_bytes = 10\nmax_data_class = \"secret\"").unwrap_err();
        for key in ["cache.ttl_s", "cache.max_bytes", "cache.max_data_class"] {
            assert!(e.contains(key), "{key}: {e}");
        }
        let e = load("max_data_class = \"sensitive\"").unwrap_err();
        assert!(e.contains("never cached"), "{e}");
    }
}
