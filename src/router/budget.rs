//! The global retry budget, so that an outage never becomes a retry storm:
//! retries may be at most `ratio` of first attempts over a sliding window,
//! plus a small floor per window so that a quiet gateway can still retry.
//!
//! Owns: counting first attempts and retries in time buckets (a fixed ring,
//! so memory does not grow with the request rate) and the yes or no for
//! each retry. Does not own: whether an attempt may be retried at all (the
//! router's dispatch decides that, then asks here), backoff between
//! attempts, or metrics (the caller reads [`RetryBudget::usage`]).
//!
//! Pure apart from its lock: no I/O, no clock of its own (time is passed
//! in).

use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::config::RetryBudgetConfig;

/// Buckets in the ring: the window is counted in steps of `window / 60`.
const BUCKETS: usize = 60;

/// The counts of one time slice of `window / BUCKETS`.
#[derive(Debug, Clone, Copy, Default)]
struct Bucket {
    /// Which slice since `Ring::base` the counts belong to; a bucket whose
    /// slice is older than the window is stale and is reset before reuse.
    slice: u64,
    requests: u64,
    retries: u64,
}

#[derive(Debug)]
struct Ring {
    /// The time of the first call: slices are counted from it.
    base: Option<Instant>,
    /// The newest slice seen. Callers on other threads may pass a `now`
    /// that is a little older than one already seen; counting it in the
    /// newest slice keeps the ring from resetting a live bucket.
    latest: u64,
    buckets: [Bucket; BUCKETS],
}

/// Thread-safe: methods take `&self` and hold the lock only for a few
/// dozen additions.
#[derive(Debug)]
pub struct RetryBudget {
    settings: RetryBudgetConfig,
    /// Width of one slice, at least a nanosecond.
    slice_width: Duration,
    ring: Mutex<Ring>,
}

impl RetryBudget {
    pub fn new(settings: RetryBudgetConfig) -> Self {
        let slice_width = (settings.window / BUCKETS as u32).max(Duration::from_nanos(1));
        RetryBudget {
            settings,
            slice_width,
            ring: Mutex::new(Ring { base: None, latest: 0, buckets: [Bucket::default(); BUCKETS] }),
        }
    }

    /// Counts one first attempt of a request.
    pub fn on_request(&self, now: Instant) {
        let mut ring = self.lock();
        let slice = ring.slice(now, self.slice_width);
        ring.bucket(slice).requests += 1;
    }

    /// Takes one retry from the budget if allowed: retries in the window
    /// stay below `min_per_window + ratio * first attempts in the window`.
    /// Returns false, and counts nothing, when the budget is spent.
    pub fn try_retry(&self, now: Instant) -> bool {
        let mut ring = self.lock();
        let slice = ring.slice(now, self.slice_width);
        let (requests, retries) = ring.sums(slice);
        if retries >= self.allowed(requests) {
            return false;
        }
        ring.bucket(slice).retries += 1;
        true
    }

    /// (first attempts, retries) in the window at `now`, for metrics and
    /// tests. The window is the slice `now` falls in and the 59 before it,
    /// so it spans between 59/60 of `window` and all of it.
    pub fn usage(&self, now: Instant) -> (u64, u64) {
        let mut ring = self.lock();
        let slice = ring.slice(now, self.slice_width);
        ring.sums(slice)
    }

    /// Retries allowed in a window with `requests` first attempts. The
    /// ratio's share is rounded down, with a little slack for floating
    /// point (0.29 * 100 is 28.999...96 in an f64 and should allow 29).
    fn allowed(&self, requests: u64) -> u64 {
        let share = (self.settings.ratio * requests as f64 + 1e-9).floor();
        // `as` saturates: a negative or NaN ratio gives no share.
        u64::from(self.settings.min_per_window) + share as u64
    }

    /// The counts are plain numbers that no panic can leave half-updated,
    /// so a poisoned lock is still good to use.
    fn lock(&self) -> MutexGuard<'_, Ring> {
        self.ring.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Ring {
    /// The slice `now` falls in (never older than the newest seen).
    fn slice(&mut self, now: Instant, width: Duration) -> u64 {
        let base = *self.base.get_or_insert(now);
        let n = (now.saturating_duration_since(base).as_nanos() / width.as_nanos()) as u64;
        self.latest = self.latest.max(n);
        self.latest
    }

    /// The bucket of `slice`, reset first if it held an older slice.
    fn bucket(&mut self, slice: u64) -> &mut Bucket {
        let b = &mut self.buckets[(slice % BUCKETS as u64) as usize];
        if b.slice != slice {
            *b = Bucket { slice, requests: 0, retries: 0 };
        }
        b
    }

    /// (requests, retries) over `slice` and the BUCKETS - 1 before it.
    fn sums(&self, slice: u64) -> (u64, u64) {
        self.buckets
            .iter()
            .filter(|b| b.slice <= slice && b.slice + BUCKETS as u64 > slice)
            .fold((0, 0), |(req, ret), b| (req + b.requests, ret + b.retries))
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::Arc;

    use super::*;

    fn secs(n: u64) -> Duration {
        Duration::from_secs(n)
    }

    fn budget() -> RetryBudget {
        RetryBudget::new(RetryBudgetConfig::default())
    }

    /// Takes retries at `now` until refused; returns how many were given.
    fn drain(b: &RetryBudget, now: Instant) -> u64 {
        let mut n = 0;
        while b.try_retry(now) {
            n += 1;
            assert!(n <= 1_000_000, "the budget never ran out");
        }
        n
    }

    #[test]
    fn ten_percent_of_requests_plus_the_floor() {
        let t0 = Instant::now();
        let b = budget();
        for i in 0..100 {
            b.on_request(t0 + Duration::from_millis(i));
        }
        let now = t0 + secs(1);
        for _ in 0..13 {
            assert!(b.try_retry(now));
        }
        assert!(!b.try_retry(now), "100 requests * 0.1 + 3 = 13 retries");
        assert!(!b.try_retry(now));
        assert_eq!(b.usage(now), (100, 13), "a refused retry counts nothing");
        // Ten more requests make room for exactly one more retry.
        for _ in 0..10 {
            b.on_request(now);
        }
        assert_eq!(drain(&b, now), 1);
    }

    #[test]
    fn a_quiet_gateway_can_still_retry() {
        let t0 = Instant::now();
        let b = budget();
        assert_eq!(drain(&b, t0), 3);
        assert_eq!(b.usage(t0), (0, 3));
    }

    #[test]
    fn the_budget_refills_as_the_window_slides() {
        let t0 = Instant::now();
        let b = budget();
        for _ in 0..100 {
            b.on_request(t0);
        }
        assert_eq!(drain(&b, t0), 13);
        // Half a window later the old counts still hold.
        let t1 = t0 + secs(30);
        for _ in 0..50 {
            b.on_request(t1);
        }
        assert_eq!(drain(&b, t1), 5, "150 requests allow 18, 13 are taken");
        // A window after t0 only what happened at t1 counts.
        let t2 = t0 + secs(60);
        assert_eq!(b.usage(t2), (50, 5));
        assert_eq!(drain(&b, t2), 3, "50 * 0.1 + 3 = 8, 5 are taken");
        // A window after t1 everything is forgotten.
        let t3 = t1 + secs(60);
        assert_eq!(b.usage(t3), (0, 3), "the three just taken are in the slice of t2");
        assert_eq!(b.usage(t3 + secs(60)), (0, 0));
        assert_eq!(drain(&b, t3 + secs(60)), 3);
    }

    #[test]
    fn ratio_rounds_down_without_float_surprises() {
        let t0 = Instant::now();
        let b = RetryBudget::new(RetryBudgetConfig { ratio: 0.29, min_per_window: 0, ..Default::default() });
        for _ in 0..100 {
            b.on_request(t0);
        }
        assert_eq!(drain(&b, t0), 29);
        for _ in 0..3 {
            b.on_request(t0);
        }
        assert_eq!(drain(&b, t0), 0, "103 * 0.29 = 29.87, still 29");
        let none = RetryBudget::new(RetryBudgetConfig { ratio: 0.0, min_per_window: 0, ..Default::default() });
        none.on_request(t0);
        assert!(!none.try_retry(t0));
    }

    #[test]
    fn a_slightly_older_now_counts_in_the_newest_slice() {
        let t0 = Instant::now();
        let b = budget();
        b.on_request(t0 + secs(10));
        // Another thread read its clock a moment earlier.
        b.on_request(t0 + secs(9));
        assert_eq!(b.usage(t0 + secs(10)), (2, 0));
    }

    #[test]
    fn memory_stays_bounded_at_any_rate() {
        let t0 = Instant::now();
        let b = budget();
        // A million requests at 10 000 a second for 100 s.
        for i in 0..1_000_000u64 {
            let now = t0 + Duration::from_micros(i * 100);
            b.on_request(now);
            if i % 1000 == 0 {
                b.try_retry(now);
            }
        }
        // The last request is in slice 99: slices 40..=99 are the window,
        // 600 000 requests and one retry in every 1000 of them.
        let end = t0 + Duration::from_micros(999_999 * 100);
        assert_eq!(b.usage(end), (600_000, 600));
        assert_eq!(b.lock().buckets.len(), BUCKETS);
        assert!(std::mem::size_of::<RetryBudget>() < 4096);
    }

    #[test]
    fn concurrent_retries_never_overdraw() {
        let t0 = Instant::now();
        let b = Arc::new(budget());
        for _ in 0..100 {
            b.on_request(t0);
        }
        let granted = Arc::new(AtomicU64::new(0));
        let threads: Vec<_> = (0..8)
            .map(|_| {
                let (b, granted) = (b.clone(), granted.clone());
                std::thread::spawn(move || {
                    for _ in 0..10 {
                        if b.try_retry(t0) {
                            granted.fetch_add(1, Ordering::SeqCst);
                        }
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(granted.load(Ordering::SeqCst), 13);
    }
}
