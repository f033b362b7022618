//! The choice of instance: from the instances a task may use to the one it
//! runs on, and which factor decided.
//!
//! Owns: the pure decision over a view of each instance. Does not own: slot
//! accounting and which instances a task may use at all (the scheduler's
//! policy builds the views and the candidate list of each step of the
//! fallback chain, then calls [`pick`] when it grants a slot) or the
//! instance state the views are made from (the router's probes, breakers
//! and the engines' own reports).

use crate::task::Location;

/// What the router needs to know about an instance.
#[derive(Debug, Clone, Copy)]
pub struct InstanceView {
    /// Healthy, in dispatch, and its breaker is not open.
    pub up: bool,
    pub running: usize,
    pub max_concurrency: usize,
    /// Its breaker lets one trial request through: only while it runs none.
    pub half_open: bool,
    /// KV-cache usage the engine last reported (0..=1).
    pub kv_cache_usage: Option<f64>,
    /// The model is in the engine's memory (by its own report, or because
    /// edgeway ran it there): no load time before the first token.
    pub loaded: bool,
    /// Failure ratio of recent attempts (0..=1).
    pub error_rate: f64,
    /// p95 time to first token of recent attempts, in ms.
    pub ttft_p95_ms: Option<u64>,
    /// Configured cost of a thousand tokens.
    pub cost: f64,
    pub location: Location,
}

impl InstanceView {
    pub fn has_free_slot(&self) -> bool {
        self.up && self.running < self.max_concurrency && (!self.half_open || self.running == 0)
    }
}

impl Default for InstanceView {
    fn default() -> Self {
        InstanceView {
            up: true,
            running: 0,
            max_concurrency: 1,
            half_open: false,
            kv_cache_usage: None,
            loaded: true,
            error_rate: 0.0,
            ttft_p95_ms: None,
            cost: 0.0,
            location: Location::Local,
        }
    }
}

/// The factors that rank instances with a free slot, in the order they are
/// compared; the first one in which the winner beats the runner-up is the
/// one that decided (recorded with the task's route). A half-open instance
/// comes first: its one trial request is how it comes back (at low load
/// its recent errors would otherwise keep it last for the whole window);
/// a trial that fails before its first token is retried elsewhere.
pub const FACTORS: [&str; 8] = ["trial", "load", "kv-cache", "loaded", "error-rate", "ttft", "cost", "config-order"];

/// An instance's rank on each factor, smaller is better. Measured values
/// are bucketed so that noise does not decide: load as a ratio, KV usage
/// and error rate in steps of 5 %, TTFT in steps of 50 ms.
fn ranks(v: &InstanceView, position: usize) -> [u64; 8] {
    // running/max as a fraction with a common denominator (slot counts are
    // small), so equal ratios rank equal without floats.
    let load = (v.running as u64 * 720_720) / v.max_concurrency.max(1) as u64;
    let kv = v.kv_cache_usage.map_or(0, |u| (u.clamp(0.0, 1.0) * 20.0) as u64);
    let err = (v.error_rate.clamp(0.0, 1.0) * 20.0) as u64;
    let ttft = v.ttft_p95_ms.map_or(0, |ms| ms / 50);
    let cost = (v.cost.max(0.0) * 1000.0) as u64;
    [u64::from(!v.half_open), load, kv, u64::from(!v.loaded), err, ttft, cost, position as u64]
}

/// Picks the best healthy instance with a free slot among `candidates`
/// (indices into `instances`) that `eligible` accepts, or `None`, with the
/// factor that decided (`"only-candidate"` when there was no other).
/// Candidates come in preference order (the configuration's), which breaks
/// the last ties.
pub fn pick(
    candidates: &[usize],
    instances: &[InstanceView],
    eligible: impl Fn(usize) -> bool,
) -> Option<(usize, &'static str)> {
    let mut best: Option<(usize, [u64; 8])> = None;
    let mut second: Option<[u64; 8]> = None;
    for (pos, &i) in candidates.iter().enumerate() {
        if !(instances[i].has_free_slot() && eligible(i)) {
            continue;
        }
        let r = ranks(&instances[i], pos);
        match &best {
            Some((_, b)) if r >= *b => {
                if second.is_none_or(|s| r < s) {
                    second = Some(r);
                }
            }
            _ => {
                second = best.map(|(_, b)| b);
                best = Some((i, r));
            }
        }
    }
    let (i, b) = best?;
    let decided = match second {
        None => "only-candidate",
        Some(s) => FACTORS[(0..FACTORS.len()).find(|&k| b[k] != s[k]).unwrap_or(FACTORS.len() - 1)],
    };
    Some((i, decided))
}

/// Whether `a` may take a session's turn in place of the pick `b` (the
/// scheduler's KV-cache affinity): no busier, and no worse on the factors
/// that are not about load: the model loaded, the error rate (in its 5 %
/// steps), the cost, and the same location. Affinity saves prompt
/// processing; it never buys it with a cold model, a failing instance or
/// a dearer, remote one (review 14 M3).
pub fn may_stand_in(a: &InstanceView, b: &InstanceView) -> bool {
    let (ra, rb) = (ranks(a, 0), ranks(b, 0));
    ra[1] <= rb[1] && ra[3] <= rb[3] && ra[4] <= rb[4] && ra[6] <= rb[6] && a.location == b.location
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stand_in_is_no_busier_colder_worse_dearer_or_elsewhere() {
        let b = v(true, 1, 2);
        assert!(may_stand_in(&v(true, 1, 2), &b));
        assert!(may_stand_in(&v(true, 0, 2), &b));
        assert!(!may_stand_in(&v(true, 2, 2), &b), "busier");
        assert!(!may_stand_in(&InstanceView { loaded: false, ..v(true, 0, 2) }, &b), "model not loaded");
        assert!(!may_stand_in(&InstanceView { error_rate: 0.5, ..v(true, 0, 2) }, &b), "failing");
        assert!(!may_stand_in(&InstanceView { cost: 1.0, ..v(true, 0, 2) }, &b), "dearer");
        assert!(!may_stand_in(&InstanceView { location: Location::Cloud, ..v(true, 0, 2) }, &b), "elsewhere");
    }

    fn v(up: bool, running: usize, max: usize) -> InstanceView {
        InstanceView { up, running, max_concurrency: max, ..InstanceView::default() }
    }

    #[test]
    fn least_loaded_healthy_instance_wins() {
        let inst = [v(true, 1, 2), v(true, 0, 2), v(false, 0, 4), v(true, 2, 2)];
        assert_eq!(pick(&[0, 1, 2, 3], &inst, |_| true), Some((1, "load")));
        assert_eq!(pick(&[0, 1, 2, 3], &inst, |i| i != 1), Some((0, "only-candidate")));
        assert_eq!(pick(&[0, 3], &inst, |_| true), Some((0, "only-candidate")));
        assert_eq!(pick(&[2, 3], &inst, |_| true), None);
    }

    #[test]
    fn each_factor_decides_in_its_turn_and_is_named() {
        let base = v(true, 0, 2);
        let with = |f: &dyn Fn(&mut InstanceView)| {
            let mut x = base;
            f(&mut x);
            x
        };
        let cases: [(InstanceView, &str); 5] = [
            (with(&|x| x.kv_cache_usage = Some(0.5)), "kv-cache"),
            (with(&|x| x.loaded = false), "loaded"),
            (with(&|x| x.error_rate = 0.3), "error-rate"),
            (with(&|x| x.ttft_p95_ms = Some(400)), "ttft"),
            (with(&|x| x.cost = 0.2), "cost"),
        ];
        for (worse, factor) in cases {
            // The better instance wins whichever comes first in the list.
            assert_eq!(pick(&[0, 1], &[worse, base], |_| true), Some((1, factor)));
            assert_eq!(pick(&[1, 0], &[worse, base], |_| true), Some((1, factor)));
        }
        // Equal in everything: the configuration's order.
        assert_eq!(pick(&[1, 0], &[base, base], |_| true), Some((1, "config-order")));
        // Load comes before cost: a cheap busy instance loses to an idle one.
        let cheap_busy = InstanceView { running: 1, cost: 0.0, ..base };
        let dear_idle = InstanceView { cost: 5.0, ..base };
        assert_eq!(pick(&[0, 1], &[cheap_busy, dear_idle], |_| true), Some((1, "load")));
        // Small differences of a measured value do not decide.
        let a = InstanceView { error_rate: 0.01, ttft_p95_ms: Some(110), ..base };
        let b = InstanceView { ttft_p95_ms: Some(100), ..base };
        assert_eq!(pick(&[0, 1], &[a, b], |_| true), Some((0, "config-order")));
    }

    #[test]
    fn a_half_open_instance_takes_one_trial_at_a_time_and_gets_it_first() {
        let idle = InstanceView { half_open: true, error_rate: 0.6, ..v(true, 0, 4) };
        let busy = InstanceView { half_open: true, ..v(true, 1, 4) };
        assert_eq!(pick(&[0], &[idle], |_| true).map(|p| p.0), Some(0));
        assert_eq!(pick(&[0], &[busy], |_| true), None);
        // Its recent errors do not keep it from its trial.
        assert_eq!(pick(&[1, 0], &[idle, v(true, 0, 4)], |_| true), Some((0, "trial")));
    }
}
