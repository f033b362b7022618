//! Redaction of sensitive fields before anything is kept in a session:
//! each application's patterns (`[applications.X] redact = ["regex", …]`)
//! are replaced by `[REDACTED]` in the history and memory of its sessions.
//!
//! Owns: the compiled patterns and the replacement. Does not own: the
//! patterns' validation (config checks they compile) or what is sent to
//! the engine for the current call (the call's own text goes as it came;
//! only what is kept, and therefore what later turns see, is redacted).

use std::collections::HashMap;

use regex::Regex;

use crate::config::Config;

/// What a match is replaced by.
pub const REDACTED: &str = "[REDACTED]";

/// The patterns of every application that has some.
#[derive(Debug, Default)]
pub struct Redactor {
    by_app: HashMap<String, Vec<Regex>>,
}

impl Redactor {
    pub fn from_config(cfg: &Config) -> Redactor {
        let by_app = cfg
            .applications
            .iter()
            .filter(|(_, a)| !a.redact.is_empty())
            // Config validation compiled each pattern already.
            .map(|(name, a)| (name.clone(), a.redact.iter().filter_map(|p| Regex::new(p).ok()).collect()))
            .collect();
        Redactor { by_app }
    }

    /// `text` with every match of `app`'s patterns replaced.
    pub fn redact(&self, app: &str, text: &str) -> String {
        let Some(patterns) = self.by_app.get(app) else { return text.to_string() };
        let mut out = text.to_string();
        for p in patterns {
            if let std::borrow::Cow::Owned(s) = p.replace_all(&out, REDACTED) {
                out = s;
            }
        }
        out
    }
}
