//! The choice of instance: from a logical model's instances to the one a
//! task that may start now runs on.
//!
//! Owns: the pure decision over a view of each instance. Does not own: slot
//! accounting (the scheduler's policy builds the view and calls [`pick`] when
//! it grants a slot) or the instance state the view is made from (the
//! router's probes). Fallback to other models is a later extension of
//! [`pick`].

/// What the router needs to know about an instance.
#[derive(Debug, Clone, Copy)]
pub struct InstanceView {
    pub up: bool,
    pub running: usize,
    pub max_concurrency: usize,
}

impl InstanceView {
    pub fn has_free_slot(&self) -> bool {
        self.up && self.running < self.max_concurrency
    }
}

/// Picks the least-loaded healthy instance with a free slot among
/// `candidates` (indices into `instances`) that `eligible` accepts, or
/// `None`. Ties go to the earlier instance in the model's list, so the
/// configuration order expresses preference.
pub fn pick(candidates: &[usize], instances: &[InstanceView], eligible: impl Fn(usize) -> bool) -> Option<usize> {
    candidates.iter().copied().filter(|&i| instances[i].has_free_slot() && eligible(i)).min_by(|&a, &b| {
        let (ia, ib) = (&instances[a], &instances[b]);
        // Compare running/max without floats: a.r * b.m vs b.r * a.m.
        (ia.running * ib.max_concurrency).cmp(&(ib.running * ia.max_concurrency))
    })
}

/// Whether any candidate is healthy (a task may wait for it).
pub fn any_up(candidates: &[usize], instances: &[InstanceView]) -> bool {
    candidates.iter().any(|&i| instances[i].up)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v(up: bool, running: usize, max: usize) -> InstanceView {
        InstanceView { up, running, max_concurrency: max }
    }

    #[test]
    fn least_loaded_healthy_instance_wins() {
        let inst = [v(true, 1, 2), v(true, 0, 2), v(false, 0, 4), v(true, 2, 2)];
        assert_eq!(pick(&[0, 1, 2, 3], &inst, |_| true), Some(1));
        assert_eq!(pick(&[0, 1, 2, 3], &inst, |i| i != 1), Some(0));
        assert_eq!(pick(&[0, 3], &inst, |_| true), Some(0));
        assert_eq!(pick(&[2, 3], &inst, |_| true), None);
        assert!(!any_up(&[2], &inst));
    }
}
