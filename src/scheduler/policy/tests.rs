//! Unit and property tests of the policy on a simulated clock.

use super::*;
use proptest::prelude::*;

fn cfg(slots: usize, reserved: usize, capacity: usize) -> PolicyConfig {
    PolicyConfig {
        models: vec![ModelPolicy {
            residency: Default::default(),
            name: "m".into(),
            queue_capacity: capacity,
            max_running: None,
            instances: vec![0],
            kv_bytes_per_token: 0,
            weights_bytes: 0,
            memory_margin: 0.0,
            fallback_models: Vec::new(),
            canned: false,
            context_tokens: 100_000,
            max_output_tokens: 10_000,
        }],
        instances: vec![InstancePolicy {
            name: "i".into(),
            max_concurrency: slots,
            reserved_realtime_slots: reserved,
            memory_budget_bytes: None,
            location: Location::Local,
            max_data_class: DataClass::Secret,
            cost: 0.0,
            max_prefill_tokens: None,
            long_prompt_tokens: 0,
            slot_affinity: false,
        }],
        apps: HashMap::new(),
        tenant_weights: HashMap::new(),
        max_queued: None,
        max_running: None,
        aging: None,
        backpressure: Backpressure {
            refuse_p4: 2.0,
            shorten_low_waits: 2.0,
            cap_output: 2.0,
            refuse_p3: 2.0,
            capped_output_tokens: 64,
        },
        busy_retry_after_ms: 1000,
        kv_cache_high_water: 0.95,
        allow_cloud: false,
        preemption: false,
        admit_at_level: [Priority::P4, Priority::P2],
        max_tracked_users: 100_000,
    }
}

fn task(id: &str, p: Priority, app: &str) -> TaskInfo {
    TaskInfo {
        task_id: id.into(),
        model: 0,
        requested: 0,
        priority: p,
        tenant: "t".into(),
        app: app.into(),
        user: "u".into(),
        input_tokens: 10,
        max_output_tokens: 100,
        class: DataClass::Personal,
        allow_smaller: false,
        affinity: None,
        forwarded: false,
    }
}

const T0: Duration = Duration::ZERO;

fn drain(p: &mut Policy, now: Duration) -> Vec<String> {
    std::iter::from_fn(|| p.next_grant(now)).map(|g| g.task_id).collect()
}

#[test]
fn priority_then_arrival() {
    let mut p = Policy::new(cfg(1, 0, 10));
    p.enqueue(task("blocker", Priority::P2, "a"), T0).unwrap();
    assert_eq!(drain(&mut p, T0), ["blocker"]);
    for (id, prio) in [("p4", Priority::P4), ("p2a", Priority::P2), ("p0", Priority::P0), ("p2b", Priority::P2)] {
        p.enqueue(task(id, prio, "a"), T0).unwrap();
    }
    assert_eq!(p.position("p0", T0), Some(0));
    assert_eq!(p.position("p4", T0), Some(3));
    let mut all = p.positions(T0);
    all.sort();
    assert_eq!(all, [("p0", 0), ("p2a", 1), ("p2b", 2), ("p4", 3)]);
    let mut order = Vec::new();
    let mut running = "blocker".to_string();
    for _ in 0..4 {
        p.release(&running, 0);
        running = p.next_grant(T0).unwrap().task_id;
        order.push(running.clone());
    }
    assert_eq!(order, ["p0", "p2a", "p2b", "p4"]);
}

#[test]
fn reserved_slots_are_kept_for_p0_and_p1() {
    let mut p = Policy::new(cfg(3, 1, 10));
    for i in 0..3 {
        p.enqueue(task(&format!("batch{i}"), Priority::P4, "a"), T0).unwrap();
    }
    assert_eq!(drain(&mut p, T0).len(), 2, "one slot stays free");
    p.enqueue(task("alarm", Priority::P0, "a"), T0).unwrap();
    assert_eq!(drain(&mut p, T0), ["alarm"]);
    p.check();
}

#[test]
fn equal_weights_share_slots_equally_and_weights_shift_the_share() {
    for (wa, wb, want_a) in [(1.0, 1.0, 50), (2.0, 1.0, 66)] {
        let mut c = cfg(1, 0, 1000);
        c.apps.insert("a".into(), AppLimits { weight: wa, ..AppLimits::default() });
        c.apps.insert("b".into(), AppLimits { weight: wb, ..AppLimits::default() });
        let mut p = Policy::new(c);
        // a floods first, b arrives after: fairness must not be FIFO.
        for i in 0..200 {
            p.enqueue(task(&format!("a{i}"), Priority::P3, "a"), T0).unwrap();
        }
        for i in 0..200 {
            p.enqueue(task(&format!("b{i}"), Priority::P3, "b"), T0).unwrap();
        }
        let mut a = 0;
        for _ in 0..150 {
            let g = p.next_grant(T0).unwrap();
            if g.task_id.starts_with('a') {
                a += 1;
            }
            p.release(&g.task_id, 0);
        }
        let share = a * 100 / 150;
        assert!((want_a - 2..=want_a + 2).contains(&share), "a got {share}% with weights {wa}:{wb}");
    }
}

#[test]
fn aging_lifts_a_waiting_task_to_p1_but_not_p0() {
    let mut c = cfg(1, 0, 100);
    c.aging = Some(Duration::from_secs(10));
    let mut p = Policy::new(c);
    p.enqueue(task("blocker", Priority::P2, "a"), T0).unwrap();
    drain(&mut p, T0);
    p.enqueue(task("old", Priority::P4, "a"), T0).unwrap();
    let t = Duration::from_secs(100);
    p.enqueue(task("new-p2", Priority::P2, "a"), t).unwrap();
    p.enqueue(task("new-p0", Priority::P0, "a"), t).unwrap();
    p.release("blocker", 0);
    assert_eq!(drain(&mut p, t), ["new-p0"], "P0 still first");
    p.release("new-p0", 0);
    assert_eq!(drain(&mut p, t), ["old"], "aged to P1, ahead of P2");
}

#[test]
fn rates_answer_with_their_own_codes_and_retry_times() {
    let mut c = cfg(10, 0, 100);
    c.apps.insert(
        "a".into(),
        AppLimits { user_requests_per_minute: Some(2), user_tokens_per_minute: Some(500), ..AppLimits::default() },
    );
    let mut p = Policy::new(c);
    p.enqueue(task("1", Priority::P2, "a"), T0).unwrap();
    p.enqueue(task("2", Priority::P2, "a"), T0).unwrap();
    let e = p.enqueue(task("3", Priority::P2, "a"), T0).unwrap_err();
    assert_eq!(e.code, ErrorCode::RateLimited);
    assert_eq!(e.retry_after_ms, Some(30_000));
    // After 30 s one request is allowed again, but 220 tokens are spent of
    // 500 (+250 refilled): 5 tokens too few for a 110-token request? No:
    // 500 - 220 + 250 = 530 ≥ 110.
    p.enqueue(task("4", Priority::P2, "a"), Duration::from_secs(30)).unwrap();
    let mut big = task("5", Priority::P2, "a");
    big.max_output_tokens = 2000;
    let t = Duration::from_secs(90);
    let e = p.enqueue(big, t).unwrap_err();
    assert_eq!(e.code, ErrorCode::QuotaExceeded);
    assert!(e.retry_after_ms.unwrap() > 0);
    // Other users have their own budget.
    let mut other = task("6", Priority::P2, "a");
    other.user = "v".into();
    p.enqueue(other, t).unwrap();
    // A task another node forwarded here was charged there.
    let w = |id: &str| TaskInfo { user: "w".into(), ..task(id, Priority::P2, "a") };
    p.enqueue(w("7"), t).unwrap();
    p.enqueue(w("8"), t).unwrap();
    assert_eq!(p.enqueue(w("9"), t).unwrap_err().code, ErrorCode::RateLimited);
    p.enqueue(TaskInfo { forwarded: true, ..w("10") }, t).unwrap();
}

#[test]
fn queue_caps_per_application_and_user() {
    let mut c = cfg(1, 0, 100);
    c.apps.insert("a".into(), AppLimits { max_queued: Some(2), user_max_queued: Some(1), ..AppLimits::default() });
    let mut p = Policy::new(c);
    p.enqueue(task("run", Priority::P2, "a"), T0).unwrap();
    drain(&mut p, T0);
    p.enqueue(task("q1", Priority::P2, "a"), T0).unwrap();
    assert_eq!(p.enqueue(task("q2", Priority::P2, "a"), T0).unwrap_err().code, ErrorCode::QueueFull);
    let mut v = task("q3", Priority::P2, "a");
    v.user = "v".into();
    p.enqueue(v, T0).unwrap();
    let mut w = task("q4", Priority::P2, "a");
    w.user = "w".into();
    assert_eq!(p.enqueue(w, T0).unwrap_err().code, ErrorCode::QueueFull, "application cap");
}

#[test]
fn the_platforms_own_user_is_held_to_the_application_limits_only() {
    // Review 15 M2: every summary of an application runs as one user; with
    // per-user limits they starved each other.
    let mut c = cfg(4, 0, 100);
    let limits = AppLimits {
        max_queued: Some(2),
        user_max_queued: Some(1),
        user_max_running: Some(1),
        user_requests_per_minute: Some(1),
        user_tokens_per_minute: Some(150),
        ..AppLimits::default()
    };
    c.apps.insert("a".into(), limits);
    let mut p = Policy::new(c);
    let summary = |id: &str| TaskInfo { user: "edgeway:summary".into(), ..task(id, Priority::P2, "a") };
    p.enqueue(summary("s1"), T0).unwrap();
    p.enqueue(summary("s2"), T0).unwrap();
    assert_eq!(drain(&mut p, T0), ["s1", "s2"], "both run at once");
    p.enqueue(summary("s3"), T0).unwrap();
    p.enqueue(summary("s4"), T0).unwrap();
    // The application's own cap still counts them.
    assert_eq!(p.enqueue(summary("s5"), T0).unwrap_err().code, ErrorCode::QueueFull);
    // A caller's user keeps its limits.
    let mut p = Policy::new({
        let mut c = cfg(4, 0, 100);
        c.apps.insert("a".into(), AppLimits { user_requests_per_minute: Some(1), ..AppLimits::default() });
        c
    });
    p.enqueue(task("u1", Priority::P2, "a"), T0).unwrap();
    assert_eq!(p.enqueue(task("u2", Priority::P2, "a"), T0).unwrap_err().code, ErrorCode::RateLimited);
}

#[test]
fn backpressure_ladder() {
    let mut c = cfg(1, 0, 20);
    c.backpressure = Backpressure::default();
    let mut p = Policy::new(c);
    p.enqueue(task("run", Priority::P2, "a"), T0).unwrap();
    drain(&mut p, T0);
    let mut n = 0;
    let mut add = |p: &mut Policy, prio| {
        n += 1;
        p.enqueue(task(&format!("t{n}"), prio, "a"), T0)
    };
    for _ in 0..10 {
        add(&mut p, Priority::P2).unwrap();
    }
    // 50 % full: P4 refused, P3 still taken.
    assert_eq!(add(&mut p, Priority::P4).unwrap_err().code, ErrorCode::QueueFull);
    assert!(add(&mut p, Priority::P3).unwrap().queue_wait_factor.is_none());
    for _ in 0..2 {
        add(&mut p, Priority::P2).unwrap();
    }
    // 65 %: low-priority waits shortened.
    assert_eq!(add(&mut p, Priority::P3).unwrap().queue_wait_factor, Some(0.25));
    for _ in 0..2 {
        add(&mut p, Priority::P2).unwrap();
    }
    // 80 %: output capped (degraded).
    let a = add(&mut p, Priority::P2).unwrap();
    assert_eq!(a.max_output_tokens, 100, "under the cap already");
    let mut big = task("big", Priority::P2, "a");
    big.max_output_tokens = 1000;
    let a = p.enqueue(big, T0).unwrap();
    assert_eq!(a.max_output_tokens, 128);
    assert!(a.degrade_reason.is_some());
    // 90 %: P3 deferred too; P1 still queues.
    assert_eq!(add(&mut p, Priority::P3).unwrap_err().code, ErrorCode::QueueFull);
    add(&mut p, Priority::P1).unwrap();
    add(&mut p, Priority::P1).unwrap();
    // Full: busy for all but P0, which gets a tenth more room.
    assert_eq!(add(&mut p, Priority::P1).unwrap_err().code, ErrorCode::QueueFull);
    add(&mut p, Priority::P0).unwrap();
    p.check();
}

#[test]
fn memory_budget_shrinks_or_refuses_and_limits_concurrency() {
    let mut c = cfg(4, 0, 100);
    c.models[0].kv_bytes_per_token = 1000;
    c.instances[0].memory_budget_bytes = Some(300_000);
    let mut p = Policy::new(c);
    let mut huge = task("huge", Priority::P2, "a");
    huge.input_tokens = 400;
    assert_eq!(p.enqueue(huge, T0).unwrap_err().code, ErrorCode::ResourceExhausted);
    let mut long = task("long", Priority::P2, "a");
    long.max_output_tokens = 1000;
    let a = p.enqueue(long, T0).unwrap();
    assert_eq!(a.max_output_tokens, 290);
    assert!(a.degrade_reason.unwrap().contains("memory"));
    for i in 0..3 {
        p.enqueue(task(&format!("s{i}"), Priority::P2, "a"), T0).unwrap();
    }
    // long takes 300 kB: nothing else fits until it ends.
    assert_eq!(drain(&mut p, T0), ["long"]);
    p.release("long", 10);
    assert_eq!(drain(&mut p, T0).len(), 2, "110 kB each: two fit in 300 kB");
    p.check();
}

#[test]
fn unhealthy_models_and_danger_refuse_at_once() {
    let mut p = Policy::new(cfg(1, 0, 10));
    p.set_instance_up(0, false);
    assert_eq!(p.enqueue(task("a", Priority::P2, "a"), T0).unwrap_err().code, ErrorCode::ModelUnavailable);
    p.set_instance_up(0, true);
    p.set_danger(Some("GPU at 95 °C".into()));
    let e = p.enqueue(task("b", Priority::P0, "a"), T0).unwrap_err();
    assert_eq!(e.code, ErrorCode::ResourceExhausted);
    assert!(e.message.contains("95"));
}

#[test]
fn a_paused_instance_queues_new_work_but_dispatches_none() {
    let mut p = Policy::new(cfg(1, 0, 10));
    p.set_instance_paused(0, true);
    p.enqueue(task("a", Priority::P0, "a"), T0).unwrap();
    assert!(drain(&mut p, T0).is_empty());
    p.set_instance_paused(0, false);
    assert_eq!(drain(&mut p, T0), ["a"]);
    p.check();
}

#[test]
fn a_full_kv_cache_holds_new_work_while_ours_runs_there() {
    let mut p = Policy::new(cfg(4, 0, 10));
    p.enqueue(task("first", Priority::P2, "a"), T0).unwrap();
    assert_eq!(drain(&mut p, T0), ["first"]);
    p.set_kv_cache_usage(0, Some(0.95));
    assert!(p.kv_cache_full(0), "the high-water mark itself is full");
    // Free slots, but the engine says its KV cache is full: even P0 waits.
    p.enqueue(task("alarm", Priority::P0, "a"), T0).unwrap();
    p.enqueue(task("chat", Priority::P2, "a"), T0).unwrap();
    assert!(drain(&mut p, T0).is_empty());
    assert_eq!(p.waiting(0), 2);
    p.set_kv_cache_usage(0, Some(0.9499));
    assert!(!p.kv_cache_full(0));
    assert_eq!(drain(&mut p, T0), ["alarm", "chat"], "room again: in priority order");
    p.check();
}

#[test]
fn a_full_kv_cache_never_blocks_an_instance_that_runs_none_of_ours() {
    let mut p = Policy::new(cfg(4, 0, 10));
    // Other clients filled the engine, or the reading is stale: one task
    // still goes, so the queue cannot wait for ever on a reading.
    p.set_kv_cache_usage(0, Some(1.0));
    for id in ["a", "b"] {
        p.enqueue(task(id, Priority::P2, "a"), T0).unwrap();
    }
    assert_eq!(drain(&mut p, T0), ["a"]);
    p.release("a", 10);
    assert_eq!(drain(&mut p, T0), ["b"]);
    p.enqueue(task("c", Priority::P2, "a"), T0).unwrap();
    assert!(drain(&mut p, T0).is_empty());
    // No reading at all (an engine without /metrics): no limit.
    p.set_kv_cache_usage(0, None);
    assert_eq!(drain(&mut p, T0), ["c"]);
    p.check();
}

/// One model on one instance: 121 kB of KV per task (10 + 100 tokens x
/// 1000 B x 1.1), weights of `weights` bytes, a budget of `budget` bytes.
fn memory_cfg(weights: u64, budget: u64) -> PolicyConfig {
    let mut c = cfg(4, 0, 100);
    c.models[0].kv_bytes_per_token = 1000;
    c.models[0].weights_bytes = weights;
    c.models[0].memory_margin = 0.1;
    c.instances[0].memory_budget_bytes = Some(budget);
    c
}

#[test]
fn an_engine_reported_resident_model_adds_no_weights_to_a_task() {
    let mut p = Policy::new(memory_cfg(300_000, 500_000));
    p.set_engine_resident(0, true);
    assert_eq!(p.instances[0].mem_used, 300_000, "the loaded weights are counted");
    p.set_engine_resident(0, true);
    assert_eq!(p.instances[0].mem_used, 300_000, "once");
    p.enqueue(task("t0", Priority::P2, "a"), T0).unwrap();
    assert_eq!(drain(&mut p, T0), ["t0"]);
    assert_eq!(p.instances[0].mem_used, 421_000, "the task adds its KV share only");
    p.check();
}

#[test]
fn a_model_the_engine_unloaded_counts_its_weights_again() {
    let mut p = Policy::new(memory_cfg(300_000, 500_000));
    p.enqueue(task("t0", Priority::P2, "a"), T0).unwrap();
    assert_eq!(drain(&mut p, T0), ["t0"]);
    assert_eq!(p.instances[0].mem_used, 421_000);
    // A report racing our own dispatch: a model in use stays counted.
    p.set_engine_resident(0, false);
    assert_eq!(p.instances[0].mem_used, 421_000);
    p.release("t0", 10);
    assert_eq!(p.instances[0].mem_used, 300_000, "the weights stay while it is loaded");
    // Ollama evicted it (keep_alive ran out): the next task loads it again.
    p.set_engine_resident(0, false);
    assert_eq!(p.instances[0].mem_used, 0);
    p.enqueue(task("t1", Priority::P2, "a"), T0).unwrap();
    assert_eq!(drain(&mut p, T0), ["t1"]);
    assert_eq!(p.instances[0].mem_used, 421_000);
    p.check();
}

#[test]
fn logical_models_on_one_instance_count_its_weights_once() {
    let mut c = memory_cfg(300_000, 600_000);
    let mut m2 = c.models[0].clone();
    m2.name = "m2".into();
    c.models.push(m2);
    let mut p = Policy::new(c);
    p.enqueue(task("m-task", Priority::P2, "a"), T0).unwrap();
    let mut other = task("m2-task", Priority::P2, "a");
    other.model = 1;
    p.enqueue(other, T0).unwrap();
    // 300 kB + 2 x 121 kB fit in 600 kB; weights counted twice would not.
    assert_eq!(drain(&mut p, T0).len(), 2);
    assert_eq!(p.instances[0].mem_used, 542_000);
    p.check();
}

// --- Routing: data policy, fallback chain, retries, preemption -------------

/// Model 0 ("m") on local instance 0 and cloud instance 1 (public only);
/// model 1 ("small") on local instance 2, a fallback of model 0.
fn chain_cfg(allow_cloud: bool, canned: bool) -> PolicyConfig {
    let mut c = cfg(1, 0, 1);
    c.allow_cloud = allow_cloud;
    c.models[0].instances = vec![0, 1];
    c.models[0].fallback_models = vec![1];
    c.models[0].canned = canned;
    c.models.push(ModelPolicy {
        residency: Default::default(),
        name: "small".into(),
        queue_capacity: 4,
        instances: vec![2],
        fallback_models: Vec::new(),
        canned: false,
        ..c.models[0].clone()
    });
    let local = c.instances[0].clone();
    c.instances.push(InstancePolicy {
        name: "cloud".into(),
        location: Location::Cloud,
        max_data_class: DataClass::Public,
        max_concurrency: 4,
        ..local.clone()
    });
    c.instances.push(InstancePolicy { name: "small".into(), ..local });
    c
}

fn classed(id: &str, p: Priority, class: DataClass) -> TaskInfo {
    TaskInfo { class, ..task(id, p, "a") }
}

#[test]
fn no_path_sends_a_class_to_an_instance_that_may_not_receive_it() {
    let mut p = Policy::new(chain_cfg(true, false));
    p.set_instance_up(0, false);
    for class in [DataClass::Personal, DataClass::Sensitive, DataClass::Secret] {
        let e = p.enqueue(classed("x", Priority::P2, class), T0).unwrap_err();
        assert_eq!(e.code, ErrorCode::ModelUnavailable, "{class:?}");
        assert!(e.retry_after_ms.is_some());
    }
    // Public work may take the cloud, but only once the local step passed.
    let a = p.enqueue(classed("pub", Priority::P2, DataClass::Public), T0).unwrap();
    assert_eq!(a.step, FallbackStep::Cloud);
    assert_eq!(a.passed.first().map(|x| (x.step, x.why)), Some((FallbackStep::SameModel, "unavailable")));
    let g = p.next_grant(T0).unwrap();
    assert_eq!((g.task_id.as_str(), g.instance, g.step), ("pub", 1, FallbackStep::Cloud));
    // With the local instance back, public work stays local.
    p.set_instance_up(0, true);
    let a = p.enqueue(classed("pub2", Priority::P2, DataClass::Public), T0).unwrap();
    assert_eq!(a.step, FallbackStep::SameModel);
    assert_eq!(p.next_grant(T0).map(|g| g.instance), Some(0));
    p.check();

    // Without allow_cloud the cloud instance takes nothing at all.
    let mut p = Policy::new(chain_cfg(false, false));
    p.set_instance_up(0, false);
    assert!(p.enqueue(classed("pub", Priority::P2, DataClass::Public), T0).is_err());
    assert!(p.next_grant(T0).is_none());
}

#[test]
fn a_full_queue_falls_back_to_the_smaller_model_only_when_allowed() {
    let mut p = Policy::new(chain_cfg(false, false));
    p.enqueue(task("running", Priority::P2, "a"), T0).unwrap();
    assert_eq!(drain(&mut p, T0), ["running"]);
    p.enqueue(task("waiting", Priority::P2, "a"), T0).unwrap();
    // The queue (capacity 1) is full.
    let e = p.enqueue(task("no", Priority::P2, "a"), T0).unwrap_err();
    assert_eq!(e.code, ErrorCode::QueueFull);
    let a = p.enqueue(TaskInfo { allow_smaller: true, ..task("yes", Priority::P2, "a") }, T0).unwrap();
    assert_eq!((a.step, a.model), (FallbackStep::SmallerModel, 1));
    assert_eq!(a.passed[0].why, "no_room");
    let g = p.next_grant(T0).unwrap();
    assert_eq!((g.task_id.as_str(), g.instance, g.model), ("yes", 2, 1));
    p.check();
}

#[test]
fn the_canned_answer_comes_before_the_cloud_and_after_every_local_step() {
    let mut p = Policy::new(chain_cfg(true, true));
    p.set_instance_up(0, false);
    p.set_instance_up(2, false);
    let a = p.enqueue(TaskInfo { allow_smaller: true, ..classed("x", Priority::P2, DataClass::Public) }, T0).unwrap();
    assert_eq!(a.step, FallbackStep::Canned);
    let steps: Vec<_> = a.passed.iter().map(|x| x.step).collect();
    assert_eq!(steps, [FallbackStep::SameModel, FallbackStep::SmallerModel]);
    assert_eq!(p.total_waiting(), 0, "a canned answer waits for no slot");
}

#[test]
fn an_open_breaker_takes_an_instance_out_and_half_open_lets_one_trial_through() {
    let mut c = cfg(4, 0, 10);
    c.models[0].instances = vec![0];
    let mut p = Policy::new(c);
    p.set_breaker(0, BreakerState::Open);
    let e = p.enqueue(task("a", Priority::P2, "a"), T0).unwrap_err();
    assert!(e.message.contains("circuit breakers are open"), "{}", e.message);
    p.set_breaker(0, BreakerState::HalfOpen);
    p.enqueue(task("a", Priority::P2, "a"), T0).unwrap();
    p.enqueue(task("b", Priority::P2, "a"), T0).unwrap();
    assert_eq!(drain(&mut p, T0), ["a"], "one trial at a time");
    p.release("a", 0);
    p.set_breaker(0, BreakerState::Closed);
    assert_eq!(drain(&mut p, T0), ["b"]);
}

#[test]
fn a_retried_task_goes_first_and_avoids_the_instance_it_failed_on() {
    let mut c = cfg(1, 0, 10);
    c.models[0].instances = vec![0, 1];
    let other = InstancePolicy { name: "j".into(), ..c.instances[0].clone() };
    c.instances.push(other);
    let mut p = Policy::new(c);
    p.enqueue(task("t", Priority::P3, "a"), T0).unwrap();
    let g = p.next_grant(T0).unwrap();
    assert_eq!(g.instance, 0);
    p.enqueue(task("later", Priority::P3, "a"), T0).unwrap();
    assert_eq!(drain(&mut p, T0), ["later"], "instance 1 was free");
    p.release("later", 0);
    p.enqueue(task("later2", Priority::P3, "a"), T0).unwrap();
    // The attempt on instance 0 failed: back to the front, not on 0.
    assert_eq!(p.requeue("t", Some(0), T0), Some((0, 0, Priority::P3)));
    let g = p.next_grant(T0).unwrap();
    assert_eq!((g.task_id.as_str(), g.instance), ("t", 1), "ahead of an earlier arrival, on the other instance");
    // With the other instance down, the failed one is still better than
    // nothing.
    p.requeue("t", Some(1), T0);
    p.set_instance_up(1, false);
    let g = p.next_grant(T0).unwrap();
    assert_eq!((g.task_id.as_str(), g.instance), ("t", 0));
    p.check();
}

#[test]
fn p0_preempts_the_newest_preemptible_low_priority_task_it_can_replace() {
    let mut c = cfg(2, 0, 10);
    c.preemption = true;
    c.apps.insert("keep".into(), AppLimits { preemptible_from: None, ..AppLimits::default() });
    c.apps.insert("alarms".into(), AppLimits { max_running: Some(1), ..AppLimits::default() });
    let mut p = Policy::new(c);
    p.enqueue(task("old", Priority::P4, "a"), T0).unwrap();
    p.enqueue(task("kept", Priority::P4, "keep"), Duration::from_millis(1)).unwrap();
    drain(&mut p, Duration::from_millis(1));
    p.enqueue(task("alarm", Priority::P0, "b"), Duration::from_millis(2)).unwrap();
    // "kept" started last but its application says never.
    assert_eq!(p.preemption_victims(), [("alarm".to_string(), "old".to_string())]);
    assert!(p.preemption_victims().is_empty(), "asked once until answered");
    p.requeue("old", None, Duration::from_millis(3));
    assert_eq!(drain(&mut p, Duration::from_millis(3)), ["alarm"]);
    p.check();

    // A P0 task held back by its own application's cap gets no victim.
    let mut c = cfg(2, 0, 10);
    c.preemption = true;
    c.apps.insert("alarms".into(), AppLimits { max_running: Some(1), ..AppLimits::default() });
    let mut p = Policy::new(c);
    p.enqueue(task("a1", Priority::P0, "alarms"), T0).unwrap();
    p.enqueue(task("batch", Priority::P4, "a"), T0).unwrap();
    assert_eq!(drain(&mut p, T0).len(), 2);
    p.enqueue(task("a2", Priority::P0, "alarms"), T0).unwrap();
    assert!(p.preemption_victims().is_empty());
    // And nothing is preempted with preemption off.
    let mut p = Policy::new(cfg(1, 0, 10));
    p.enqueue(task("batch", Priority::P4, "a"), T0).unwrap();
    drain(&mut p, T0);
    p.enqueue(task("alarm", Priority::P0, "a"), T0).unwrap();
    assert!(p.preemption_victims().is_empty());
}

#[test]
fn a_waiting_task_moves_on_when_its_instances_go_down() {
    let mut p = Policy::new(chain_cfg(true, false));
    p.enqueue(task("running", Priority::P2, "a"), T0).unwrap();
    drain(&mut p, T0);
    p.enqueue(TaskInfo { allow_smaller: true, ..task("small-ok", Priority::P2, "a") }, T0).unwrap();
    p.set_instance_up(0, false);
    let mut stranded = p.stranded();
    stranded.sort();
    assert_eq!(stranded, [("small-ok".to_string(), false)]);
    let a = p.reroute("small-ok", T0, "went_down", "down").expect("the smaller model takes it");
    assert_eq!((a.step, a.model), (FallbackStep::SmallerModel, 1));
    let g = p.next_grant(T0).unwrap();
    assert_eq!((g.task_id.as_str(), g.instance), ("small-ok", 2));
    assert_eq!(g.passed.first().map(|x| x.why), Some("went_down"));
    // Personal work with nowhere to go stays stranded (the actor ends it).
    p.enqueue(TaskInfo { allow_smaller: false, ..task("stuck", Priority::P2, "a") }, T0).unwrap_err();
    p.check();
}

#[test]
fn an_immediate_step_takes_no_more_than_its_free_slots_in_one_batch() {
    // The cloud (instance 1) has 4 slots; local is down; six public tasks
    // arrive before the scheduler dispatches any.
    let mut p = Policy::new(chain_cfg(true, false));
    p.set_instance_up(0, false);
    let mut cloud = 0;
    for i in 0..6 {
        if p.enqueue(classed(&format!("t{i}"), Priority::P2, DataClass::Public), T0).is_ok() {
            cloud += 1;
        }
    }
    assert_eq!(cloud, 4, "a step that only takes work that can start at once is not a second queue");
    assert_eq!(drain(&mut p, T0).len(), 4);
    p.check();
}

#[test]
fn a_smaller_model_keeps_its_own_context_window_and_output_cap() {
    let mut c = chain_cfg(false, false);
    c.models[1].context_tokens = 1000;
    c.models[1].max_output_tokens = 50;
    let mut p = Policy::new(c);
    p.enqueue(task("running", Priority::P2, "a"), T0).unwrap();
    drain(&mut p, T0);
    p.enqueue(task("waiting", Priority::P2, "a"), T0).unwrap();
    // Fits the small model: its output is capped at its 50 tokens.
    let a = p.enqueue(TaskInfo { allow_smaller: true, ..task("fits", Priority::P2, "a") }, T0).unwrap();
    assert_eq!((a.step, a.max_output_tokens), (FallbackStep::SmallerModel, 50));
    assert_eq!(p.next_grant(T0).map(|g| (g.task_id, g.max_output_tokens)), Some(("fits".to_string(), 50)));
    // Too long for its window: not sent there (the queue-full answer).
    let long = TaskInfo { allow_smaller: true, input_tokens: 1500, ..task("long", Priority::P2, "a") };
    let e = p.enqueue(long, T0).unwrap_err();
    assert_eq!(e.code, ErrorCode::QueueFull, "{}", e.message);
    assert!(e.message.contains("context window of 'small'"), "{}", e.message);
}

#[test]
fn per_user_state_is_kept_only_for_users_that_are_active() {
    let mut c = cfg(1, 0, 10_000);
    let limits = AppLimits {
        user_requests_per_minute: Some(60),
        user_tokens_per_minute: Some(1_000_000),
        ..AppLimits::default()
    };
    c.apps.insert("a".into(), limits);
    let mut p = Policy::new(c);
    // Callers name users freely: 3000 of them, one task each.
    for i in 0..3000 {
        let t = TaskInfo { user: format!("u{i}"), ..task(&format!("t{i}"), Priority::P2, "a") };
        p.enqueue(t, T0).unwrap();
        let g = p.next_grant(T0).unwrap();
        p.release(&g.task_id, 0);
    }
    assert!(p.user_counts.is_empty(), "no counts for users with nothing waiting or running");
    // Their rate buckets last until they refill: a request at 60 a minute
    // takes a second; the 10 prompt tokens at a million a minute less
    // (the unused output budget was refunded at release).
    p.sweep_buckets(Duration::from_millis(500));
    assert_eq!((p.rpm.len(), p.tpm.len()), (3000, 0));
    p.sweep_buckets(Duration::from_secs(61));
    assert_eq!((p.rpm.len(), p.tpm.len()), (0, 0));
    // A user that still waits keeps its counts.
    p.enqueue(TaskInfo { user: "w".into(), ..task("busy", Priority::P2, "a") }, T0).unwrap();
    p.enqueue(TaskInfo { user: "w".into(), ..task("waits", Priority::P2, "a") }, T0).unwrap();
    assert_eq!(p.user_counts.len(), 1);
    p.check();
}

#[test]
fn rate_buckets_stay_within_max_tracked_users_and_a_limited_user_keeps_its_own() {
    let mut c = cfg(1, 0, 10_000);
    c.max_tracked_users = 1000;
    let limits = AppLimits {
        user_requests_per_minute: Some(60),
        user_tokens_per_minute: Some(1_000_000),
        ..AppLimits::default()
    };
    c.apps.insert("a".into(), limits);
    let mut p = Policy::new(c);
    let run = |p: &mut Policy, user: &str, id: &str, at: Duration| {
        let r = p.enqueue(TaskInfo { user: user.into(), ..task(id, Priority::P2, "a") }, at);
        if r.is_ok() {
            let g = p.next_grant(at).unwrap();
            p.release(&g.task_id, 0);
        }
        r.map(|_| ()).map_err(|e| e.code)
    };
    // A user held back by its limit: 60 requests, then refused.
    for i in 0..60 {
        run(&mut p, "hot", &format!("hot{i}"), T0).unwrap();
    }
    assert_eq!(run(&mut p, "hot", "hot-over", T0), Err(ErrorCode::RateLimited));
    // 100 000 made-up users within the same second.
    for i in 0..100_000u64 {
        let at = T0 + Duration::from_micros(i);
        run(&mut p, &format!("u{i}"), &format!("t{i}"), at).unwrap();
        assert!(p.rpm.len() <= 1000 && p.tpm.len() <= 1000, "{} {} at user {i}", p.rpm.len(), p.tpm.len());
    }
    assert!(p.user_counts.is_empty());
    // The limited user's bucket was not the one forgotten.
    assert_eq!(run(&mut p, "hot", "hot-still-over", T0 + Duration::from_millis(200)), Err(ErrorCode::RateLimited));
    p.check();
}

#[test]
fn degradation_levels_follow_what_still_serves() {
    let mut c = chain_cfg(false, false);
    c.models[0].instances = vec![0, 3];
    let twin = InstancePolicy { name: "twin".into(), ..c.instances[0].clone() };
    c.instances.push(twin);
    let mut p = Policy::new(c);
    assert_eq!(p.degradation(), 0);
    p.set_instance_up(3, false);
    assert_eq!(p.model_degradation(0), 1);
    p.set_breaker(0, BreakerState::Open);
    assert_eq!(p.model_degradation(0), 2, "only the smaller model is left");
    // Level 2 admits P0-P2 only (the default configuration).
    let e = p.enqueue(TaskInfo { allow_smaller: true, ..task("p3", Priority::P3, "a") }, T0).unwrap_err();
    assert!(e.message.contains("degraded (level 2)"), "{}", e.message);
    assert!(p.enqueue(TaskInfo { allow_smaller: true, ..task("p2", Priority::P2, "a") }, T0).is_ok());
    p.set_instance_up(2, false);
    assert_eq!(p.degradation(), 3);
}

// --- Property tests on a deterministic simulation -------------------------

#[derive(Debug, Clone)]
enum Op {
    Enqueue {
        prio: u8,
        app: u8,
        user: u8,
        input: u32,
        class: u8,
    },
    /// Instance `instance % 2`'s breaker: closed, half-open or open.
    Breaker {
        instance: u8,
        state: u8,
    },
    /// A running task's attempt failed: re-queued, avoiding its instance.
    Requeue(u8),
    /// The scheduler asks for victims; each gives its slot up.
    Preempt,
    /// A running task has its first token (leaves the long-prompt lane).
    Prefilled(u8),
    Advance(u16),
    Release(u8),
    Withdraw(u8),
    Health(bool),
    /// What instance `instance % 2`'s engine reports: KV usage in percent
    /// (`None`: no reading) and residency.
    Report {
        instance: u8,
        kv_percent: Option<u8>,
        resident: Option<bool>,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0u8..5, 0u8..3, 0u8..3, 0u32..4000, 0u8..4)
            .prop_map(|(prio, app, user, input, class)| Op::Enqueue { prio, app, user, input, class }),
        1 => (any::<u8>(), 0u8..3).prop_map(|(instance, state)| Op::Breaker { instance, state }),
        1 => any::<u8>().prop_map(Op::Requeue),
        1 => Just(Op::Preempt),
        1 => any::<u8>().prop_map(Op::Prefilled),
        2 => (1u16..5000).prop_map(Op::Advance),
        3 => any::<u8>().prop_map(Op::Release),
        1 => any::<u8>().prop_map(Op::Withdraw),
        1 => any::<bool>().prop_map(Op::Health),
        2 => (any::<u8>(), proptest::option::of(0u8..=100), proptest::option::of(any::<bool>()))
            .prop_map(|(instance, kv_percent, resident)| Op::Report { instance, kv_percent, resident }),
    ]
}

fn sim_config() -> PolicyConfig {
    let mut c = cfg(3, 1, 12);
    c.models.push(ModelPolicy {
        residency: Default::default(),
        name: "m2".into(),
        queue_capacity: 6,
        max_running: Some(1),
        instances: vec![0, 1],
        kv_bytes_per_token: 10,
        weights_bytes: 20_000,
        memory_margin: 0.1,
        fallback_models: Vec::new(),
        canned: false,
        context_tokens: 100_000,
        max_output_tokens: 10_000,
    });
    c.instances.push(InstancePolicy {
        name: "j".into(),
        max_concurrency: 2,
        reserved_realtime_slots: 0,
        memory_budget_bytes: Some(100_000),
        location: Location::Local,
        max_data_class: DataClass::Personal, // takes no sensitive or secret work
        cost: 0.0,
        // A long-prompt lane, for the invariants.
        max_prefill_tokens: Some(4000),
        long_prompt_tokens: 1000,
        slot_affinity: false,
    });
    c.apps.insert("a0".into(), AppLimits { weight: 2.0, max_running: Some(2), ..AppLimits::default() });
    c.apps
        .insert("a1".into(), AppLimits { user_max_running: Some(1), user_max_queued: Some(4), ..AppLimits::default() });
    c.max_queued = Some(15);
    c.aging = Some(Duration::from_secs(2));
    c.backpressure = Backpressure::default();
    c.kv_cache_high_water = 0.9;
    c.preemption = true;
    c
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Caps are never exceeded, reserved slots only go to P0/P1, every grant
    /// is the most urgent eligible task, an instance whose engine reports a
    /// full KV cache only gets a task when it runs none of ours, and every
    /// accepted task ends exactly once (granted then released, or
    /// withdrawn), even if the last KV reading stays full.
    #[test]
    fn invariants_hold_under_any_sequence(ops in proptest::collection::vec(op(), 1..200)) {
        let mut p = Policy::new(sim_config());
        let mut now = Duration::ZERO;
        let mut n = 0u32;
        let mut accepted: HashMap<String, u8> = HashMap::new(); // 0 waiting, 1 running, 2 ended
        for op in ops {
            match op {
                Op::Enqueue { prio, app, user, input, class } => {
                    n += 1;
                    let id = format!("t{n}");
                    let info = TaskInfo {
                        task_id: id.clone(),
                        model: (n % 2) as usize,
                        requested: 0,
                        priority: Priority::ALL[prio as usize],
                        tenant: "t".into(),
                        app: format!("a{app}"),
                        user: format!("u{user}"),
                        input_tokens: input,
                        max_output_tokens: 500,
                        class: DataClass::ALL[usize::from(class)],
                        allow_smaller: false,
                        affinity: None,
                        forwarded: false,
                    };
                    if p.enqueue(info, now).is_ok() {
                        accepted.insert(id, 0);
                    }
                }
                Op::Advance(ms) => now += Duration::from_millis(u64::from(ms)),
                Op::Release(k) => {
                    let running: Vec<String> = {
                        let mut v: Vec<_> = accepted.iter().filter(|(_, s)| **s == 1).map(|(id, _)| id.clone()).collect();
                        v.sort();
                        v
                    };
                    if !running.is_empty() {
                        let id = &running[k as usize % running.len()];
                        prop_assert!(p.release(id, 10).is_some());
                        accepted.insert(id.clone(), 2);
                    }
                }
                Op::Withdraw(k) => {
                    let mut waiting: Vec<_> = accepted.iter().filter(|(_, s)| **s == 0).map(|(id, _)| id.clone()).collect();
                    waiting.sort();
                    if !waiting.is_empty() {
                        let id = &waiting[k as usize % waiting.len()];
                        prop_assert!(p.withdraw(id));
                        accepted.insert(id.clone(), 2);
                    }
                }
                Op::Health(up) => p.set_instance_up(1, up),
                Op::Breaker { instance, state } => {
                    let s = [BreakerState::Closed, BreakerState::HalfOpen, BreakerState::Open][usize::from(state)];
                    p.set_breaker(usize::from(instance % 2), s);
                }
                Op::Requeue(k) => {
                    let mut running: Vec<String> = accepted.iter().filter(|(_, s)| **s == 1).map(|(id, _)| id.clone()).collect();
                    running.sort();
                    if !running.is_empty() {
                        let id = &running[k as usize % running.len()];
                        let instance = p.running[id].instance;
                        prop_assert!(p.requeue(id, Some(instance), now).is_some());
                        accepted.insert(id.clone(), 0);
                    }
                }
                Op::Prefilled(k) => {
                    let mut running: Vec<String> = accepted.iter().filter(|(_, s)| **s == 1).map(|(id, _)| id.clone()).collect();
                    running.sort();
                    if !running.is_empty() {
                        p.prefilled(&running[k as usize % running.len()]);
                    }
                }
                Op::Preempt => {
                    for (p0, victim) in p.preemption_victims() {
                        prop_assert_eq!(accepted.get(&victim).copied(), Some(1), "a victim that does not run");
                        prop_assert!(p.running[&victim].info.priority >= Priority::P3);
                        prop_assert_eq!(accepted.get(&p0).copied(), Some(0), "preempted for a task that does not wait");
                        prop_assert!(p.requeue(&victim, None, now).is_some());
                        accepted.insert(victim, 0);
                    }
                }
                Op::Report { instance, kv_percent, resident } => {
                    let i = usize::from(instance % 2);
                    p.set_kv_cache_usage(i, kv_percent.map(|k| f64::from(k) / 100.0));
                    if let Some(r) = resident {
                        p.set_engine_resident(i, r);
                    }
                }
            }
            // Grant what can start, checking each grant is the most urgent
            // eligible waiting task.
            loop {
                let eligible: HashMap<String, Priority> = p
                    .waiting
                    .iter()
                    .flatten()
                    .filter(|w| w.candidates.iter().any(|&i| p.eligible(w, i)))
                    .map(|w| (w.info.task_id.clone(), p.effective(w, now)))
                    .collect();
                let best_before = eligible.values().min().copied();
                let Some(g) = p.next_grant(now) else {
                    prop_assert!(best_before.is_none(), "an eligible task was left waiting");
                    break;
                };
                prop_assert_eq!(eligible.get(&g.task_id).copied(), best_before, "a less urgent task went first");
                prop_assert_eq!(accepted.get(&g.task_id).copied(), Some(0), "granted twice or never accepted");
                let class = p.running[&g.task_id].info.class;
                prop_assert!(class <= p.cfg.instances[g.instance].max_data_class, "{:?} work on {}", class, g.instance);
                prop_assert!(p.breaker(g.instance) != BreakerState::Open, "granted on an open breaker");
                if p.kv_cache_full(g.instance) {
                    prop_assert_eq!(p.running_on(g.instance), 1, "sent to a full KV cache that already ran ours");
                }
                accepted.insert(g.task_id.clone(), 1);
                p.check();
            }
            p.check();
        }
        // Drain: everything accepted ends exactly once.
        p.set_instance_up(1, true);
        p.set_breaker(0, BreakerState::Closed);
        p.set_breaker(1, BreakerState::Closed);
        for _ in 0..10_000 {
            let running: Vec<String> = accepted.iter().filter(|(_, s)| **s == 1).map(|(id, _)| id.clone()).collect();
            for id in running {
                p.release(&id, 0);
                accepted.insert(id, 2);
            }
            now += Duration::from_secs(1);
            while let Some(g) = p.next_grant(now) {
                prop_assert_eq!(accepted.get(&g.task_id).copied(), Some(0));
                accepted.insert(g.task_id, 1);
            }
            if accepted.values().all(|s| *s == 2) {
                break;
            }
        }
        prop_assert!(accepted.values().all(|s| *s == 2), "some task never ended");
        prop_assert_eq!(p.total_waiting(), 0);
    }

    /// With aging, a P4 task is not starved by a steady stream of P2 work:
    /// it starts within three aging periods plus one task's run time.
    #[test]
    fn aging_prevents_starvation(arrivals_per_tick in 1usize..4, run_ticks in 1u64..4) {
        let mut c = cfg(1, 0, 1000);
        c.aging = Some(Duration::from_secs(10));
        let mut p = Policy::new(c);
        let tick = Duration::from_secs(1);
        let mut now = Duration::ZERO;
        p.enqueue(task("batch", Priority::P4, "batch"), now).unwrap();
        let mut running: Option<(String, Duration)> = None;
        let mut n = 0;
        let mut started = None;
        for _ in 0..200 {
            for _ in 0..arrivals_per_tick {
                n += 1;
                p.enqueue(task(&format!("i{n}"), Priority::P2, "interactive"), now).unwrap();
            }
            if let Some((id, until)) = running.clone() {
                if now >= until {
                    p.release(&id, 0);
                    running = None;
                }
            }
            if running.is_none() {
                if let Some(g) = p.next_grant(now) {
                    if g.task_id == "batch" {
                        started = Some(now);
                        break;
                    }
                    running = Some((g.task_id, now + tick * run_ticks as u32));
                }
            }
            now += tick;
        }
        let started = started.expect("P4 task starved");
        prop_assert!(started <= Duration::from_secs(30 + run_ticks + 1), "started at {started:?}");
    }
}

#[test]
fn weights_count_until_resident_and_estimates_carry_a_margin() {
    let mut c = cfg(4, 0, 100);
    c.models[0].kv_bytes_per_token = 1000;
    c.models[0].weights_bytes = 100_000;
    c.models[0].memory_margin = 0.1;
    c.instances[0].memory_budget_bytes = Some(400_000);
    let mut p = Policy::new(c);
    // 110 tokens x 1000 B x 1.1 = 121 kB each; the first also loads 100 kB.
    assert_eq!(p.memory_estimate(0, 10, 100), 121_000);
    for i in 0..3 {
        p.enqueue(task(&format!("t{i}"), Priority::P2, "a"), T0).unwrap();
    }
    assert_eq!(drain(&mut p, T0).len(), 2, "100 kB weights + 2 x 121 kB fit in 400 kB, a third does not");
    p.release("t0", 10);
    assert_eq!(drain(&mut p, T0), ["t2"], "the weights stay loaded; the freed KV share is reused");
    p.check();
}

/// Issue 11 (FR-4.3, FR-4.6): the long-prompt lane. Three long prompts
/// (of higher priority, queued first) and short ones: one long prompt
/// takes the lane, the others wait for it, and the short ones start past
/// them; a long one starts when the lane's prefill leaves room.
#[test]
fn long_prompts_wait_for_their_lane_while_short_ones_pass_them() {
    let mut c = cfg(6, 0, 100);
    c.instances[0].max_prefill_tokens = Some(3000);
    c.instances[0].long_prompt_tokens = 1000;
    let mut p = Policy::new(c);
    let now = Duration::ZERO;
    let long = |id: &str| TaskInfo { input_tokens: 2000, ..task(id, Priority::P1, "a") };
    assert_eq!(p.enqueue(long("long1"), now).unwrap().lane, None, "the lane is free");
    assert_eq!(p.next_grant(now).unwrap().task_id, "long1");
    for id in ["long2", "long3"] {
        let why = p.enqueue(long(id), now).unwrap().lane.expect("waits for the lane");
        assert!(
            why.contains("long prompt (2000 tokens") && why.contains("i: 2000 of max_prefill_tokens 3000"),
            "{why}"
        );
    }
    for id in ["short1", "short2"] {
        assert_eq!(p.enqueue(task(id, Priority::P2, "a"), now).unwrap().lane, None);
    }
    let granted: Vec<String> = std::iter::from_fn(|| p.next_grant(now)).map(|g| g.task_id).collect();
    assert_eq!(granted, ["short1", "short2"], "short work passes the waiting long prompts");
    p.check();
    // long1's first token: its prompt left prefill; one more long fits.
    p.prefilled("long1");
    assert_eq!(p.next_grant(now).map(|g| g.task_id).as_deref(), Some("long2"));
    assert_eq!(p.next_grant(now), None, "2000 + 2000 > 3000");
    assert!(p.lane_wait(0, "long3").is_some());
    // Ending it frees the lane too (a task that failed before its first token).
    p.release("long2", 0);
    assert_eq!(p.next_grant(now).map(|g| g.task_id).as_deref(), Some("long3"));
    p.check();
}

/// A prompt longer than the whole cap runs alone in the lane, not never;
/// without `max_prefill_tokens` there is no lane.
#[test]
fn a_prompt_over_the_cap_runs_alone_and_no_cap_means_no_lane() {
    let mut c = cfg(4, 0, 100);
    c.instances[0].max_prefill_tokens = Some(3000);
    c.instances[0].long_prompt_tokens = 1000;
    let mut p = Policy::new(c);
    let now = Duration::ZERO;
    let huge = |id: &str| TaskInfo { input_tokens: 5000, ..task(id, Priority::P2, "a") };
    p.enqueue(huge("h1"), now).unwrap();
    p.enqueue(huge("h2"), now).unwrap();
    let granted: Vec<String> = std::iter::from_fn(|| p.next_grant(now)).map(|g| g.task_id).collect();
    assert_eq!(granted, ["h1"]);
    p.check();

    let mut p = Policy::new(cfg(4, 0, 100));
    for id in ["h1", "h2", "h3"] {
        assert_eq!(p.enqueue(huge(id), now).unwrap().lane, None);
    }
    assert_eq!(std::iter::from_fn(|| p.next_grant(now)).count(), 3);
}

#[test]
fn a_session_turn_returns_to_its_instance_and_slot_unless_it_is_busier() {
    // Two llama-servers with numbered slots, two slots each.
    let mut c = cfg(2, 0, 10);
    c.instances[0].slot_affinity = true;
    c.instances.push(InstancePolicy { name: "j".into(), ..c.instances[0].clone() });
    c.models[0].instances = vec![0, 1];
    let mut p = Policy::new(c);
    let turn = |id: &str| TaskInfo { affinity: Some("s".into()), ..task(id, Priority::P2, "a") };
    // Turn 1 goes where the router picks: the first, by config order.
    p.enqueue(turn("t1"), T0).unwrap();
    let g = p.next_grant(T0).unwrap();
    assert_eq!((g.instance, g.slot), (0, Some(0)));
    p.release("t1", 0);
    // Another task takes instance 0 slot 0 meanwhile; the next turn would
    // go to the idle instance 1 by load: affinity gives way.
    p.enqueue(task("other", Priority::P2, "a"), T0).unwrap();
    assert_eq!(p.next_grant(T0).unwrap().instance, 0);
    p.enqueue(turn("t2"), T0).unwrap();
    let g = p.next_grant(T0).unwrap();
    assert_eq!((g.instance, g.slot, g.decided_by), (1, Some(0), "load"), "busier: the normal choice");
    p.release("t2", 0);
    p.release("other", 0);
    // Both idle: the router would pick instance 0 (config order); the
    // session's last turn ran on 1, slot 0: there again.
    p.enqueue(turn("t3"), T0).unwrap();
    let t3 = p.next_grant(T0).unwrap();
    assert_eq!((t3.instance, t3.slot, t3.decided_by), (1, Some(0), "affinity"));
    // A task of higher priority waiting beside it still goes first: the
    // affinity only places the task the policy chose.
    p.enqueue(turn("t4"), T0).unwrap();
    p.enqueue(task("urgent", Priority::P1, "a"), T0).unwrap();
    assert_eq!(p.next_grant(T0).unwrap().task_id, "urgent");
}

#[test]
fn a_pool_instance_that_only_queues_takes_low_priority_work_and_leaves_the_rest_to_the_canned_answer() {
    // Model 0 on local instance 0 (down) and pool instance 1.
    let mut c = chain_cfg(false, true);
    c.instances[1] = InstancePolicy {
        name: "pool".into(),
        location: Location::EdgeNode,
        max_data_class: DataClass::Sensitive,
        ..c.instances[1].clone()
    };
    let mut p = Policy::new(c);
    p.set_instance_up(0, false);
    // No node serves now; the pool's work queue holds P3 and P4.
    p.set_takes_from(1, Some(Priority::P3));
    assert_eq!(p.model_degradation(0), 2, "a queue serves nothing now");
    let a = p.enqueue(classed("alarm", Priority::P1, DataClass::Personal), T0).unwrap();
    assert_eq!(a.step, FallbackStep::Canned);
    // P4 would be deferred at level 2 (admit_at_level: P2); it waits in
    // the pool's queue instead.
    let a = p.enqueue(classed("batch", Priority::P4, DataClass::Personal), T0).unwrap();
    assert_eq!(a.step, FallbackStep::EdgeNode);
    assert_eq!(p.next_grant(T0).map(|g| (g.task_id, g.instance)), Some(("batch".to_string(), 1)));
    // A secret task never leaves the node, queued or not.
    let e = p.enqueue(classed("secret", Priority::P4, DataClass::Secret), T0).unwrap_err();
    assert_eq!(e.code, ErrorCode::QueueFull, "{}", e.message);
    // A node serves again: the pool takes all work.
    p.set_takes_from(1, None);
    assert_eq!(p.model_degradation(0), 1);
    let a = p.enqueue(classed("alarm2", Priority::P1, DataClass::Personal), T0).unwrap();
    assert_eq!(a.step, FallbackStep::EdgeNode);
    p.check();
}
