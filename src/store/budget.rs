//! Budgets: what each tenant and application spent in the current UTC
//! calendar day and month (tokens, input and output together, and cost),
//! against the limits of `[tenants.X.budget]` and
//! `[applications.X.budget]`.
//!
//! Owns: the spent amounts, in memory (read by admission on every call:
//! a lock and a map lookup) and in the `budget_spent` table, one row per
//! tenant or application and window, written in the same transaction as
//! the terminal state of the task that spent them (both or neither), and
//! read back at start, so a restart keeps them; the windows (UTC day and
//! month); whether a limit is reached and when it resets; a warning when
//! a charge crosses `warn_percent` of a limit.
//!
//! Spending is counted when a task ends, from its result's usage and cost
//! (nothing is reserved at admission): every call admitted while a budget
//! still has room runs to its end, so a burst of calls admitted together
//! can pass a limit by what the calls in flight use (at most their input
//! and `max_tokens` each); the next call after is refused.
//!
//! A warning is emitted when a charge takes the used share of a limit from
//! below `warn_percent` to at or above it. Within a window the spent
//! amounts only grow, so it happens once per window; after a restart the
//! share read back is already past it, so it does not happen again.
//!
//! Does not own: the limits' values (config), the refusal's error
//! (admission), the price of a call (the scheduler's driver prices it from
//! the instance that answered) or metrics and events (telemetry's
//! recorder, which charges here).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Mutex};

use rusqlite::{params, Connection};
use serde::Serialize;

use crate::config::{BudgetConfig, Config};

pub const SCHEMA: &str = r#"
CREATE TABLE IF NOT EXISTS budget_spent (
    scope           TEXT NOT NULL,
    name            TEXT NOT NULL,
    period          TEXT NOT NULL,
    window_start_ms INTEGER NOT NULL,
    tokens          INTEGER NOT NULL,
    cost            REAL NOT NULL,
    PRIMARY KEY (scope, name, period)
);
"#;

const DAY_MS: i64 = 86_400_000;

/// Whose budget.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Scope {
    /// All the tenant's applications together.
    Tenant,
    Application,
}

impl Scope {
    pub fn as_str(self) -> &'static str {
        match self {
            Scope::Tenant => "tenant",
            Scope::Application => "application",
        }
    }

    fn parse(s: &str) -> Option<Scope> {
        [Scope::Tenant, Scope::Application].into_iter().find(|x| x.as_str() == s)
    }
}

/// A budget's window: the UTC calendar day or month.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Period {
    Daily,
    Monthly,
}

impl Period {
    pub const ALL: [Period; 2] = [Period::Daily, Period::Monthly];

    pub fn as_str(self) -> &'static str {
        match self {
            Period::Daily => "daily",
            Period::Monthly => "monthly",
        }
    }

    fn parse(s: &str) -> Option<Period> {
        Period::ALL.into_iter().find(|x| x.as_str() == s)
    }

    /// The start (unix ms) of the window that holds `now_ms`.
    pub fn start(self, now_ms: i64) -> i64 {
        let day = now_ms.div_euclid(DAY_MS);
        match self {
            Period::Daily => day * DAY_MS,
            Period::Monthly => {
                let (y, m, _) = civil_from_days(day);
                days_from_civil(y, m, 1) * DAY_MS
            }
        }
    }

    /// The start of the next window: when the spent amounts reset.
    pub fn resets_at(self, now_ms: i64) -> i64 {
        match self {
            Period::Daily => self.start(now_ms) + DAY_MS,
            Period::Monthly => {
                let (y, m, _) = civil_from_days(now_ms.div_euclid(DAY_MS));
                let (y, m) = if m == 12 { (y + 1, 1) } else { (y, m + 1) };
                days_from_civil(y, m, 1) * DAY_MS
            }
        }
    }

    fn limits(self, b: &BudgetConfig) -> (Option<u64>, Option<f64>) {
        match self {
            Period::Daily => (b.daily_tokens, b.daily_cost),
            Period::Monthly => (b.monthly_tokens, b.monthly_cost),
        }
    }
}

/// Days since 1970-01-01 of a proleptic Gregorian date (H. Hinnant's
/// algorithm).
fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// The date (year, month, day) of a day count since 1970-01-01.
pub fn civil_from_days(z: i64) -> (i64, i64, i64) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    (yoe + era * 400 + i64::from(m <= 2), m, d)
}

/// Unix ms as RFC 3339 in UTC, to the second (`2026-12-03T00:00:00Z`).
pub fn rfc3339(ms: i64) -> String {
    let (y, m, d) = civil_from_days(ms.div_euclid(DAY_MS));
    let s = ms.rem_euclid(DAY_MS) / 1000;
    format!("{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z", s / 3600, s / 60 % 60, s % 60)
}

/// What one tenant or application spent in one window.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct Spent {
    window_start_ms: i64,
    tokens: u64,
    cost: f64,
}

type Key = (Scope, String, Period);

#[derive(Default)]
struct State {
    spent: HashMap<Key, Spent>,
    limits: HashMap<(Scope, String), BudgetConfig>,
    /// The configured tenants and applications: metric labels are these
    /// names or `other`, a closed set.
    tenants: BTreeSet<String>,
    /// Each configured application's tenant (for the admin view).
    apps: BTreeMap<String, String>,
}

impl State {
    /// What `key` spent in the window of `now` (nothing when its row is
    /// of an earlier window).
    fn spent(&self, key: &Key, now_ms: i64) -> Spent {
        let start = key.2.start(now_ms);
        match self.spent.get(key) {
            Some(s) if s.window_start_ms == start => *s,
            _ => Spent { window_start_ms: start, ..Spent::default() },
        }
    }
}

/// The share of `period`'s limits of `b` that `s` used: the larger of
/// tokens and cost; `None` when `b` sets neither for the period. A limit
/// of 0 is used up from the start.
fn used_ratio(b: &BudgetConfig, period: Period, s: &Spent) -> Option<f64> {
    let (tokens, cost) = period.limits(b);
    let share = |spent: f64, limit: f64| if limit > 0.0 { spent / limit } else { 1.0 };
    let t = tokens.map(|l| share(s.tokens as f64, l as f64));
    let c = cost.map(|l| share(s.cost, l));
    match (t, c) {
        (None, None) => None,
        (a, b) => Some(a.unwrap_or(0.0).max(b.unwrap_or(0.0))),
    }
}

/// A limit that is reached.
#[derive(Debug, Clone, PartialEq)]
pub struct Exceeded {
    pub scope: Scope,
    pub name: String,
    pub period: Period,
    /// `tokens` or `cost`.
    pub what: &'static str,
    pub spent: f64,
    pub limit: f64,
    pub resets_at_ms: i64,
}

/// A charge that crossed a budget's `warn_percent`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct BudgetWarning {
    pub scope: &'static str,
    pub name: String,
    pub window: &'static str,
    /// The used share of the limit (the larger of tokens and cost).
    pub used_ratio: f64,
    pub warn_percent: u32,
    pub resets_at: String,
}

/// The used share of one budget window after a charge, for the gauge.
#[derive(Debug, Clone, PartialEq)]
pub struct Used {
    pub scope: Scope,
    pub name: String,
    pub period: Period,
    pub ratio: f64,
}

/// What a charge did.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Charged {
    /// The tenant and application as metric labels (`other` for a name
    /// the configuration does not have).
    pub tenant_label: String,
    pub application_label: String,
    pub used: Vec<Used>,
    pub warnings: Vec<BudgetWarning>,
}

/// One window of one budget, as `GET /admin/budgets` shows it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct BudgetView {
    pub scope: &'static str,
    pub name: String,
    pub window: &'static str,
    pub spent_tokens: u64,
    pub spent_cost: f64,
    /// `null`: no limit of that kind.
    pub limit_tokens: Option<u64>,
    pub limit_cost: Option<f64>,
    /// `null` without a limit in this window.
    pub used_ratio: Option<f64>,
    pub warn_percent: Option<u32>,
    pub window_start: String,
    pub resets_at: String,
    pub resets_at_ms: i64,
}

/// The spent amounts and the limits in force. Cheap to clone (shared).
#[derive(Clone, Default)]
pub struct Budgets(Arc<Mutex<State>>);

impl Budgets {
    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        // Every update is whole under the lock: a panic elsewhere leaves
        // the amounts consistent.
        self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Reads what the table holds (at open).
    pub(super) fn load(&self, c: &Connection) -> rusqlite::Result<()> {
        let mut st = c.prepare("SELECT scope, name, period, window_start_ms, tokens, cost FROM budget_spent")?;
        let rows = st.query_map([], |r| {
            Ok((
                r.get::<_, String>(0)?,
                r.get::<_, String>(1)?,
                r.get::<_, String>(2)?,
                r.get::<_, i64>(3)?,
                r.get::<_, i64>(4)?,
                r.get::<_, f64>(5)?,
            ))
        })?;
        let mut s = self.state();
        for row in rows {
            let (scope, name, period, window_start_ms, tokens, cost) = row?;
            if let (Some(scope), Some(period)) = (Scope::parse(&scope), Period::parse(&period)) {
                let spent = Spent { window_start_ms, tokens: u64::try_from(tokens).unwrap_or(0), cost };
                s.spent.insert((scope, name, period), spent);
            }
        }
        Ok(())
    }

    /// Takes the limits and names of `config` (at start and at each
    /// reload); the spent amounts stay.
    pub fn configure(&self, config: &Config) {
        let mut s = self.state();
        s.limits = config
            .tenant_budgets
            .iter()
            .map(|(t, b)| ((Scope::Tenant, t.clone()), *b))
            .chain(config.applications.values().filter_map(|a| Some(((Scope::Application, a.name.clone()), a.budget?))))
            .collect();
        s.tenants =
            config.tenant_weights.keys().chain(config.applications.values().map(|a| &a.tenant)).cloned().collect();
        s.tenants.extend(config.tenant_budgets.keys().cloned());
        s.apps = config.applications.values().map(|a| (a.name.clone(), a.tenant.clone())).collect();
    }

    /// The limit of `tenant`'s or `application`'s budgets that is reached
    /// at `now_ms`, if any: of several, the one that resets last (the call
    /// may be made again only once all have reset).
    pub fn check(&self, tenant: &str, application: &str, now_ms: i64) -> Option<Exceeded> {
        let s = self.state();
        let mut worst: Option<Exceeded> = None;
        for (scope, name) in [(Scope::Tenant, tenant), (Scope::Application, application)] {
            let Some(b) = s.limits.get(&(scope, name.to_string())) else { continue };
            for period in Period::ALL {
                let spent = s.spent(&(scope, name.to_string(), period), now_ms);
                let (tokens, cost) = period.limits(b);
                let reached = match (tokens, cost) {
                    (Some(l), _) if spent.tokens >= l => Some(("tokens", spent.tokens as f64, l as f64)),
                    (_, Some(l)) if spent.cost >= l => Some(("cost", spent.cost, l)),
                    _ => None,
                };
                let Some((what, spent, limit)) = reached else { continue };
                let resets_at_ms = period.resets_at(now_ms);
                if worst.as_ref().is_none_or(|w| resets_at_ms > w.resets_at_ms) {
                    worst = Some(Exceeded { scope, name: name.to_string(), period, what, spent, limit, resets_at_ms });
                }
            }
        }
        worst
    }

    /// Adds a finished task's `tokens` and `cost` to its tenant's and
    /// application's windows at `now_ms` (in memory; the store's writer
    /// adds them to the table with the task's terminal state, see
    /// [`persist`]).
    pub fn charge(&self, tenant: &str, application: &str, tokens: u64, cost: f64, now_ms: i64) -> Charged {
        let mut s = self.state();
        let label = |known: bool, name: &str| if known { name.to_string() } else { "other".to_string() };
        let mut out = Charged {
            tenant_label: label(s.tenants.contains(tenant), tenant),
            application_label: label(s.apps.contains_key(application), application),
            ..Charged::default()
        };
        if tokens == 0 && cost <= 0.0 {
            return out;
        }
        for (scope, name) in [(Scope::Tenant, tenant), (Scope::Application, application)] {
            for period in Period::ALL {
                let key = (scope, name.to_string(), period);
                let before = s.spent(&key, now_ms);
                let after = Spent { tokens: before.tokens.saturating_add(tokens), cost: before.cost + cost, ..before };
                s.spent.insert(key, after);
                let Some(b) = s.limits.get(&(scope, name.to_string())) else { continue };
                let (Some(was), Some(now)) = (used_ratio(b, period, &before), used_ratio(b, period, &after)) else {
                    continue;
                };
                let warn = f64::from(b.warn_percent) / 100.0;
                if was < warn && now >= warn {
                    out.warnings.push(BudgetWarning {
                        scope: scope.as_str(),
                        name: name.to_string(),
                        window: period.as_str(),
                        used_ratio: now,
                        warn_percent: b.warn_percent,
                        resets_at: rfc3339(period.resets_at(now_ms)),
                    });
                }
                out.used.push(Used { scope, name: name.to_string(), period, ratio: now });
            }
        }
        out
    }

    /// Every budget window of `tenant` and of its configured applications
    /// at `now_ms`, with or without limits, tenant first.
    pub fn view(&self, tenant: &str, now_ms: i64) -> Vec<BudgetView> {
        let s = self.state();
        let apps = s.apps.iter().filter(|(_, t)| *t == tenant).map(|(a, _)| (Scope::Application, a.as_str()));
        let mut out = Vec::new();
        for (scope, name) in std::iter::once((Scope::Tenant, tenant)).chain(apps) {
            let b = s.limits.get(&(scope, name.to_string()));
            for period in Period::ALL {
                let spent = s.spent(&(scope, name.to_string(), period), now_ms);
                let (limit_tokens, limit_cost) = b.map(|b| period.limits(b)).unwrap_or_default();
                let resets_at_ms = period.resets_at(now_ms);
                out.push(BudgetView {
                    scope: scope.as_str(),
                    name: name.to_string(),
                    window: period.as_str(),
                    spent_tokens: spent.tokens,
                    spent_cost: spent.cost,
                    limit_tokens,
                    limit_cost,
                    used_ratio: b.and_then(|b| used_ratio(b, period, &spent)),
                    warn_percent: b.filter(|_| limit_tokens.is_some() || limit_cost.is_some()).map(|b| b.warn_percent),
                    window_start: rfc3339(spent.window_start_ms),
                    resets_at: rfc3339(resets_at_ms),
                    resets_at_ms,
                });
            }
        }
        out
    }
}

/// What one finished task spent, to be written with its end.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Charge {
    pub tenant: String,
    pub application: String,
    pub tokens: u64,
    pub cost: f64,
    pub at_ms: i64,
}

/// Adds a finished task's `tokens` and `cost` to the rows of its tenant
/// and application (a row of an earlier window starts over; a late write
/// of an earlier window than the row's is not counted).
pub(super) fn persist(
    c: &Connection,
    tenant: &str,
    application: &str,
    tokens: u64,
    cost: f64,
    at_ms: i64,
) -> rusqlite::Result<()> {
    let charge = Charge { tenant: tenant.into(), application: application.into(), tokens, cost, at_ms };
    persist_all(c, std::slice::from_ref(&charge))
}

/// [`persist`] for the tasks of one write batch: summed per row and
/// window first, so a batch of many tasks of one application writes each
/// of its rows once. Windows are written oldest first (a batch across
/// midnight starts the new day's row over after the old one's).
pub(super) fn persist_all(c: &Connection, charges: &[Charge]) -> rusqlite::Result<()> {
    let mut sums: std::collections::BTreeMap<(&str, &str, &str, i64), (u64, f64)> = Default::default();
    for ch in charges {
        for (scope, name) in [(Scope::Tenant, ch.tenant.as_str()), (Scope::Application, ch.application.as_str())] {
            for period in Period::ALL {
                let sum = sums.entry((scope.as_str(), name, period.as_str(), period.start(ch.at_ms))).or_default();
                sum.0 = sum.0.saturating_add(ch.tokens);
                sum.1 += ch.cost;
            }
        }
    }
    let mut st = c.prepare_cached(
        "INSERT INTO budget_spent (scope, name, period, window_start_ms, tokens, cost) \
         VALUES (?1, ?2, ?3, ?4, ?5, ?6) \
         ON CONFLICT (scope, name, period) DO UPDATE SET \
           tokens = CASE WHEN window_start_ms = excluded.window_start_ms THEN tokens + excluded.tokens \
                    ELSE excluded.tokens END, \
           cost = CASE WHEN window_start_ms = excluded.window_start_ms THEN cost + excluded.cost \
                  ELSE excluded.cost END, \
           window_start_ms = excluded.window_start_ms \
         WHERE excluded.window_start_ms >= budget_spent.window_start_ms",
    )?;
    for ((scope, name, period, start), (tokens, cost)) in sums {
        let tokens = i64::try_from(tokens).unwrap_or(i64::MAX);
        st.execute(params![scope, name, period, start, tokens, cost])?;
    }
    Ok(())
}

/// Deletes up to `batch` rows (per window kind) that can no longer count
/// at `now_ms`. A row holds one window of one budget and starts over when
/// the next window begins, so a row of an ended window counts for nothing;
/// it stays only while its tenant or application spends nothing in a later
/// one. The window before the current one is kept all the same (a charge
/// near the boundary may still be written to it); older ones go: a daily
/// row from the day before yesterday, a monthly row from the month before
/// last. Run by the writer's retention pass; returns how many went.
pub(super) fn purge(c: &Connection, now_ms: i64, batch: usize) -> rusqlite::Result<usize> {
    let limit = i64::try_from(batch).unwrap_or(i64::MAX);
    let mut n = 0;
    for period in Period::ALL {
        let previous = period.start(period.start(now_ms) - 1);
        n += super::exec(
            c,
            "DELETE FROM budget_spent WHERE rowid IN \
             (SELECT rowid FROM budget_spent WHERE period = ?1 AND window_start_ms < ?2 LIMIT ?3)",
            params![period.as_str(), previous, limit],
        )?;
    }
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 2026-12-02T13:40:00Z.
    const NOW: i64 = 1_796_218_800_000;

    fn budgets(extra: &str) -> Budgets {
        let text = format!(
            "[applications.demo]\ntenant = \"demo\"\napi_key_sha256 = [\"{}\"]\n\
             [engines.a]\ntype = \"openai\"\nbase_url = \"http://127.0.0.1:9\"\nmodel = \"m\"\n\
             [models.chat]\ninstances = [\"a\"]\n{extra}",
            hex::encode(crate::config::hash_api_key("k"))
        );
        let config = Config::from_toml_str(&text, std::iter::empty(), std::path::Path::new(".")).unwrap();
        let b = Budgets::default();
        b.configure(&config);
        b
    }

    #[test]
    fn windows_are_utc_calendar_days_and_months() {
        assert_eq!(rfc3339(NOW), "2026-12-02T13:40:00Z");
        assert_eq!(rfc3339(Period::Daily.start(NOW)), "2026-12-02T00:00:00Z");
        assert_eq!(rfc3339(Period::Daily.resets_at(NOW)), "2026-12-03T00:00:00Z");
        assert_eq!(rfc3339(Period::Monthly.start(NOW)), "2026-12-01T00:00:00Z");
        assert_eq!(rfc3339(Period::Monthly.resets_at(NOW)), "2027-01-01T00:00:00Z");
        // A leap February.
        let feb = days_from_civil(2028, 2, 29) * DAY_MS + 1;
        assert_eq!(rfc3339(Period::Monthly.resets_at(feb)), "2028-03-01T00:00:00Z");
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00Z");
    }

    #[test]
    fn a_budget_is_reached_warns_once_and_resets_with_its_window() {
        let b = budgets("[applications.demo.budget]\ndaily_tokens = 100\nmonthly_cost = 1.0\n");
        assert_eq!(b.check("demo", "demo", NOW), None);
        let c = b.charge("demo", "demo", 70, 0.1, NOW);
        assert!(c.warnings.is_empty(), "70 % is under 80 %");
        assert_eq!((c.tenant_label.as_str(), c.application_label.as_str()), ("demo", "demo"));
        let c = b.charge("demo", "demo", 20, 0.1, NOW);
        assert_eq!(c.warnings.len(), 1, "{c:?}");
        assert_eq!((c.warnings[0].window, c.warnings[0].name.as_str()), ("daily", "demo"));
        assert!(b.charge("demo", "demo", 5, 0.0, NOW).warnings.is_empty(), "once per window");
        assert_eq!(b.check("demo", "demo", NOW), None, "95 of 100");
        b.charge("demo", "demo", 5, 0.0, NOW);
        let e = b.check("demo", "demo", NOW).expect("100 of 100 is reached");
        assert_eq!(
            (e.scope, e.period, e.what, e.resets_at_ms),
            (Scope::Application, Period::Daily, "tokens", NOW + 37_200_000)
        );
        // The next day it is open again; the month's cost goes on.
        assert_eq!(b.check("demo", "demo", NOW + DAY_MS), None);
        b.charge("demo", "demo", 1, 0.9, NOW + DAY_MS);
        let e = b.check("demo", "demo", NOW + DAY_MS).expect("1.1 of 1.0");
        assert_eq!((e.period, e.what), (Period::Monthly, "cost"));
        // Another application and an unknown one are not limited.
        assert_eq!(b.check("other", "x", NOW), None);
        assert_eq!(b.charge("other", "x", 5, 0.0, NOW).tenant_label, "other");
    }

    #[test]
    fn spent_amounts_persist_per_window() {
        let c = Connection::open_in_memory().unwrap();
        c.execute_batch(SCHEMA).unwrap();
        persist(&c, "demo", "app", 10, 0.5, NOW).unwrap();
        persist(&c, "demo", "app", 5, 0.25, NOW).unwrap();
        // Next month: the monthly and daily rows start over.
        persist(&c, "demo", "app", 1, 0.0, NOW + 31 * DAY_MS).unwrap();
        // A late write of the earlier window is not counted in the new one.
        persist(&c, "demo", "app", 100, 0.0, NOW).unwrap();
        let b = budgets("[tenants.demo.budget]\nmonthly_tokens = 16\n");
        b.load(&c).unwrap();
        assert_eq!(b.check("demo", "app", NOW + 31 * DAY_MS), None, "1 of 16");
        let v = b.view("demo", NOW + 31 * DAY_MS);
        assert_eq!((v[1].window, v[1].spent_tokens, v[1].limit_tokens), ("monthly", 1, Some(16)));
        let b = budgets("[tenants.demo.budget]\nmonthly_tokens = 15\n");
        let c2 = Connection::open_in_memory().unwrap();
        c2.execute_batch(SCHEMA).unwrap();
        persist(&c2, "demo", "app", 10, 0.5, NOW).unwrap();
        persist(&c2, "demo", "app", 5, 0.25, NOW).unwrap();
        b.load(&c2).unwrap();
        let e = b.check("demo", "app", NOW).expect("15 of 15 read back");
        assert_eq!((e.scope, e.period), (Scope::Tenant, Period::Monthly));
    }

    /// Rows of windows that can no longer count go; the current and the
    /// previous window stay. Failed before: nothing deleted a row, so the
    /// table kept a row per tenant and application that ever spent.
    #[test]
    fn the_purge_deletes_the_rows_of_windows_older_than_the_previous_one() {
        let c = Connection::open_in_memory().unwrap();
        c.execute_batch(SCHEMA).unwrap();
        let month = 31 * DAY_MS;
        persist(&c, "now", "now-app", 1, 0.0, NOW).unwrap();
        persist(&c, "yesterday", "yesterday-app", 1, 0.0, NOW - DAY_MS).unwrap();
        persist(&c, "old", "old-app", 1, 0.0, NOW - 2 * DAY_MS).unwrap();
        persist(&c, "ancient", "ancient-app", 1, 0.0, NOW - 3 * month).unwrap();
        let rows = |sql: &str| -> Vec<String> {
            let mut st = c.prepare(sql).unwrap();
            st.query_map([], |r| r.get::<_, String>(0)).unwrap().map(Result::unwrap).collect()
        };
        let daily = || rows("SELECT DISTINCT name FROM budget_spent WHERE period = 'daily' ORDER BY name");
        let monthly = || rows("SELECT DISTINCT name FROM budget_spent WHERE period = 'monthly' ORDER BY name");
        assert_eq!(daily().len(), 8);
        // 2026-12-02: yesterday is kept; 2026-11-30 and older go. The
        // month before (November) is kept; older months go.
        assert_eq!(purge(&c, NOW, 100).unwrap(), 4 + 2);
        assert_eq!(daily(), ["now", "now-app", "yesterday", "yesterday-app"]);
        assert_eq!(monthly(), ["now", "now-app", "old", "old-app", "yesterday", "yesterday-app"]);
        // Bounded per window kind, and nothing more to do afterwards.
        persist(&c, "x", "x-app", 1, 0.0, NOW - 5 * DAY_MS).unwrap();
        assert_eq!(purge(&c, NOW, 1).unwrap(), 1);
        assert_eq!(purge(&c, NOW, 1).unwrap(), 1);
        assert_eq!(purge(&c, NOW, 1).unwrap(), 0);
        // What is left still reads back and counts.
        let b = budgets("[tenants.now.budget]\ndaily_tokens = 1\n");
        b.load(&c).unwrap();
        assert!(b.check("now", "now-app", NOW).is_some(), "1 of 1 today");
    }
}
