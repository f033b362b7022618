//! A circuit breaker per engine instance: a pure state machine (no I/O, no
//! clock of its own; time is passed in) that turns what the router saw of
//! an instance's recent attempts and probes into CLOSED (traffic flows),
//! OPEN (no traffic until a cool-down is over) or HALF_OPEN (one trial
//! request at a time decides).
//!
//! Owns: the rules that open and close the breaker, the sliding window of
//! recent outcomes they read (bounded in time and in entries), the one
//! trial of HALF_OPEN, and the error rate and p95 time to first token it
//! reports for routing weights.
//!
//! Does not own: timers (the caller polls with the current time), metrics
//! and logs (the caller reports each [`Transition`]), what counts as a
//! failed attempt (the router classifies an engine's answer into an
//! [`Attempt`]), or the probes themselves (`health.rs` runs them; their
//! verdicts come in through [`Breaker::probe`]).

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use crate::config::BreakerConfig;

/// Most outcomes the window keeps, whatever the request rate: enough for a
/// stable rate and p95, small enough that a p95 costs microseconds.
const WINDOW_CAP: usize = 1024;

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum BreakerState {
    #[default]
    Closed,
    Open,
    HalfOpen,
}

impl BreakerState {
    /// The metric label (a closed set).
    pub fn as_str(self) -> &'static str {
        match self {
            BreakerState::Closed => "closed",
            BreakerState::Open => "open",
            BreakerState::HalfOpen => "half_open",
        }
    }

    /// The gauge value: 0 closed, 1 half-open, 2 open, so that higher is
    /// worse on a dashboard.
    pub fn gauge(self) -> i64 {
        match self {
            BreakerState::Closed => 0,
            BreakerState::HalfOpen => 1,
            BreakerState::Open => 2,
        }
    }
}

/// What one engine attempt came to, as the router reports it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Attempt {
    Success { ttft: Duration },
    Failure,
    OutOfMemory,
}

/// A change of state with why (for logs, the task record, `/ready`).
#[derive(Debug, Clone, PartialEq)]
pub struct Transition {
    pub from: BreakerState,
    pub to: BreakerState,
    /// Short and concrete, e.g. "5 consecutive failures".
    pub reason: String,
}

/// One outcome in the window.
#[derive(Debug, Clone, Copy)]
struct Outcome {
    at: Instant,
    /// Time to first token of a success; `None` for a failure.
    ttft: Option<Duration>,
}

#[derive(Debug)]
pub struct Breaker {
    settings: BreakerConfig,
    state: BreakerState,
    /// Failures in a row while CLOSED; reset by a successful attempt and
    /// on every change of state.
    consecutive: u32,
    /// Oldest first; pruned by age on every record and capped at
    /// [`WINDOW_CAP`].
    window: VecDeque<Outcome>,
    /// Failures in `window`, kept so that a record costs O(1) for the
    /// error-rate rule.
    window_failures: usize,
    /// When the current cool-down started; `Some` exactly while OPEN.
    open_since: Option<Instant>,
    /// A HALF_OPEN trial request is out; only ever true while HALF_OPEN.
    trial_out: bool,
}

impl Breaker {
    pub fn new(settings: BreakerConfig) -> Breaker {
        Breaker {
            settings,
            state: BreakerState::Closed,
            consecutive: 0,
            window: VecDeque::new(),
            window_failures: 0,
            open_since: None,
            trial_out: false,
        }
    }

    pub fn state(&self) -> BreakerState {
        self.state
    }

    /// Records an attempt's outcome.
    ///
    /// CLOSED: opens at once on [`Attempt::OutOfMemory`]; otherwise on
    /// `consecutive_failures` failures in a row, on an error rate of at
    /// least `error_rate` over a window of at least `min_requests`
    /// outcomes, or on a p95 time to first token over `ttft_p95` with at
    /// least `min_requests` successes in the window.
    ///
    /// HALF_OPEN with a trial out: this is the trial's outcome and it
    /// decides: a success closes (window cleared), a failure or OOM opens
    /// again and the cool-down starts again. With no trial out, the outcome
    /// is of a request that started before the breaker opened: it is
    /// recorded and decides nothing (it says nothing about the engine
    /// since the cool-down).
    ///
    /// OPEN: outcomes of requests that were already running are recorded
    /// in the window but do not change the state.
    pub fn record(&mut self, now: Instant, attempt: Attempt) -> Option<Transition> {
        self.push(now, attempt);
        match self.state {
            BreakerState::Open => None,
            BreakerState::HalfOpen if !self.trial_out => None,
            BreakerState::HalfOpen => {
                self.trial_out = false;
                match attempt {
                    Attempt::Success { .. } => {
                        self.clear_window();
                        Some(self.go(BreakerState::Closed, now, "trial request succeeded".into()))
                    }
                    Attempt::Failure => Some(self.go(BreakerState::Open, now, "trial request failed".into())),
                    Attempt::OutOfMemory => {
                        Some(self.go(BreakerState::Open, now, "trial request failed: engine out of memory".into()))
                    }
                }
            }
            BreakerState::Closed => {
                match attempt {
                    Attempt::OutOfMemory => {
                        return Some(self.go(BreakerState::Open, now, "engine out of memory".into()));
                    }
                    Attempt::Failure => self.consecutive += 1,
                    Attempt::Success { .. } => self.consecutive = 0,
                }
                let reason = self.closed_rules("")?;
                Some(self.go(BreakerState::Open, now, reason))
            }
        }
    }

    /// A health probe's verdict. While CLOSED a failed probe counts toward
    /// the consecutive failures (a good one does not reset them: requests
    /// that fail against an engine that answers its probe still fail).
    /// While OPEN a failed probe starts the cool-down again, and a good one
    /// after the cool-down half-opens, so traffic returns without an
    /// operator. While HALF_OPEN a failed probe opens again: no trial
    /// should go to an engine known to be down.
    pub fn probe(&mut self, now: Instant, up: bool) -> Option<Transition> {
        match (self.state, up) {
            (BreakerState::Closed, true) | (BreakerState::HalfOpen, true) => None,
            (BreakerState::Closed, false) => {
                self.prune(now);
                self.consecutive += 1;
                let reason = self.closed_rules(", the last a health probe")?;
                Some(self.go(BreakerState::Open, now, reason))
            }
            (BreakerState::Open, false) => {
                self.open_since = Some(now);
                None
            }
            (BreakerState::Open, true) => {
                if !self.cooled_down(now) {
                    return None;
                }
                let reason = format!("cool-down of {} over, health probe up", show(self.settings.cooldown));
                Some(self.go(BreakerState::HalfOpen, now, reason))
            }
            (BreakerState::HalfOpen, false) => Some(self.go(BreakerState::Open, now, "health probe failed".into())),
        }
    }

    /// OPEN -> HALF_OPEN once the cool-down has elapsed; otherwise `None`.
    pub fn poll(&mut self, now: Instant) -> Option<Transition> {
        if self.state != BreakerState::Open || !self.cooled_down(now) {
            return None;
        }
        let reason = format!("cool-down of {} over", show(self.settings.cooldown));
        Some(self.go(BreakerState::HalfOpen, now, reason))
    }

    /// When an OPEN breaker will half-open (`None` unless OPEN).
    pub fn reopens_at(&self) -> Option<Instant> {
        self.open_since.map(|t| t + self.settings.cooldown)
    }

    /// Whether a request may go to the instance now. CLOSED: always.
    /// OPEN: never. HALF_OPEN: exactly one trial at a time, so this returns
    /// true once and then false until the trial's outcome is recorded
    /// ([`Breaker::record`]) or it is abandoned ([`Breaker::end_trial`]).
    pub fn try_trial(&mut self) -> bool {
        match self.state {
            BreakerState::Closed => true,
            BreakerState::Open => false,
            BreakerState::HalfOpen if self.trial_out => false,
            BreakerState::HalfOpen => {
                self.trial_out = true;
                true
            }
        }
    }

    /// Abandons the trial without an outcome (the task was cancelled before
    /// the engine answered), so that another request may try.
    pub fn end_trial(&mut self) {
        self.trial_out = false;
    }

    /// Failures / outcomes in the window at `now` (0..=1; 0 with none).
    pub fn error_rate(&self, now: Instant) -> f64 {
        let (mut n, mut failed) = (0usize, 0usize);
        for o in self.live(now) {
            n += 1;
            failed += usize::from(o.ttft.is_none());
        }
        if n == 0 {
            0.0
        } else {
            failed as f64 / n as f64
        }
    }

    /// p95 time to first token over the window's successes at `now`
    /// (`None` with none).
    pub fn ttft_p95(&self, now: Instant) -> Option<Duration> {
        p95(self.live(now).filter_map(|o| o.ttft).collect())
    }

    /// The window's outcomes that are still inside it at `now`, without
    /// pruning (for `&self` readers).
    fn live(&self, now: Instant) -> impl Iterator<Item = &Outcome> {
        let window = self.settings.window;
        self.window.iter().filter(move |o| now.saturating_duration_since(o.at) < window)
    }

    fn push(&mut self, now: Instant, attempt: Attempt) {
        self.prune(now);
        if self.window.len() == WINDOW_CAP {
            self.pop_front();
        }
        let ttft = match attempt {
            Attempt::Success { ttft } => Some(ttft),
            Attempt::Failure | Attempt::OutOfMemory => None,
        };
        self.window_failures += usize::from(ttft.is_none());
        self.window.push_back(Outcome { at: now, ttft });
    }

    /// Drops outcomes older than the window. Outcomes are pushed in the
    /// order of the times passed in, so the old ones are at the front.
    fn prune(&mut self, now: Instant) {
        while self.window.front().is_some_and(|o| now.saturating_duration_since(o.at) >= self.settings.window) {
            self.pop_front();
        }
    }

    fn pop_front(&mut self) {
        if let Some(o) = self.window.pop_front() {
            self.window_failures -= usize::from(o.ttft.is_none());
        }
    }

    fn clear_window(&mut self) {
        self.window.clear();
        self.window_failures = 0;
    }

    /// The first CLOSED rule that says open, as a reason. The caller has
    /// pruned the window at the current time. `suffix` says what the last
    /// failure was when it was not an attempt.
    fn closed_rules(&self, suffix: &str) -> Option<String> {
        let s = &self.settings;
        if self.consecutive >= s.consecutive_failures.max(1) {
            return Some(format!("{} consecutive failures{suffix}", self.consecutive));
        }
        let n = self.window.len();
        if n > 0 && n >= s.min_requests as usize {
            let rate = self.window_failures as f64 / n as f64;
            if rate >= s.error_rate {
                return Some(format!("error rate {:.0} % over {n} requests in {}", rate * 100.0, show(s.window)));
            }
        }
        if let Some(limit) = s.ttft_p95 {
            let ttfts: Vec<Duration> = self.window.iter().filter_map(|o| o.ttft).collect();
            if !ttfts.is_empty() && ttfts.len() >= s.min_requests as usize {
                let p = p95(ttfts)?;
                if p > limit {
                    return Some(format!("p95 time to first token {} ms over {} ms", p.as_millis(), limit.as_millis()));
                }
            }
        }
        None
    }

    fn cooled_down(&self, now: Instant) -> bool {
        self.reopens_at().is_some_and(|t| now >= t)
    }

    /// Moves to `to`, keeping the fields that belong to a state in step.
    fn go(&mut self, to: BreakerState, now: Instant, reason: String) -> Transition {
        let from = self.state;
        self.state = to;
        self.consecutive = 0;
        self.open_since = (to == BreakerState::Open).then_some(now);
        if to != BreakerState::HalfOpen {
            self.trial_out = false;
        }
        Transition { from, to, reason }
    }

    /// The invariants every sequence of calls keeps.
    #[cfg(test)]
    fn check(&self) {
        assert!(self.window.len() <= WINDOW_CAP, "window over its cap");
        assert_eq!(self.window_failures, self.window.iter().filter(|o| o.ttft.is_none()).count());
        assert_eq!(self.open_since.is_some(), self.state == BreakerState::Open, "cool-down only while OPEN");
        assert!(!self.trial_out || self.state == BreakerState::HalfOpen, "a trial only while HALF_OPEN");
    }
}

/// Nearest-rank p95 (`None` for no samples).
fn p95(mut samples: Vec<Duration>) -> Option<Duration> {
    if samples.is_empty() {
        return None;
    }
    // Nearest rank: the smallest value with at least 95 % of samples at or
    // below it, ceil(0.95 n) in 1-based terms, in integers.
    let rank = (samples.len() * 95).div_ceil(100);
    let (_, p, _) = samples.select_nth_unstable(rank - 1);
    Some(*p)
}

/// A duration for a reason string: whole seconds as "30 s", else "250 ms".
fn show(d: Duration) -> String {
    if d.subsec_nanos() == 0 {
        format!("{} s", d.as_secs())
    } else {
        format!("{} ms", d.as_millis())
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    const OK: Attempt = Attempt::Success { ttft: Duration::from_millis(100) };

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    fn secs(n: u64) -> Duration {
        Duration::from_secs(n)
    }

    fn breaker() -> Breaker {
        Breaker::new(BreakerConfig::default())
    }

    /// A breaker opened by `n` consecutive failures at `t0`.
    fn opened(t0: Instant) -> Breaker {
        let mut b = breaker();
        for _ in 0..5 {
            b.record(t0, Attempt::Failure);
        }
        assert_eq!(b.state(), BreakerState::Open);
        b
    }

    /// A breaker half-opened by its cool-down, at `t0 + 10 s`.
    fn half_opened(t0: Instant) -> Breaker {
        let mut b = opened(t0);
        b.poll(t0 + secs(10)).expect("half-opens after the cool-down");
        b
    }

    fn to(t: Option<Transition>) -> Option<(BreakerState, String)> {
        t.map(|t| (t.to, t.reason))
    }

    #[test]
    fn state_labels_and_gauge() {
        assert_eq!(BreakerState::HalfOpen.as_str(), "half_open");
        assert_eq!(serde_json::to_string(&BreakerState::HalfOpen).unwrap(), "\"HALF_OPEN\"");
        let g: Vec<i64> = [BreakerState::Closed, BreakerState::HalfOpen, BreakerState::Open].map(|s| s.gauge()).into();
        assert_eq!(g, vec![0, 1, 2]);
    }

    #[test]
    fn a_success_before_the_nth_failure_keeps_it_closed() {
        let t0 = Instant::now();
        let mut b = breaker();
        // Four failures, a success, four failures: never five in a row.
        // Few enough outcomes (9 < 10) that the error rate does not count.
        for i in 0..4 {
            assert_eq!(b.record(t0 + ms(i), Attempt::Failure), None);
        }
        assert_eq!(b.record(t0 + ms(4), OK), None);
        for i in 5..9 {
            assert_eq!(b.record(t0 + ms(i), Attempt::Failure), None);
        }
        assert_eq!(b.state(), BreakerState::Closed);
        let t = b.record(t0 + ms(9), Attempt::Failure).expect("the fifth in a row opens");
        assert_eq!(
            t,
            Transition { from: BreakerState::Closed, to: BreakerState::Open, reason: "5 consecutive failures".into() }
        );
        assert_eq!(b.reopens_at(), Some(t0 + ms(9) + secs(10)));
        b.check();
    }

    #[test]
    fn error_rate_opens_only_with_min_requests() {
        let t0 = Instant::now();
        let settings = BreakerConfig { consecutive_failures: 100, ..BreakerConfig::default() };
        let mut b = Breaker::new(settings.clone());
        // Failure, success, alternating: 50 % from the start, but only the
        // tenth outcome makes the window big enough.
        for i in 0..9 {
            let a = if i % 2 == 0 { Attempt::Failure } else { OK };
            assert_eq!(b.record(t0 + ms(i), a), None, "outcome {i}");
        }
        assert!((b.error_rate(t0 + ms(9)) - 5.0 / 9.0).abs() < 1e-9);
        // The tenth is a success: 5 of 10 = 50 % = the threshold.
        assert_eq!(
            to(b.record(t0 + ms(9), OK)),
            Some((BreakerState::Open, "error rate 50 % over 10 requests in 30 s".into()))
        );

        // Below the threshold it stays closed however many outcomes.
        let mut b = Breaker::new(settings);
        for i in 0..100 {
            let a = if i % 3 == 0 { Attempt::Failure } else { OK };
            assert_eq!(b.record(t0 + ms(i), a), None);
        }
        assert_eq!(b.state(), BreakerState::Closed);
    }

    #[test]
    fn slow_first_tokens_open() {
        let t0 = Instant::now();
        let settings = BreakerConfig { ttft_p95: Some(ms(1000)), ..BreakerConfig::default() };
        let mut b = Breaker::new(settings.clone());
        // 9 slow successes: not enough samples to judge.
        for i in 0..9 {
            assert_eq!(b.record(t0 + ms(i), Attempt::Success { ttft: ms(2300) }), None);
        }
        assert_eq!(b.ttft_p95(t0 + ms(9)), Some(ms(2300)));
        assert_eq!(
            to(b.record(t0 + ms(9), Attempt::Success { ttft: ms(2300) })),
            Some((BreakerState::Open, "p95 time to first token 2300 ms over 1000 ms".into()))
        );

        // 19 fast and one slow: the p95 is the 19th value, a fast one.
        let mut b = Breaker::new(settings);
        for i in 0..19 {
            assert_eq!(b.record(t0 + ms(i), Attempt::Success { ttft: ms(200 + i) }), None);
        }
        assert_eq!(b.record(t0 + ms(19), Attempt::Success { ttft: ms(5000) }), None);
        assert_eq!(b.ttft_p95(t0 + ms(19)), Some(ms(218)));
        // A second slow one makes it the p95.
        assert!(b.record(t0 + ms(20), Attempt::Success { ttft: ms(5000) }).is_some());
    }

    #[test]
    fn p95_is_nearest_rank() {
        assert_eq!(p95(vec![]), None);
        assert_eq!(p95(vec![ms(7)]), Some(ms(7)));
        let hundred: Vec<Duration> = (1..=100).rev().map(ms).collect();
        assert_eq!(p95(hundred), Some(ms(95)));
    }

    #[test]
    fn out_of_memory_opens_at_once() {
        let t0 = Instant::now();
        let mut b = breaker();
        b.record(t0, OK);
        assert_eq!(to(b.record(t0, Attempt::OutOfMemory)), Some((BreakerState::Open, "engine out of memory".into())));
    }

    #[test]
    fn old_failures_leave_the_window() {
        let t0 = Instant::now();
        let settings = BreakerConfig { consecutive_failures: 100, ..BreakerConfig::default() };
        let mut b = Breaker::new(settings);
        for i in 0..9 {
            b.record(t0 + ms(i), Attempt::Failure);
        }
        assert_eq!(b.error_rate(t0 + secs(29)), 1.0);
        // 31 s later those nine are forgotten: one more failure and nine
        // successes make 10 % over 10, not 18 over 19.
        let t1 = t0 + secs(31);
        assert_eq!(b.error_rate(t1), 0.0);
        assert_eq!(b.ttft_p95(t1), None);
        b.record(t1, Attempt::Failure);
        for i in 1..10 {
            assert_eq!(b.record(t1 + ms(i), OK), None);
        }
        assert!((b.error_rate(t1 + ms(10)) - 0.1).abs() < 1e-9);
        assert_eq!(b.window.len(), 10);
        b.check();
    }

    #[test]
    fn cool_down_half_opens_by_poll() {
        let t0 = Instant::now();
        let mut b = opened(t0);
        assert!(!b.try_trial(), "OPEN admits nothing");
        assert_eq!(b.poll(t0 + secs(9)), None);
        assert_eq!(to(b.poll(t0 + secs(10))), Some((BreakerState::HalfOpen, "cool-down of 10 s over".into())));
        assert_eq!(b.reopens_at(), None);
        assert_eq!(b.poll(t0 + secs(20)), None, "only OPEN half-opens");
    }

    #[test]
    fn probes_steer_the_cool_down() {
        let t0 = Instant::now();
        let mut b = opened(t0);
        // A good probe before the cool-down is over changes nothing.
        assert_eq!(b.probe(t0 + secs(5), true), None);
        // A failed one starts it again.
        assert_eq!(b.probe(t0 + secs(8), false), None);
        assert_eq!(b.reopens_at(), Some(t0 + secs(18)));
        assert_eq!(b.poll(t0 + secs(12)), None);
        assert_eq!(b.probe(t0 + secs(17), true), None);
        assert_eq!(
            to(b.probe(t0 + secs(18), true)),
            Some((BreakerState::HalfOpen, "cool-down of 10 s over, health probe up".into()))
        );
        // A failed probe while HALF_OPEN opens again.
        assert!(b.try_trial());
        assert_eq!(to(b.probe(t0 + secs(19), false)), Some((BreakerState::Open, "health probe failed".into())));
        assert_eq!(b.reopens_at(), Some(t0 + secs(29)));
        b.check();
    }

    #[test]
    fn failed_probes_count_as_consecutive_failures() {
        let t0 = Instant::now();
        let mut b = breaker();
        for i in 0..3 {
            b.record(t0 + ms(i), Attempt::Failure);
        }
        // A good probe does not reset the count.
        assert_eq!(b.probe(t0 + ms(3), true), None);
        assert_eq!(b.probe(t0 + ms(4), false), None);
        assert_eq!(
            to(b.probe(t0 + ms(5), false)),
            Some((BreakerState::Open, "5 consecutive failures, the last a health probe".into()))
        );
        // Probes are not requests: they are not in the window.
        assert_eq!(b.window.len(), 3);
    }

    #[test]
    fn half_open_admits_one_trial_at_a_time() {
        let t0 = Instant::now();
        let mut b = half_opened(t0);
        assert!(b.try_trial());
        assert!(!b.try_trial());
        assert!(!b.try_trial());
        b.end_trial();
        assert!(b.try_trial(), "an abandoned trial frees the place");
        assert!(!b.try_trial());
        b.check();
    }

    #[test]
    fn trial_success_closes_with_a_fresh_window() {
        let t0 = Instant::now();
        let mut b = half_opened(t0);
        assert!(b.try_trial());
        let t = b.record(t0 + secs(11), OK).unwrap();
        assert_eq!(
            (t.from, t.to, t.reason.as_str()),
            (BreakerState::HalfOpen, BreakerState::Closed, "trial request succeeded")
        );
        assert_eq!(b.error_rate(t0 + secs(11)), 0.0, "the failures that opened it are gone");
        assert!(b.try_trial() && b.try_trial(), "CLOSED admits everything");
        // The count of failures in a row starts again too.
        for i in 0..4 {
            assert_eq!(b.record(t0 + secs(12) + ms(i), Attempt::Failure), None);
        }
        b.check();
    }

    #[test]
    fn trial_failure_reopens_and_restarts_the_cool_down() {
        let t0 = Instant::now();
        let mut b = half_opened(t0);
        assert!(b.try_trial());
        let t1 = t0 + secs(13);
        assert_eq!(to(b.record(t1, Attempt::Failure)), Some((BreakerState::Open, "trial request failed".into())));
        assert_eq!(b.reopens_at(), Some(t1 + secs(10)));
        assert!(!b.try_trial());
        assert_eq!(b.poll(t1 + secs(9)), None);
        assert!(b.poll(t1 + secs(10)).is_some());
        assert!(b.try_trial());
        assert_eq!(
            to(b.record(t1 + secs(11), Attempt::OutOfMemory)),
            Some((BreakerState::Open, "trial request failed: engine out of memory".into()))
        );
        b.check();
    }

    #[test]
    fn late_outcomes_are_recorded_but_decide_nothing() {
        let t0 = Instant::now();
        let mut b = opened(t0);
        // Requests that were running when it opened.
        assert_eq!(b.record(t0 + secs(1), OK), None);
        assert_eq!(b.record(t0 + secs(2), Attempt::OutOfMemory), None);
        assert_eq!(b.state(), BreakerState::Open);
        assert_eq!(b.window.len(), 7);
        assert_eq!(b.reopens_at(), Some(t0 + secs(10)), "a late failure does not extend the cool-down");
        // HALF_OPEN with no trial out: a late success does not close it.
        b.poll(t0 + secs(10)).unwrap();
        assert_eq!(b.record(t0 + secs(11), OK), None);
        assert_eq!(b.state(), BreakerState::HalfOpen);
        assert!(b.try_trial());
    }

    #[test]
    fn window_memory_stays_bounded() {
        let t0 = Instant::now();
        let mut b = breaker();
        // A million outcomes at 100 per millisecond: all inside the 30 s
        // window, so only the cap holds them back.
        for i in 0..1_000_000u64 {
            let a = if i % 4 == 0 { Attempt::Failure } else { OK };
            b.record(t0 + Duration::from_micros(i * 10), a);
            assert!(b.window.len() <= WINDOW_CAP);
        }
        assert_eq!(b.window.len(), WINDOW_CAP);
        assert!((b.error_rate(t0 + secs(10)) - 0.25).abs() < 0.01);
        b.check();
    }

    #[derive(Debug, Clone)]
    enum Op {
        Advance(u64),
        Record(u8),
        Probe(bool),
        Poll,
        Trial,
        EndTrial,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (0u64..4000).prop_map(Op::Advance),
            (0u8..4).prop_map(Op::Record),
            any::<bool>().prop_map(Op::Probe),
            Just(Op::Poll),
            Just(Op::Trial),
            Just(Op::EndTrial),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        /// Whatever the order of calls: every transition starts where the
        /// breaker was and ends where it is, the state's fields agree with
        /// it, HALF_OPEN never has two trials out, and the window stays
        /// within its cap.
        #[test]
        fn invariants_hold_under_any_sequence(ops in proptest::collection::vec(op(), 1..300)) {
            let settings = BreakerConfig {
                consecutive_failures: 3,
                min_requests: 4,
                window: secs(5),
                ttft_p95: Some(ms(500)),
                cooldown: secs(2),
                ..BreakerConfig::default()
            };
            let mut b = Breaker::new(settings);
            let mut now = Instant::now();
            let mut trials_out = 0;
            for op in ops {
                let before = b.state();
                let t = match op {
                    Op::Advance(d) => { now += ms(d); None }
                    Op::Record(k) => {
                        let a = match k {
                            0 => Attempt::Failure,
                            1 => Attempt::OutOfMemory,
                            2 => Attempt::Success { ttft: ms(100) },
                            _ => Attempt::Success { ttft: ms(900) },
                        };
                        b.record(now, a)
                    }
                    Op::Probe(up) => b.probe(now, up),
                    Op::Poll => b.poll(now),
                    Op::Trial => {
                        let ok = b.try_trial();
                        prop_assert_eq!(ok, before != BreakerState::Open && (before == BreakerState::Closed || trials_out == 0));
                        if ok && before == BreakerState::HalfOpen { trials_out += 1; }
                        None
                    }
                    Op::EndTrial => { b.end_trial(); trials_out = 0; None }
                };
                if let Some(t) = t {
                    prop_assert_eq!(t.from, before);
                    prop_assert_eq!(t.to, b.state());
                    prop_assert_ne!(t.from, t.to);
                    prop_assert!(!t.reason.is_empty());
                    trials_out = 0;
                } else {
                    prop_assert_eq!(b.state(), before);
                }
                prop_assert!(trials_out <= 1);
                let r = b.error_rate(now);
                prop_assert!((0.0..=1.0).contains(&r));
                b.check();
            }
        }
    }
}
