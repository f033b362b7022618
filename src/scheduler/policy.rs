//! The scheduling policy, as a plain state machine with no I/O and no clock
//! of its own (time is passed in), so it can be simulated deterministically
//! (see the property tests at the end).
//!
//! What it decides:
//! - **Where a task may run**: its fallback chain (local instances of its
//!   model, smaller models, edge nodes, the canned answer, cloud), each step
//!   holding only the instances its data class allows ([`Policy::enqueue`]);
//!   moving waiting or failed tasks down the chain ([`Policy::reroute`]);
//!   the degradation level of each model.
//! - **Admission to the queue**: health, breakers, danger state, per-user
//!   request and token rates, resource fit, the backpressure ladder and the
//!   queue caps (global, per model, per application, per user), each with
//!   its own code.
//! - **Dispatch order**: strict priority (P0 first) on the *effective*
//!   priority (a waiting task gains one level every `aging` period, never
//!   above P1), then weighted fair queueing between flows (tenant +
//!   application) within a priority, then arrival.
//! - **Slots**: `max_concurrency` per instance, of which
//!   `reserved_realtime_slots` only P0/P1 tasks may take; per-model and
//!   per-application/per-user running caps; a memory budget per instance.
//! - **The long-prompt lane** (FR-4.3, FR-4.6): on an instance with
//!   `max_prefill_tokens`, a task whose prompt estimate is over
//!   `long_prompt_tokens` starts only while the prompt tokens of the long
//!   ones there still in prefill (granted, no first token yet:
//!   [`Policy::prefilled`]) leave room for it, or none is; short tasks are
//!   not counted and never wait behind a long one (a task that may not
//!   start is passed over, not a barrier), so a few huge prompts cannot
//!   take every slot while interactive work waits.
//! - **What engines report** (passed in by the actor from the probes): an
//!   instance whose engine says its KV cache is at `kv_cache_high_water`
//!   gets no new task while it runs any of ours (see
//!   [`Policy::kv_cache_full`]), and the engine's word on whether its model
//!   is loaded overrides what edgeway's own dispatches suggest.
//! - **Preemption**: which running P3/P4 task a waiting P0 task may ask for
//!   its slot ([`Policy::preemption_victims`]).
//!
//! It does not own channels, timers or engines: the actor in `mod.rs` feeds
//! it and carries out its grants.

use std::collections::HashMap;
use std::time::Duration;

use crate::error::{ErrorCode, GatewayError};
use crate::router::breaker::BreakerState;
use crate::router::{self, InstanceView};
use crate::task::{DataClass, FallbackStep, Location, Priority};

/// Limits of one application: the config's plain data, read as it is.
use crate::config::AppLimits;

#[derive(Debug, Clone)]
pub struct ModelPolicy {
    pub name: String,
    pub queue_capacity: usize,
    pub max_running: Option<usize>,
    pub instances: Vec<usize>,
    /// KV-cache bytes per token of context, for memory estimates.
    pub kv_bytes_per_token: u64,
    /// Model weights: counted once on an instance while the model is
    /// resident there (its first task loads it, or the engine reports it
    /// loaded; it stays until the engine reports it unloaded).
    pub weights_bytes: u64,
    /// Safety margin on KV estimates, as a fraction (0.1 = 10 %).
    pub memory_margin: f64,
    /// Smaller models that may answer instead (indices), in order.
    pub fallback_models: Vec<usize>,
    /// Its context window and output cap, for tasks that fall back to it.
    pub context_tokens: u32,
    pub max_output_tokens: u32,
    /// A canned answer is configured.
    pub canned: bool,
    /// Which work may use the model on this node (`forbidden` and
    /// `restricted` drop its local instances from a task's steps).
    pub residency: crate::config::Residency,
}

#[derive(Debug, Clone)]
pub struct InstancePolicy {
    pub name: String,
    pub max_concurrency: usize,
    /// Slots only P0/P1 tasks may take.
    pub reserved_realtime_slots: usize,
    /// Memory the instance's tasks may use (KV cache), if limited.
    pub memory_budget_bytes: Option<u64>,
    pub location: Location,
    /// The most sensitive data class it may receive.
    pub max_data_class: DataClass,
    /// Configured cost of a thousand tokens (a tie-breaker).
    pub cost: f64,
    /// Prompt tokens of long prompts in prefill at once (`None`: no lane).
    pub max_prefill_tokens: Option<u64>,
    /// A prompt of more tokens than this is long.
    pub long_prompt_tokens: u32,
    /// Its slots are numbered and sent (`id_slot`): llama-server.
    pub slot_affinity: bool,
}

/// Queue fill ratios at which each backpressure step starts.
#[derive(Debug, Clone, Copy)]
pub struct Backpressure {
    /// Refuse new P4 work.
    pub refuse_p4: f64,
    /// Shorten the queue wait of new P3/P4 work to a quarter.
    pub shorten_low_waits: f64,
    /// Cap the output budget of new P2-P4 work.
    pub cap_output: f64,
    /// Refuse new P3 work too (batch and background are deferred).
    pub refuse_p3: f64,
    pub capped_output_tokens: u32,
}

impl Default for Backpressure {
    fn default() -> Self {
        Backpressure {
            refuse_p4: 0.5,
            shorten_low_waits: 0.65,
            cap_output: 0.8,
            refuse_p3: 0.9,
            capped_output_tokens: 128,
        }
    }
}

#[derive(Debug, Clone)]
pub struct PolicyConfig {
    pub models: Vec<ModelPolicy>,
    pub instances: Vec<InstancePolicy>,
    pub apps: HashMap<String, AppLimits>,
    pub tenant_weights: HashMap<String, f64>,
    pub max_queued: Option<usize>,
    pub max_running: Option<usize>,
    pub aging: Option<Duration>,
    pub backpressure: Backpressure,
    pub busy_retry_after_ms: u64,
    /// Reported KV-cache usage (0..=1] at which an instance that runs any
    /// of our tasks gets no new one.
    pub kv_cache_high_water: f64,
    /// Cloud instances may be used at all.
    pub allow_cloud: bool,
    /// P0 tasks may preempt preemptible P3/P4 tasks.
    pub preemption: bool,
    /// The least urgent priority admitted at degradation levels 1, 2, 3.
    pub admit_at_level: [Priority; 2],
    /// Users (per application) whose rate buckets are kept at once:
    /// callers name users freely (see [`Policy::make_room_for_bucket`]).
    pub max_tracked_users: usize,
}

/// The part of [`PolicyConfig`] a configuration reload changes
/// ([`Policy::set_limits`]).
#[derive(Debug, Clone)]
pub struct Limits {
    /// Instances a reload added (an engine added, or a changed one's new
    /// instance), with their index, which follows the policy's last.
    pub added_instances: Vec<(usize, InstancePolicy)>,
    /// Each model's settings, by the policy's model index (after the
    /// models a reload added, which take the next indices): `None` for a
    /// model the reload removed, which keeps what it had for the work
    /// it still holds.
    pub models: Vec<Option<ModelPolicy>>,
    pub apps: HashMap<String, AppLimits>,
    pub tenant_weights: HashMap<String, f64>,
    pub max_queued: Option<usize>,
    pub max_running: Option<usize>,
    pub aging: Option<Duration>,
    pub busy_retry_after_ms: u64,
}

/// What the policy needs to know about a task.
#[derive(Debug, Clone)]
pub struct TaskInfo {
    pub task_id: String,
    pub model: usize,
    pub priority: Priority,
    pub tenant: String,
    pub app: String,
    pub user: String,
    pub input_tokens: u32,
    pub max_output_tokens: u32,
    /// The model the request named (set by [`Policy::enqueue`]; `model`
    /// becomes the queue's after a fallback).
    pub requested: usize,
    /// No instance whose `max_data_class` is below it may run the task.
    pub class: DataClass,
    /// A smaller model may answer.
    pub allow_smaller: bool,
    /// The session whose turn it is: its last instance and slot are
    /// preferred (`super::affinity`).
    pub affinity: Option<String>,
    /// Another node forwarded it here: it takes no edge-node step.
    pub forwarded: bool,
}

/// The terms on which a task was queued.
#[derive(Debug, Clone, PartialEq)]
pub struct Admission {
    pub position: usize,
    /// Lowered output budget (backpressure or memory), if any.
    pub max_output_tokens: u32,
    /// Shorter queue wait imposed by backpressure, as a fraction (0..1] of
    /// the task's own queue limit.
    pub queue_wait_factor: Option<f64>,
    pub degrade_reason: Option<String>,
    /// Why a long prompt waits for its lane, when it cannot start at once
    /// for that reason (for the QUEUED record).
    pub lane: Option<String>,
    /// The step of the fallback chain that took the task.
    pub step: FallbackStep,
    /// The model whose queue it waits in (the requested one, or a smaller
    /// one).
    pub model: usize,
    /// Steps passed over before it, with why.
    pub passed: Vec<Passed>,
}

/// A step of the chain passed over, and why: a closed label for metrics
/// (`no_class`, `unavailable`, `breaker_open`, `no_room`, `went_down`)
/// and the detail for the record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Passed {
    pub step: FallbackStep,
    pub why: &'static str,
    pub detail: String,
}

fn passed_over(step: FallbackStep, why: &'static str, detail: impl Into<String>) -> Passed {
    Passed { step, why, detail: detail.into() }
}

/// A slot given to a task.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Grant {
    pub task_id: String,
    pub instance: usize,
    /// The model the task runs as (its queue's).
    pub model: usize,
    pub step: FallbackStep,
    /// The factor that decided the instance among the candidates.
    pub decided_by: &'static str,
    /// Its output budget on this step (a smaller model may cap it).
    pub max_output_tokens: u32,
    /// Steps the task was moved past while it waited (its instances went
    /// down), with why.
    pub passed: Vec<Passed>,
    /// The engine slot it takes (`id_slot`), on an instance with slot
    /// affinity.
    pub slot: Option<u32>,
}

/// Why a step of the chain did not take a task.
enum Refusal {
    /// The step has no room (queue, memory): the next step may.
    Capacity(GatewayError),
    /// The caller's own limits or the node's state: no step would take it.
    Final(GatewayError),
}

/// One step of a task's fallback chain: where it may run.
#[derive(Debug, Clone)]
struct Link {
    step: FallbackStep,
    model: usize,
    /// Instances of `model` the task's data class allows at this step.
    instances: Vec<usize>,
    /// The step only takes a task that can start at once (it is an
    /// alternative to waiting, not a second queue).
    immediate: bool,
}

#[derive(Debug)]
struct Waiting {
    info: TaskInfo,
    seq: u64,
    enqueued_at: Duration,
    /// Virtual finish time of weighted fair queueing.
    tag: f64,
    mem_bytes: u64,
    /// The step that took it and the instances it may run on.
    step: FallbackStep,
    candidates: Vec<usize>,
    /// Instances an earlier attempt failed on: used only when no other
    /// candidate could ever take the task.
    avoid: Vec<usize>,
    /// Taken by an immediate step or put back by a retry or preemption:
    /// not counted against the queue's bound.
    overflow: bool,
    passed: Vec<Passed>,
}

#[derive(Debug)]
struct Running {
    info: TaskInfo,
    instance: usize,
    mem_bytes: u64,
    charged_output: u64,
    step: FallbackStep,
    candidates: Vec<usize>,
    avoid: Vec<usize>,
    started_at: Duration,
    /// A preemption of it was asked for and not answered yet, or it said
    /// it cannot be restarted any more (output went out).
    not_preemptible: bool,
    /// Its prompt tokens counted in its instance's `long_prefill` (a long
    /// prompt before its first token; 0 otherwise).
    prefill: u64,
}

#[derive(Debug, Default, Clone)]
struct InstanceState {
    /// The health probe's verdict: a model with no instance up refuses new
    /// work at once.
    up: bool,
    /// Down only until its supervised engine process is ready again.
    restarting: bool,
    /// It replaces an instance of the same engine that a reload changed
    /// and was not up yet: the work queued for the old one waits for it
    /// while it is `restarting` (not yet probed, or its process starting)
    /// instead of falling back.
    replacement: bool,
    /// Out of dispatch for now (an engine still running cancelled work);
    /// new work still queues for it.
    paused: bool,
    running: usize,
    running_realtime: usize,
    /// KV estimates of running tasks plus `resident_weights`.
    mem_used: u64,
    /// Weights counted for the instance's model while it is loaded: set by
    /// our first dispatch there or by the engine reporting it loaded;
    /// cleared when the engine reports it unloaded. An instance serves one
    /// engine model, whichever logical models name it, so it is counted
    /// once.
    resident_weights: Option<u64>,
    /// KV-cache usage (0..=1) the engine last reported; `None` when it
    /// reports none.
    kv_cache_usage: Option<f64>,
    /// Prompt tokens of the long prompts running here and still in
    /// prefill (the long-prompt lane).
    long_prefill: u64,
    /// What the engine last said of its model being in memory (`None`:
    /// it does not say, as llama.cpp and vLLM, whose model is always
    /// loaded).
    reported_resident: Option<bool>,
    /// The router's circuit breaker for the instance.
    breaker: BreakerState,
    /// Recent failure ratio and p95 time to first token, as the router's
    /// breaker measured them.
    error_rate: f64,
    ttft_p95_ms: Option<u64>,
    /// Up only for work of this priority or less urgent (a pool instance
    /// none of whose nodes can serve now but whose work queue holds such
    /// work until one can); `None`: for all.
    takes_from: Option<Priority>,
}

/// A token bucket refilled continuously: `rate_per_min` per minute, at most
/// `rate_per_min` stored.
#[derive(Debug, Clone)]
struct Bucket {
    tokens: f64,
    at: Duration,
}

impl Bucket {
    fn take(&mut self, now: Duration, rate_per_min: f64, n: f64) -> Result<(), u64> {
        let elapsed = now.saturating_sub(self.at).as_secs_f64();
        self.tokens = (self.tokens + elapsed * rate_per_min / 60.0).min(rate_per_min);
        self.at = now;
        if self.tokens >= n {
            self.tokens -= n;
            Ok(())
        } else {
            // Milliseconds until enough has refilled (n may exceed the
            // bucket: then a full minute).
            let missing = (n.min(rate_per_min) - self.tokens).max(0.0);
            Err(((missing * 60_000.0 / rate_per_min).ceil() as u64).max(1))
        }
    }

    fn refund(&mut self, rate_per_min: f64, n: f64) {
        self.tokens = (self.tokens + n).min(rate_per_min);
    }
}

#[derive(Default)]
struct Counts {
    queued: usize,
    running: usize,
}

pub struct Policy {
    cfg: PolicyConfig,
    waiting: Vec<Vec<Waiting>>, // per model
    running: HashMap<String, Running>,
    instances: Vec<InstanceState>,
    model_running: Vec<usize>,
    app_counts: HashMap<String, Counts>,
    user_counts: HashMap<(String, String), Counts>,
    rpm: HashMap<(String, String), Bucket>,
    tpm: HashMap<(String, String), Bucket>,
    flow_finish: HashMap<(String, String), f64>,
    vtime: f64,
    seq: u64,
    total_waiting: usize,
    danger: Option<String>,
    /// Preemptions asked and not answered yet: victim → the P0 task it
    /// makes room for.
    preempting: HashMap<String, String>,
    affinity: super::affinity::Affinity,
    /// Admissions asked for, for the bucket sweep.
    admissions: u64,
}

/// How many admissions pass between two sweeps of idle rate buckets.
const SWEEP_EVERY: u64 = 1024;

fn busy(code: ErrorCode, msg: String, retry_ms: u64) -> GatewayError {
    GatewayError::new(code, msg).with_retry_after(retry_ms)
}

impl Policy {
    pub fn new(cfg: PolicyConfig) -> Policy {
        let n_models = cfg.models.len();
        Policy {
            waiting: (0..n_models).map(|_| Vec::new()).collect(),
            running: HashMap::new(),
            instances: cfg.instances.iter().map(|_| InstanceState { up: true, ..Default::default() }).collect(),
            model_running: vec![0; n_models],
            app_counts: HashMap::new(),
            user_counts: HashMap::new(),
            rpm: HashMap::new(),
            tpm: HashMap::new(),
            flow_finish: HashMap::new(),
            vtime: 0.0,
            seq: 0,
            total_waiting: 0,
            danger: None,
            preempting: HashMap::new(),
            affinity: super::affinity::Affinity::new(
                cfg.instances.iter().map(|i| i.slot_affinity.then_some(i.max_concurrency)),
            ),
            admissions: 0,
            cfg,
        }
    }

    pub fn config(&self) -> &PolicyConfig {
        &self.cfg
    }

    pub fn set_instance_up(&mut self, instance: usize, up: bool) {
        self.instances[instance].up = up;
        // Up once: from here it is an instance like any other.
        if up {
            self.instances[instance].replacement = false;
        }
    }

    /// The instance is down only while its engine process restarts: a
    /// task whose chain has nothing else to take it waits for it (at
    /// admission, and when its instances go down while it waits) rather
    /// than failing `MODEL_UNAVAILABLE`.
    pub fn set_instance_restarting(&mut self, instance: usize, restarting: bool) {
        self.instances[instance].restarting = restarting;
    }

    pub fn set_instance_paused(&mut self, instance: usize, paused: bool) {
        self.instances[instance].paused = paused;
    }

    /// The router's breaker state of an instance.
    pub fn set_breaker(&mut self, instance: usize, state: BreakerState) {
        self.instances[instance].breaker = state;
    }

    /// What the router's breaker measured of an instance's recent attempts.
    pub fn set_measured(&mut self, instance: usize, error_rate: f64, ttft_p95_ms: Option<u64>) {
        let i = &mut self.instances[instance];
        i.error_rate = error_rate;
        i.ttft_p95_ms = ttft_p95_ms;
    }

    /// The engine's report that it takes only work of priority `p` or
    /// less urgent for now (`None`: all work).
    pub fn set_takes_from(&mut self, instance: usize, p: Option<Priority>) {
        self.instances[instance].takes_from = p;
    }

    pub fn takes_from(&self, instance: usize) -> Option<Priority> {
        self.instances[instance].takes_from
    }

    /// Whether the instance takes work of priority `p` (see
    /// [`Policy::set_takes_from`]).
    fn takes(&self, instance: usize, p: Priority) -> bool {
        self.instances[instance].takes_from.is_none_or(|from| p >= from)
    }

    /// Whether the model has an edge-node instance up that holds work of
    /// priority `p` in the pool's work queue while no node can serve it:
    /// such work waits there rather than being deferred as busy.
    fn pool_queues(&self, model: usize, info: &TaskInfo) -> bool {
        !info.forwarded
            && self.cfg.models[model].instances.iter().any(|&i| {
                let s = &self.instances[i];
                self.cfg.instances[i].location == Location::EdgeNode
                    && s.up
                    && s.takes_from.is_some_and(|from| info.priority >= from)
                    && self.class_allows(info.class, i)
            })
    }

    pub fn breaker(&self, instance: usize) -> BreakerState {
        self.instances[instance].breaker
    }

    /// Whether an instance could take work now or soon: up and its breaker
    /// not open (a paused one comes back by itself).
    fn serving(&self, instance: usize) -> bool {
        let i = &self.instances[instance];
        i.up && i.breaker != BreakerState::Open
    }

    /// Serving, and for all work (not a pool instance that only queues
    /// low-priority work): what the degradation level counts.
    fn serving_all(&self, instance: usize) -> bool {
        self.serving(instance) && self.instances[instance].takes_from.is_none()
    }

    /// The fallback chain of a task, in order, with only the instances its
    /// data class and the configuration allow at each step: the requested
    /// model's local instances; smaller local models (if allowed); the
    /// model's edge-node instances; the canned answer (an empty link);
    /// its cloud instances (if cloud is allowed at all).
    fn chain(&self, info: &TaskInfo) -> Vec<Link> {
        let m = info.model;
        let at = |model: usize, loc: Location| -> Vec<usize> {
            self.cfg.models[model]
                .instances
                .iter()
                .copied()
                .filter(|&i| {
                    let ip = &self.cfg.instances[i];
                    ip.location == loc
                        && self.class_allows(info.class, i)
                        && self.takes(i, info.priority)
                        && (loc != Location::Local || self.residency_allows(model, info))
                })
                .collect()
        };
        let mut chain =
            vec![Link { step: FallbackStep::SameModel, model: m, instances: at(m, Location::Local), immediate: false }];
        if info.allow_smaller {
            for &f in &self.cfg.models[m].fallback_models {
                chain.push(Link {
                    step: FallbackStep::SmallerModel,
                    model: f,
                    instances: at(f, Location::Local),
                    immediate: false,
                });
            }
        }
        chain.push(Link {
            step: FallbackStep::EdgeNode,
            model: m,
            // A forwarded task stays on the node it was forwarded to.
            instances: if info.forwarded { Vec::new() } else { at(m, Location::EdgeNode) },
            immediate: true,
        });
        if self.cfg.models[m].canned {
            chain.push(Link { step: FallbackStep::Canned, model: m, instances: Vec::new(), immediate: true });
        }
        if self.cfg.allow_cloud {
            chain.push(Link {
                step: FallbackStep::Cloud,
                model: m,
                instances: at(m, Location::Cloud),
                immediate: true,
            });
        }
        chain
    }

    /// Whether `info`'s work may use `model` on this node: not when it is
    /// `forbidden` here, nor when it is `restricted` to other work.
    fn residency_allows(&self, model: usize, info: &TaskInfo) -> bool {
        self.cfg.models[model].residency.allows(&info.app, info.priority)
    }

    /// The one rule of the data policy: an instance receives a class only
    /// up to its own `max_data_class`, and a cloud instance nothing at all
    /// unless cloud is allowed. Every path to a slot goes through it.
    fn class_allows(&self, class: DataClass, instance: usize) -> bool {
        let ip = &self.cfg.instances[instance];
        class <= ip.max_data_class && (ip.location != Location::Cloud || self.cfg.allow_cloud)
    }

    /// How degraded service of `model` is: 0 all its local instances
    /// serve; 1 some do not, or only its edge-node or cloud instances
    /// serve; 2 only smaller models or the canned answer remain; 3 nothing
    /// does (busy answers).
    pub fn model_degradation(&self, model: usize) -> u8 {
        let mp = &self.cfg.models[model];
        let local: Vec<usize> =
            mp.instances.iter().copied().filter(|&i| self.cfg.instances[i].location == Location::Local).collect();
        let serving = local.iter().filter(|&&i| self.serving(i)).count();
        if serving == local.len() && serving > 0 {
            return 0;
        }
        let remote = mp.instances.iter().any(|&i| {
            let ip = &self.cfg.instances[i];
            ip.location != Location::Local
                && (ip.location != Location::Cloud || self.cfg.allow_cloud)
                && self.serving_all(i)
        });
        if serving > 0 || remote {
            return 1;
        }
        let smaller = mp.fallback_models.iter().any(|&f| {
            self.cfg.models[f]
                .instances
                .iter()
                .any(|&i| self.cfg.instances[i].location == Location::Local && self.serving(i))
        });
        if smaller || mp.canned {
            2
        } else {
            3
        }
    }

    /// The node's degradation level: its most degraded model's.
    pub fn degradation(&self) -> u8 {
        (0..self.cfg.models.len()).map(|m| self.model_degradation(m)).max().unwrap_or(0)
    }

    pub fn instance_paused(&self, instance: usize) -> bool {
        self.instances[instance].paused
    }

    /// Whether the instance may be given tasks now: up and not paused.
    pub fn instance_dispatchable(&self, instance: usize) -> bool {
        let i = &self.instances[instance];
        i.up && !i.paused
    }

    /// The engine's latest KV-cache usage reading (`None`: it gave none).
    pub fn set_kv_cache_usage(&mut self, instance: usize, usage: Option<f64>) {
        self.instances[instance].kv_cache_usage = usage;
    }

    pub fn kv_cache_usage(&self, instance: usize) -> Option<f64> {
        self.instances[instance].kv_cache_usage
    }

    /// Whether the engine reports its KV cache at or over the high-water
    /// mark. Such an instance gets no new task while it runs any of ours,
    /// whatever the priority: the engine would only queue or preempt it
    /// there, and a waiting P0 is still the first to go once there is room.
    /// With none of ours running it may get one, so a stale reading, or an
    /// engine filled by other clients, cannot hold work back for ever.
    pub fn kv_cache_full(&self, instance: usize) -> bool {
        self.instances[instance].kv_cache_usage.is_some_and(|u| u >= self.cfg.kv_cache_high_water)
    }

    /// What the engine says about its model being in memory. Loaded: its
    /// weights are counted (once) and no task adds them again. Unloaded
    /// (Ollama evicted it after `keep_alive`): they are no longer counted,
    /// and the next task adds them again, unless some of our tasks still
    /// run there (then it is loading or in use whatever a racing report
    /// says).
    pub fn set_engine_resident(&mut self, instance: usize, resident: bool) {
        // Logical models naming one instance may disagree on its weights:
        // count the largest.
        let weights = self
            .cfg
            .models
            .iter()
            .filter(|m| m.instances.contains(&instance))
            .map(|m| m.weights_bytes)
            .max()
            .unwrap_or(0);
        let inst = &mut self.instances[instance];
        inst.reported_resident = Some(resident);
        match (resident, inst.resident_weights) {
            (true, None) => {
                inst.resident_weights = Some(weights);
                inst.mem_used += weights;
            }
            (false, Some(counted)) if inst.running == 0 => {
                inst.resident_weights = None;
                inst.mem_used -= counted;
            }
            _ => {}
        }
    }

    /// A danger state (temperature, memory) stops admission of new work.
    pub fn set_danger(&mut self, reason: Option<String>) {
        self.danger = reason;
    }

    /// Takes the limits and routes of a reloaded configuration. They judge
    /// the next admission and grant only: running tasks keep their slots, waiting
    /// ones their place (a lowered bound refuses new work until the queue
    /// is below it). Instances and models a reload added are appended;
    /// an added instance is down, and only waited for (as a restarting
    /// one), until its first probe says otherwise.
    pub fn set_limits(&mut self, limits: Limits) {
        for (i, inst) in limits.added_instances {
            debug_assert_eq!(i, self.instances.len(), "instances are added in index order");
            self.affinity.add(inst.slot_affinity.then_some(inst.max_concurrency));
            self.instances.push(InstanceState { up: false, restarting: true, ..Default::default() });
            self.cfg.instances.push(inst);
        }
        for (m, l) in limits.models.into_iter().enumerate() {
            let Some(l) = l else { continue };
            if m < self.cfg.models.len() {
                // Chains are built from these at each admission and
                // reroute: waiting tasks keep the candidates they were
                // queued with.
                self.cfg.models[m] = l;
            } else {
                debug_assert_eq!(m, self.cfg.models.len(), "models are added in index order");
                self.cfg.models.push(l);
                self.waiting.push(Vec::new());
                self.model_running.push(0);
            }
        }
        self.cfg.apps = limits.apps;
        self.cfg.tenant_weights = limits.tenant_weights;
        self.cfg.max_queued = limits.max_queued;
        self.cfg.max_running = limits.max_running;
        self.cfg.aging = limits.aging;
        self.cfg.busy_retry_after_ms = limits.busy_retry_after_ms;
    }

    pub fn waiting(&self, model: usize) -> usize {
        self.waiting[model].len()
    }

    pub fn total_waiting(&self) -> usize {
        self.total_waiting
    }

    pub fn running_on(&self, instance: usize) -> usize {
        self.instances[instance].running
    }

    pub fn is_waiting(&self, task_id: &str) -> bool {
        self.waiting.iter().any(|q| q.iter().any(|w| w.info.task_id == task_id))
    }

    fn app(&self, app: &str) -> AppLimits {
        self.cfg.apps.get(app).cloned().unwrap_or_default()
    }

    /// The memory a task needs on an instance for its KV cache.
    pub fn memory_estimate(&self, model: usize, input: u32, output: u32) -> u64 {
        let m = &self.cfg.models[model];
        let kv = m.kv_bytes_per_token * u64::from(input + output);
        kv + (kv as f64 * m.memory_margin).round() as u64
    }

    /// Weights still to load for `model` on `instance`.
    fn weights_to_load(&self, model: usize, instance: usize) -> u64 {
        if self.instances[instance].resident_weights.is_some() {
            0
        } else {
            self.cfg.models[model].weights_bytes
        }
    }

    /// The largest memory budget among the model's instances (None: no
    /// limit anywhere).
    fn best_budget(&self, model: usize) -> Option<u64> {
        let mut best: Option<u64> = Some(0);
        for &i in &self.cfg.models[model].instances {
            match self.cfg.instances[i].memory_budget_bytes {
                None => return None,
                Some(b) => best = best.map(|x| x.max(b)),
            }
        }
        best
    }

    /// How full the queues are: the fuller of the model's queue and the
    /// global queue.
    fn fill(&self, model: usize) -> f64 {
        let m = self.waiting[model].len() as f64 / self.cfg.models[model].queue_capacity as f64;
        let g = self.cfg.max_queued.map(|cap| self.total_waiting as f64 / cap as f64).unwrap_or(0.0);
        m.max(g)
    }

    /// Decides whether a task may wait for a slot, where, and on what
    /// terms: the first step of its fallback chain that can take it (see
    /// `Policy::chain`). A step is passed over when it has no instance
    /// the data class allows, none is healthy, their breakers are open, or
    /// it has no room (queue, memory); an immediate step (edge node,
    /// cloud) only when none of its instances can start the task now. The
    /// caller's own limits (rates, application and user caps) and the
    /// node's danger state refuse at once, whatever the chain.
    pub fn enqueue(&mut self, mut info: TaskInfo, now: Duration) -> Result<Admission, GatewayError> {
        info.requested = info.model;
        self.admissions += 1;
        if self.admissions % SWEEP_EVERY == 0 {
            self.sweep_buckets(now);
        }
        let retry = self.cfg.busy_retry_after_ms;
        if let Some(why) = &self.danger {
            return Err(busy(ErrorCode::ResourceExhausted, format!("not admitting new work: {why}"), retry.max(5000)));
        }
        let level = self.model_degradation(info.model);
        if (1..=2).contains(&level)
            && info.priority > self.cfg.admit_at_level[usize::from(level) - 1]
            && !self.pool_queues(info.model, &info)
        {
            return Err(busy(
                ErrorCode::QueueFull,
                format!(
                    "service is degraded (level {level}): {} work is deferred, retry later",
                    info.priority.as_str()
                ),
                retry * 2,
            ));
        }
        let mut passed: Vec<Passed> = Vec::new();
        let mut first: Option<GatewayError> = None;
        // The first step whose instances are all down only while their
        // engine processes restart: the task waits there when no step can
        // take it now.
        let mut restarting: Option<Link> = None;
        for link in self.chain(&info) {
            let model_name = &self.cfg.models[link.model].name;
            if link.step == FallbackStep::Canned {
                return Ok(Admission {
                    position: 0,
                    max_output_tokens: info.max_output_tokens,
                    queue_wait_factor: None,
                    degrade_reason: None,
                    lane: None,
                    step: link.step,
                    model: link.model,
                    passed,
                });
            }
            if link.instances.is_empty()
                && link.step == FallbackStep::SameModel
                && !self.residency_allows(link.model, &info)
            {
                let r = &self.cfg.models[link.model].residency;
                let detail = match &r.restricted_to {
                    Some(to) if r.class == crate::config::ResidencyClass::Restricted => {
                        format!("model '{model_name}' is restricted on this node to {}", to.describe())
                    }
                    _ => format!("model '{model_name}' is forbidden on this node"),
                };
                passed.push(passed_over(link.step, "residency", detail.clone()));
                first.get_or_insert_with(|| GatewayError::new(ErrorCode::PolicyBlocked, detail));
                continue;
            }
            if link.instances.is_empty() {
                if link.step == FallbackStep::SameModel {
                    passed.push(passed_over(
                        link.step,
                        "no_class",
                        format!("no local instance of '{model_name}' may receive {} data", info.class.as_str()),
                    ));
                }
                continue;
            }
            if !link.instances.iter().any(|&i| self.instances[i].up) {
                if !link.immediate
                    && restarting.is_none()
                    && link.instances.iter().any(|&i| self.instances[i].restarting)
                {
                    restarting = Some(link.clone());
                }
                passed.push(passed_over(link.step, "unavailable", format!("no instance of '{model_name}' is healthy")));
                first.get_or_insert_with(|| {
                    busy(
                        ErrorCode::ModelUnavailable,
                        format!("no instance of model '{model_name}' is healthy"),
                        retry.max(2000),
                    )
                });
                continue;
            }
            if !link.instances.iter().any(|&i| self.serving(i)) {
                passed.push(passed_over(
                    link.step,
                    "breaker_open",
                    format!("the circuit breaker of every instance of '{model_name}' is open"),
                ));
                first.get_or_insert_with(|| {
                    busy(
                        ErrorCode::ModelUnavailable,
                        format!("every instance of model '{model_name}' is failing; its circuit breakers are open"),
                        retry.max(2000),
                    )
                });
                continue;
            }
            let mut task = info.clone();
            task.model = link.model;
            match self.admit_on(task, &link, now, None) {
                Ok(mut a) => {
                    a.passed = passed;
                    return Ok(a);
                }
                Err(Refusal::Final(e)) => return Err(e),
                Err(Refusal::Capacity(e)) => {
                    passed.push(passed_over(link.step, "no_room", e.message.clone()));
                    first.get_or_insert(e);
                }
            }
        }
        if let Some(link) = restarting {
            let mut task = info.clone();
            task.model = link.model;
            match self.admit_on(task, &link, now, None) {
                Ok(mut a) => {
                    // Only the steps before it were passed over: it waits
                    // on this one.
                    passed.retain(|p| p.step < link.step);
                    a.passed = passed;
                    return Ok(a);
                }
                Err(Refusal::Final(e)) => return Err(e),
                Err(Refusal::Capacity(e)) => first = Some(e),
            }
        }
        let mut e = first.unwrap_or_else(|| {
            busy(ErrorCode::PolicyBlocked, format!("no instance may receive {} data", info.class.as_str()), retry)
        });
        if passed.len() > 1 {
            let steps: Vec<String> = passed.iter().map(|p| format!("{}: {}", p.step.as_str(), p.detail)).collect();
            e.message = format!("{} (no fallback could take it; {})", e.message, steps.join("; "));
        }
        Err(e)
    }

    /// Whether `link` takes the task, and on what terms.
    ///
    /// `again`: the task was admitted before (it moves to another step
    /// while waiting, or after a failed attempt) with this arrival number,
    /// time and fair-queueing tag: it keeps them, and is not charged or
    /// counted against the caller's caps a second time.
    fn admit_on(
        &mut self,
        mut info: TaskInfo,
        link: &Link,
        now: Duration,
        again: Option<(u64, Duration, f64)>,
    ) -> Result<Admission, Refusal> {
        let retry = self.cfg.busy_retry_after_ms;
        let m = info.model;
        let app = self.app(&info.app);
        let mut degrade = None;

        // A smaller model has its own limits: output within its cap and its
        // context window (the prompt was checked against the requested
        // model's only).
        if m != info.requested {
            let mp = &self.cfg.models[m];
            let fits = mp.context_tokens.saturating_sub(info.input_tokens);
            let cap = mp.max_output_tokens.min(fits);
            if info.input_tokens >= mp.context_tokens {
                return Err(Refusal::Capacity(GatewayError::new(
                    ErrorCode::ContextTooLarge,
                    format!("the prompt does not fit the context window of '{}'", mp.name),
                )));
            }
            if info.max_output_tokens > cap {
                info.max_output_tokens = cap;
                degrade = Some(format!("output budget capped at {cap} tokens by model '{}'", mp.name));
            }
        }

        // Resource fit: shrink the output budget to fit, or refuse.
        if let Some(budget) = self.best_budget(m) {
            let need =
                self.memory_estimate(m, info.input_tokens, info.max_output_tokens) + self.cfg.models[m].weights_bytes;
            if need > budget {
                let mp = &self.cfg.models[m];
                let per = ((mp.kv_bytes_per_token.max(1) as f64) * (1.0 + mp.memory_margin)).ceil() as u64;
                let fits = budget.saturating_sub(mp.weights_bytes) / per;
                if fits <= u64::from(info.input_tokens) + 16 {
                    return Err(Refusal::Capacity(GatewayError::new(
                        ErrorCode::ResourceExhausted,
                        format!("the request needs about {need} bytes of KV cache; the engine has {budget}"),
                    )));
                }
                info.max_output_tokens = (fits - u64::from(info.input_tokens)) as u32;
                degrade =
                    Some(format!("output budget reduced to {} tokens to fit engine memory", info.max_output_tokens));
            }
        }

        // Backpressure ladder.
        let bp = self.cfg.backpressure;
        let fill = self.fill(m);
        let p = info.priority;
        let capacity = self.cfg.models[m].queue_capacity;
        // Tasks put back by a retry or preemption, or taken by an immediate
        // step, were admitted once: they do not count against the bound.
        // (Counted only when it could matter: overflow tasks are a few.)
        let queued = match self.waiting[m].len() {
            n if n < capacity => n,
            _ => self.waiting[m].iter().filter(|w| !w.overflow).count(),
        };
        let full = queued >= capacity || self.cfg.max_queued.is_some_and(|cap| self.total_waiting >= cap);
        // P0 may exceed a full queue by a tenth, so alarms still queue.
        let p0_room = queued < capacity + capacity / 10 + 1
            && self.cfg.max_queued.is_none_or(|cap| self.total_waiting < cap + cap / 10 + 1);
        if link.immediate {
            // An alternative to waiting: only if it can start now.
            let mem_bytes = self.memory_estimate(m, info.input_tokens, info.max_output_tokens);
            let probe = Waiting {
                info: info.clone(),
                seq: 0,
                enqueued_at: now,
                tag: 0.0,
                mem_bytes,
                step: link.step,
                candidates: link.instances.clone(),
                avoid: Vec::new(),
                overflow: true,
                passed: Vec::new(),
            };
            // Slots other tasks of an immediate step were promised and not
            // granted yet (admissions of one batch come before its
            // dispatch) are not free.
            let promised = |i: usize| {
                self.waiting
                    .iter()
                    .flatten()
                    .filter(|w| w.overflow && w.avoid.is_empty() && w.candidates.contains(&i))
                    .filter(|w| matches!(w.step, FallbackStep::EdgeNode | FallbackStep::Cloud))
                    .count()
            };
            let free = |i: usize| self.instances[i].running + promised(i) < self.cfg.instances[i].max_concurrency;
            if !link.instances.iter().any(|&i| self.eligible(&probe, i) && free(i)) {
                return Err(Refusal::Capacity(busy(
                    ErrorCode::QueueFull,
                    format!("no {} instance of '{}' has a free slot", link.step.as_str(), self.cfg.models[m].name),
                    retry,
                )));
            }
        } else if (full && p != Priority::P0) || (p == Priority::P0 && !p0_room) {
            return Err(Refusal::Capacity(busy(
                ErrorCode::QueueFull,
                format!("the queue of model '{}' is full", self.cfg.models[m].name),
                retry,
            )));
        }
        let deferred = (p == Priority::P4 && fill >= bp.refuse_p4) || (p == Priority::P3 && fill >= bp.refuse_p3);
        if deferred && !link.immediate {
            return Err(Refusal::Capacity(busy(
                ErrorCode::QueueFull,
                format!("under load: {} work is deferred, retry later", p.as_str()),
                retry * 2,
            )));
        }
        let mut queue_wait_factor = None;
        if p >= Priority::P3 && fill >= bp.shorten_low_waits && !link.immediate {
            queue_wait_factor = Some(0.25);
        }
        if p >= Priority::P2
            && fill >= bp.cap_output
            && !link.immediate
            && info.max_output_tokens > bp.capped_output_tokens
        {
            info.max_output_tokens = bp.capped_output_tokens;
            degrade = Some(format!("output budget capped at {} tokens under load", bp.capped_output_tokens));
        }

        // Queue caps per application and user.
        let user_key = (info.app.clone(), info.user.clone());
        let app_c = self.app_counts.get(&info.app).map(|c| c.queued).unwrap_or(0);
        let user_c = self.user_counts.get(&user_key).map(|c| c.queued).unwrap_or(0);
        if again.is_some() {
            // Counted, charged and tagged at its first admission.
        } else if app.max_queued.is_some_and(|cap| app_c >= cap) {
            return Err(Refusal::Final(busy(
                ErrorCode::QueueFull,
                format!("application '{}' has too many waiting tasks", info.app),
                retry,
            )));
        }
        // The platform's own tasks (a session's summary) answer to their
        // application's limits, not to one user's shared by all of them.
        let per_user = !crate::task::is_platform_user(&info.user);
        if again.is_none() && per_user && app.user_max_queued.is_some_and(|cap| user_c >= cap) {
            return Err(Refusal::Final(busy(
                ErrorCode::QueueFull,
                "this user has too many waiting tasks".into(),
                retry,
            )));
        }

        // Rates, charged last so a refused task costs nothing; a task
        // another node forwarded here was charged there, where its caller
        // called (its queue caps still hold here).
        let rated = again.is_none() && per_user && !info.forwarded;
        let rpm = app.user_requests_per_minute.filter(|_| rated);
        if let Some(rpm) = rpm {
            if !self.rpm.contains_key(&user_key) {
                Self::make_room_for_bucket(&mut self.rpm, &self.cfg, now, |a| {
                    a.user_requests_per_minute.map(f64::from)
                });
            }
            let b = self.rpm.entry(user_key.clone()).or_insert(Bucket { tokens: f64::from(rpm), at: now });
            if let Err(ms) = b.take(now, f64::from(rpm), 1.0) {
                return Err(Refusal::Final(busy(
                    ErrorCode::RateLimited,
                    format!("more than {rpm} requests per minute"),
                    ms,
                )));
            }
        }
        let charged = u64::from(info.input_tokens) + u64::from(info.max_output_tokens);
        if let Some(tpm) = app.user_tokens_per_minute.filter(|_| rated) {
            if !self.tpm.contains_key(&user_key) {
                Self::make_room_for_bucket(&mut self.tpm, &self.cfg, now, |a| {
                    a.user_tokens_per_minute.map(|t| t as f64)
                });
            }
            let b = self.tpm.entry(user_key.clone()).or_insert(Bucket { tokens: tpm as f64, at: now });
            if let Err(ms) = b.take(now, tpm as f64, charged as f64) {
                if let (Some(rpm), Some(b)) = (app.user_requests_per_minute, self.rpm.get_mut(&user_key)) {
                    b.refund(f64::from(rpm), 1.0);
                }
                return Err(Refusal::Final(busy(
                    ErrorCode::QuotaExceeded,
                    format!("more than {tpm} tokens per minute"),
                    ms,
                )));
            }
        }

        // Weighted fair queueing tag of the task's flow.
        let (seq, enqueued_at, tag) = match again {
            Some(kept) => kept,
            None => {
                let weight = app.weight * self.cfg.tenant_weights.get(&info.tenant).copied().unwrap_or(1.0);
                let cost = 1.0 + f64::from(info.input_tokens) / 2048.0;
                let flow = (info.tenant.clone(), info.app.clone());
                let start = self.flow_finish.get(&flow).copied().unwrap_or(0.0).max(self.vtime);
                let tag = start + cost / weight.max(1e-6);
                self.flow_finish.insert(flow, tag);
                self.seq += 1;
                (self.seq, now, tag)
            }
        };
        let mem_bytes = self.memory_estimate(m, info.input_tokens, info.max_output_tokens);
        self.app_counts.entry(info.app.clone()).or_default().queued += 1;
        self.user_counts.entry(user_key).or_default().queued += 1;
        let task_id = info.task_id.clone();
        let max_output_tokens = info.max_output_tokens;
        self.waiting[m].push(Waiting {
            info,
            seq,
            enqueued_at,
            tag,
            mem_bytes,
            step: link.step,
            candidates: link.instances.clone(),
            avoid: Vec::new(),
            overflow: link.immediate,
            passed: Vec::new(),
        });
        self.total_waiting += 1;
        let position = self.position(&task_id, now).unwrap_or(0);
        let lane = self.lane_wait(m, &task_id);
        Ok(Admission {
            position,
            max_output_tokens,
            queue_wait_factor,
            degrade_reason: degrade,
            lane,
            step: link.step,
            model: m,
            passed: Vec::new(),
        })
    }

    fn effective(&self, w: &Waiting, now: Duration) -> Priority {
        let base = w.info.priority;
        match self.cfg.aging {
            Some(period) if base > Priority::P1 && !period.is_zero() => {
                let levels = (now.saturating_sub(w.enqueued_at).as_nanos() / period.as_nanos()) as usize;
                let idx = base.index().saturating_sub(levels).max(Priority::P1.index());
                Priority::ALL[idx]
            }
            _ => base,
        }
    }

    fn key(&self, w: &Waiting, now: Duration) -> Key {
        (self.effective(w, now), w.tag, w.seq)
    }

    /// How many tasks of the same model would be dispatched before it.
    pub fn position(&self, task_id: &str, now: Duration) -> Option<usize> {
        let q = self.waiting.iter().find(|q| q.iter().any(|w| w.info.task_id == task_id))?;
        let me = q.iter().find(|w| w.info.task_id == task_id)?;
        let k = self.key(me, now);
        Some(q.iter().filter(|w| cmp_key(&self.key(w, now), &k).is_lt()).count())
    }

    /// The position of every waiting task (as `position` gives it), model by
    /// model, in one pass: O(n log n) per queue.
    pub fn positions(&self, now: Duration) -> Vec<(&str, usize)> {
        let mut out = Vec::with_capacity(self.total_waiting);
        for q in &self.waiting {
            let mut keyed: Vec<(Key, &str)> = q.iter().map(|w| (self.key(w, now), w.info.task_id.as_str())).collect();
            // Keys are unique (they end with the arrival number).
            keyed.sort_by(|a, b| cmp_key(&a.0, &b.0));
            out.extend(keyed.into_iter().enumerate().map(|(i, (_, id))| (id, i)));
        }
        out
    }

    /// Whether `w` may start on `instance` now.
    fn eligible(&self, w: &Waiting, instance: usize) -> bool {
        self.eligible_freed(w, instance, None)
    }

    /// Whether `w` may start on `instance` now, or (`freed`) once that
    /// running task there has given up its slot.
    fn eligible_freed(&self, w: &Waiting, instance: usize, freed: Option<&Running>) -> bool {
        let inst = &self.instances[instance];
        let ip = &self.cfg.instances[instance];
        // What the freed task holds, in each count it is part of.
        let f = |same: bool| usize::from(freed.is_some_and(|_| same));
        let running = inst.running - f(true);
        let mem_used = inst.mem_used - freed.map_or(0, |r| r.mem_bytes);
        if !inst.up || inst.paused || running >= ip.max_concurrency || !self.class_allows(w.info.class, instance) {
            return false;
        }
        match inst.breaker {
            BreakerState::Closed => {}
            BreakerState::Open => return false,
            // One trial request at a time.
            BreakerState::HalfOpen if running > 0 => return false,
            BreakerState::HalfOpen => {}
        }
        // An instance an earlier attempt failed on, only when no other
        // candidate could ever take the task.
        if w.avoid.contains(&instance)
            && w.candidates.iter().any(|&c| !w.avoid.contains(&c) && self.serving(c) && !self.instances[c].paused)
        {
            return false;
        }
        // P2-P4 leave the reserved slots free for alarms.
        let realtime = w.info.priority <= Priority::P1;
        if !realtime && running >= ip.max_concurrency.saturating_sub(ip.reserved_realtime_slots) {
            return false;
        }
        if let Some(b) = ip.memory_budget_bytes {
            if mem_used + w.mem_bytes + self.weights_to_load(w.info.model, instance) > b {
                return false;
            }
        }
        if running > 0 && self.kv_cache_full(instance) {
            return false;
        }
        if !self.lane_open(&w.info, instance, freed) {
            return false;
        }
        let m = w.info.model;
        let same_model = freed.is_some_and(|r| r.info.model == m);
        if self.cfg.models[m].max_running.is_some_and(|cap| self.model_running[m] - f(same_model) >= cap) {
            return false;
        }
        if self.cfg.max_running.is_some_and(|cap| self.running.len() - f(true) >= cap) {
            return false;
        }
        let app = self.app(&w.info.app);
        let same_app = freed.is_some_and(|r| r.info.app == w.info.app);
        let app_running = self.app_counts.get(&w.info.app).map(|c| c.running).unwrap_or(0) - f(same_app);
        if app.max_running.is_some_and(|cap| app_running >= cap) {
            return false;
        }
        let uk = (w.info.app.clone(), w.info.user.clone());
        let same_user = same_app && freed.is_some_and(|r| r.info.user == w.info.user);
        let user_running = self.user_counts.get(&uk).map(|c| c.running).unwrap_or(0) - f(same_user);
        let per_user = !crate::task::is_platform_user(&w.info.user);
        if per_user && app.user_max_running.is_some_and(|cap| user_running >= cap) {
            return false;
        }
        true
    }

    /// The next task to start and where, if any may start now.
    pub fn next_grant(&mut self, now: Duration) -> Option<Grant> {
        // (key, model, index in its queue, instance)
        let mut best: Option<(Key, usize, usize, usize)> = None;
        // Slot views do not change while we look: build them once.
        let views = self.views();
        let mut decided = "";
        for (m, q) in self.waiting.iter().enumerate() {
            for (idx, w) in q.iter().enumerate() {
                let k = self.key(w, now);
                if best.as_ref().is_some_and(|(bk, ..)| cmp_key(bk, &k).is_le()) {
                    continue;
                }
                // The best eligible instance of the task's step.
                if let Some((i, why)) = router::pick(&w.candidates, &views, |i| self.eligible(w, i)) {
                    best = Some((k, m, idx, i));
                    decided = why;
                }
            }
        }
        let (_, m, idx, mut instance) = best?;
        // The task is chosen (priority and fairness decided); its session's
        // last instance instead of the pick only when it has a free slot,
        // may run the task and is no busier, colder, worse, dearer or
        // farther than the pick (`affinity.rs`, `router::may_stand_in`).
        let w = &self.waiting[m][idx];
        let usable = |i: usize| {
            w.candidates.contains(&i)
                && views[i].has_free_slot()
                && self.eligible(w, i)
                && router::may_stand_in(&views[i], &views[instance])
        };
        if let Some(i) = self.affinity.prefer(w.info.affinity.as_deref(), instance, usable) {
            instance = i;
            decided = "affinity";
        }
        let w = self.waiting[m].swap_remove(idx);
        self.total_waiting -= 1;
        self.vtime = self.vtime.max(w.tag - 1e-9);
        let uk = (w.info.app.clone(), w.info.user.clone());
        if let Some(c) = self.app_counts.get_mut(&w.info.app) {
            c.queued -= 1;
            c.running += 1;
        }
        if let Some(c) = self.user_counts.get_mut(&uk) {
            c.queued -= 1;
            c.running += 1;
        }
        let prefill = self.long_prompt(&w.info, instance).unwrap_or(0);
        let inst = &mut self.instances[instance];
        inst.running += 1;
        inst.long_prefill += prefill;
        if w.info.priority <= Priority::P1 {
            inst.running_realtime += 1;
        }
        let weights = self.weights_to_load(m, instance);
        let inst = &mut self.instances[instance];
        inst.mem_used += w.mem_bytes + weights;
        inst.resident_weights.get_or_insert(weights);
        if let Some(b) = self.cfg.instances[instance].memory_budget_bytes {
            debug_assert!(inst.mem_used <= b, "a grant took an instance over its memory budget");
        }
        self.model_running[m] += 1;
        let task_id = w.info.task_id.clone();
        let slot = self.affinity.start(&task_id, w.info.affinity.as_deref(), instance);
        let charged_output = u64::from(w.info.max_output_tokens);
        let max_output_tokens = w.info.max_output_tokens;
        self.running.insert(
            task_id.clone(),
            Running {
                info: w.info,
                instance,
                mem_bytes: w.mem_bytes,
                charged_output,
                step: w.step,
                candidates: w.candidates,
                avoid: w.avoid,
                started_at: now,
                not_preemptible: false,
                prefill,
            },
        );
        Some(Grant {
            task_id,
            instance,
            model: m,
            step: w.step,
            decided_by: decided,
            max_output_tokens,
            passed: w.passed,
            slot,
        })
    }

    /// The prompt tokens `info` counts in `instance`'s long-prompt lane:
    /// `Some` when the instance has one and the prompt is long there.
    fn long_prompt(&self, info: &TaskInfo, instance: usize) -> Option<u64> {
        let ip = &self.cfg.instances[instance];
        ip.max_prefill_tokens
            .filter(|_| info.input_tokens > ip.long_prompt_tokens)
            .map(|_| u64::from(info.input_tokens))
    }

    /// Whether the long-prompt lane of `instance` lets `info` start (once
    /// `freed` gave up its slot there): a short prompt always; a long one
    /// while the long prefill in flight leaves room for it, or none is in
    /// flight (a prompt over the whole cap runs alone).
    fn lane_open(&self, info: &TaskInfo, instance: usize, freed: Option<&Running>) -> bool {
        let Some(tokens) = self.long_prompt(info, instance) else { return true };
        let cap = self.cfg.instances[instance].max_prefill_tokens.unwrap_or(u64::MAX);
        let in_flight = self.instances[instance].long_prefill - freed.map_or(0, |r| r.prefill);
        in_flight == 0 || in_flight + tokens <= cap
    }

    /// The running task has its first token: its prompt is no longer in
    /// prefill, and leaves its instance's long-prompt lane.
    pub fn prefilled(&mut self, task_id: &str) {
        if let Some(r) = self.running.get_mut(task_id) {
            self.instances[r.instance].long_prefill -= std::mem::take(&mut r.prefill);
        }
    }

    /// Why waiting task `task_id` (of model `m`) waits for the long-prompt
    /// lane, if that is what keeps it from every candidate instance where
    /// it is long (for the QUEUED record).
    pub fn lane_wait(&self, m: usize, task_id: &str) -> Option<String> {
        let w = self.waiting[m].iter().find(|w| w.info.task_id == task_id)?;
        let mut shut = w.candidates.iter().filter(|&&i| self.long_prompt(&w.info, i).is_some()).peekable();
        shut.peek()?;
        let mut why = Vec::new();
        for &i in shut {
            if self.lane_open(&w.info, i, None) {
                return None;
            }
            let ip = &self.cfg.instances[i];
            why.push(format!(
                "{}: {} of max_prefill_tokens {} in prefill",
                ip.name,
                self.instances[i].long_prefill,
                ip.max_prefill_tokens.unwrap_or(0)
            ));
        }
        Some(format!(
            "long prompt ({} tokens over long_prompt_tokens) waits for the long-prompt lane ({})",
            w.info.input_tokens,
            why.join(", ")
        ))
    }

    /// What [`router::pick`] sees of each instance.
    fn views(&self) -> Vec<InstanceView> {
        self.instances
            .iter()
            .zip(&self.cfg.instances)
            .map(|(st, ip)| InstanceView {
                up: st.up && !st.paused && st.breaker != BreakerState::Open,
                running: st.running,
                max_concurrency: ip.max_concurrency,
                half_open: st.breaker == BreakerState::HalfOpen,
                kv_cache_usage: st.kv_cache_usage,
                // Only an engine that says its model is out of memory
                // (Ollama after keep_alive) makes a load time likely.
                loaded: st.reported_resident != Some(false) || st.running > 0,
                error_rate: st.error_rate,
                ttft_p95_ms: st.ttft_p95_ms,
                cost: ip.cost,
                location: ip.location,
            })
            .collect()
    }

    /// Puts a running task back at the front of its priority in its queue
    /// (its slot is freed): an attempt failed before any output and is to
    /// be retried (`avoid`: the instance it failed on), or it was
    /// preempted. It keeps its place in the chain and its rate charges;
    /// the queue's bound does not apply (it was admitted once).
    pub fn requeue(&mut self, task_id: &str, avoid: Option<usize>, now: Duration) -> Option<(usize, usize, Priority)> {
        let r = self.running.get(task_id)?;
        let (info, step, mut candidates, mut avoided, charged) =
            (r.info.clone(), r.step, r.candidates.clone(), r.avoid.clone(), r.charged_output);
        let instance = self.release(task_id, charged)?;
        if let Some(a) = avoid {
            if !avoided.contains(&a) {
                avoided.push(a);
            }
        }
        candidates.retain(|&i| self.class_allows(info.class, i));
        let m = info.model;
        let priority = info.priority;
        self.seq += 1;
        let uk = (info.app.clone(), info.user.clone());
        self.app_counts.entry(info.app.clone()).or_default().queued += 1;
        self.user_counts.entry(uk).or_default().queued += 1;
        let mem_bytes = self.memory_estimate(m, info.input_tokens, info.max_output_tokens);
        self.waiting[m].push(Waiting {
            info,
            seq: self.seq,
            enqueued_at: now,
            // Ahead of every task of its priority that has not started.
            tag: f64::NEG_INFINITY,
            mem_bytes,
            step,
            candidates,
            avoid: avoided,
            overflow: true,
            passed: Vec::new(),
        });
        self.total_waiting += 1;
        Some((instance, m, priority))
    }

    /// Running tasks to preempt so that waiting P0 tasks get a slot: for
    /// each P0 task (by base priority) that no candidate instance can take
    /// now, the most recently started running task on one of its
    /// candidates whose application lets it be preempted at its priority
    /// (`preemptible_from`, P3 or P4 at most) and whose slot the P0 task
    /// could then take, not asked already. The caller asks each victim's
    /// driver, which agrees while none of its output went out or the output
    /// can be taken back, and answers with [`Policy::preemption_answered`]
    /// (declined) or a [`Policy::requeue`].
    pub fn preemption_victims(&mut self) -> Vec<(String, String)> {
        // Called after every dispatch: nothing waiting is the common case.
        if !self.cfg.preemption || self.total_waiting == 0 {
            return Vec::new();
        }
        let views = self.views();
        let mut blocked: Vec<(u64, &Waiting)> = Vec::new();
        for w in self.waiting.iter().flatten() {
            if w.info.priority == Priority::P0
                && !self.preempting.values().any(|p0| *p0 == w.info.task_id)
                && router::pick(&w.candidates, &views, |i| self.eligible(w, i)).is_none()
            {
                blocked.push((w.seq, w));
            }
        }
        blocked.sort_by_key(|(seq, _)| *seq);
        let mut chosen: Vec<(String, String)> = Vec::new();
        for (_, w) in blocked {
            // Only a victim whose slot the P0 task could really take: one
            // blocked by its own limits would only make the victim churn.
            let victim = self
                .running
                .iter()
                .filter(|(id, r)| {
                    !r.not_preemptible
                        && !chosen.iter().any(|(_, v)| v == *id)
                        && r.info.priority >= Priority::P3
                        && w.candidates.contains(&r.instance)
                        && self.app(&r.info.app).preemptible_from.is_some_and(|from| r.info.priority >= from)
                        && self.eligible_freed(w, r.instance, Some(r))
                })
                .max_by_key(|(_, r)| (r.started_at, r.info.priority))
                .map(|(id, _)| id.clone());
            if let Some(id) = victim {
                chosen.push((w.info.task_id.clone(), id));
            }
        }
        let mut out = Vec::new();
        for (p0, id) in chosen {
            if let Some(r) = self.running.get_mut(&id) {
                r.not_preemptible = true;
            }
            self.preempting.insert(id.clone(), p0.clone());
            out.push((p0, id));
        }
        out
    }

    /// The answer to a preemption asked by [`Policy::preemption_victims`]
    /// came (the victim was re-queued, refused because output had gone
    /// out, or ended): its P0 task may ask for another victim if it still
    /// waits. A refused victim is never asked again.
    pub fn preemption_answered(&mut self, victim: &str) {
        self.preempting.remove(victim);
    }

    /// A reload replaced instance `old` (retired) by `new`, of the same
    /// engine: tasks queued for `old`, and running ones should they be
    /// retried, now have `new` as their candidate, and wait for it while
    /// it comes up (see [`Self::stranded`]).
    pub fn replace_instance(&mut self, old: usize, new: usize) {
        self.instances[new].replacement = true;
        let lists = self.waiting.iter_mut().flatten().map(|w| &mut w.candidates);
        for c in lists.chain(self.running.values_mut().map(|r| &mut r.candidates)).flatten() {
            if *c == old {
                *c = new;
            }
        }
    }

    /// Waiting tasks none of whose candidate instances is up any more
    /// (`serving`: none is up with its breaker not open), with whether
    /// any is still up. A task that has a replacement instance still
    /// coming up is not stranded: it waits for it.
    pub fn stranded(&self) -> Vec<(String, bool)> {
        self.waiting
            .iter()
            .flatten()
            .filter(|w| !w.candidates.iter().any(|&i| self.serving(i)))
            .filter(|w| !w.candidates.iter().any(|&i| self.instances[i].replacement && self.instances[i].restarting))
            .map(|w| {
                let back = w.candidates.iter().any(|&i| self.instances[i].up || self.instances[i].restarting);
                (w.info.task_id.clone(), back)
            })
            .collect()
    }

    /// The model a waiting task's request named.
    pub fn waiting_requested(&self, task_id: &str) -> Option<usize> {
        self.waiting.iter().flatten().find(|w| w.info.task_id == task_id).map(|w| w.info.requested)
    }

    /// Moves a waiting task to the next step of its chain that can take it
    /// (a smaller model, an edge node, the canned answer, cloud), as if it
    /// were admitted now: its instances all went down or opened their
    /// breakers while it waited (`why` = `went_down`), or an attempt on the
    /// only instance its step had failed (`failed`). Returns the new terms
    /// (for the canned answer the task has left the queue: its driver
    /// answers), or `None` when no step can (the task still waits where it
    /// was).
    pub fn reroute(&mut self, task_id: &str, now: Duration, why: &'static str, detail: &str) -> Option<Admission> {
        let w = self.waiting.iter().flatten().find(|w| w.info.task_id == task_id)?;
        let (info, step) = (w.info.clone(), w.step);
        let mut requested = info.clone();
        requested.model = info.requested;
        let links: Vec<Link> = self.chain(&requested).into_iter().filter(|l| l.step > step).collect();
        let mut passed = vec![passed_over(step, why, detail)];
        for link in links {
            if link.step == FallbackStep::Canned {
                self.take_waiting(task_id)?;
                return Some(Admission {
                    position: 0,
                    max_output_tokens: info.max_output_tokens,
                    queue_wait_factor: None,
                    degrade_reason: None,
                    lane: None,
                    step: link.step,
                    model: info.requested,
                    passed,
                });
            }
            if link.instances.is_empty() || !link.instances.iter().any(|&i| self.serving(i)) {
                continue;
            }
            let mut task = info.clone();
            task.model = link.model;
            // Withdraw first so the queue caps count it once; put it back
            // if the step refuses.
            let original = self.take_waiting(task_id)?;
            let kept = (original.seq, original.enqueued_at, original.tag);
            match self.admit_on(task, &link, now, Some(kept)) {
                Ok(mut a) => {
                    if let Some(nw) = self.waiting[link.model].iter_mut().find(|w| w.info.task_id == task_id) {
                        nw.passed = passed.clone();
                    }
                    a.passed = passed;
                    return Some(a);
                }
                Err(Refusal::Capacity(e)) | Err(Refusal::Final(e)) => {
                    passed.push(passed_over(link.step, "no_room", e.message));
                    self.put_back(original);
                }
            }
        }
        None
    }

    /// Whether a waiting task has a candidate instance other than those an
    /// earlier attempt failed on that serves (up, breaker not open).
    pub fn has_fresh_candidate(&self, task_id: &str) -> bool {
        self.waiting
            .iter()
            .flatten()
            .find(|w| w.info.task_id == task_id)
            .is_some_and(|w| w.candidates.iter().any(|&c| !w.avoid.contains(&c) && self.serving(c)))
    }

    /// Takes a waiting task out without refunds (to be put back or moved).
    fn take_waiting(&mut self, task_id: &str) -> Option<Waiting> {
        for q in &mut self.waiting {
            if let Some(idx) = q.iter().position(|w| w.info.task_id == task_id) {
                let w = q.swap_remove(idx);
                self.total_waiting -= 1;
                let uk = (w.info.app.clone(), w.info.user.clone());
                if let Some(c) = self.app_counts.get_mut(&w.info.app) {
                    c.queued -= 1;
                }
                if let Some(c) = self.user_counts.get_mut(&uk) {
                    c.queued -= 1;
                }
                return Some(w);
            }
        }
        None
    }

    fn put_back(&mut self, w: Waiting) {
        let uk = (w.info.app.clone(), w.info.user.clone());
        self.app_counts.entry(w.info.app.clone()).or_default().queued += 1;
        self.user_counts.entry(uk).or_default().queued += 1;
        self.total_waiting += 1;
        let m = w.info.model;
        self.waiting[m].push(w);
    }

    /// Takes a waiting task out (cancelled or timed out). Its rate charge
    /// for output it will never produce is refunded.
    pub fn withdraw(&mut self, task_id: &str) -> bool {
        let Some(w) = self.take_waiting(task_id) else { return false };
        let uk = (w.info.app.clone(), w.info.user.clone());
        let app = self.app(&w.info.app);
        if let (Some(tpm), Some(b)) = (app.user_tokens_per_minute, self.tpm.get_mut(&uk)) {
            b.refund(tpm as f64, f64::from(w.info.max_output_tokens));
        }
        self.forget_idle_user(&uk);
        true
    }

    /// Frees the slot of a granted task; `output_tokens` is what it really
    /// produced (the rest of its token-rate charge is refunded).
    pub fn release(&mut self, task_id: &str, output_tokens: u64) -> Option<usize> {
        let r = self.running.remove(task_id)?;
        self.affinity.end(task_id);
        self.preempting.remove(task_id);
        let inst = &mut self.instances[r.instance];
        inst.running -= 1;
        inst.long_prefill -= r.prefill;
        if r.info.priority <= Priority::P1 {
            inst.running_realtime -= 1;
        }
        inst.mem_used -= r.mem_bytes;
        self.model_running[r.info.model] -= 1;
        let uk = (r.info.app.clone(), r.info.user.clone());
        if let Some(c) = self.app_counts.get_mut(&r.info.app) {
            c.running -= 1;
        }
        if let Some(c) = self.user_counts.get_mut(&uk) {
            c.running -= 1;
        }
        let app = self.app(&r.info.app);
        if let (Some(tpm), Some(b)) = (app.user_tokens_per_minute, self.tpm.get_mut(&uk)) {
            b.refund(tpm as f64, r.charged_output.saturating_sub(output_tokens) as f64);
        }
        self.forget_idle_user(&uk);
        Some(r.instance)
    }

    /// A user with nothing waiting or running needs no counts: callers
    /// name users freely, so the map holds only the active ones.
    fn forget_idle_user(&mut self, uk: &(String, String)) {
        if self.user_counts.get(uk).is_some_and(|c| c.queued == 0 && c.running == 0) {
            self.user_counts.remove(uk);
        }
    }

    /// Drops the rate buckets that have refilled: a full bucket is what a
    /// user without one gets, so only users charged within the last minute
    /// keep one. Called every [`SWEEP_EVERY`] admissions.
    fn sweep_buckets(&mut self, now: Duration) {
        let apps = &self.cfg.apps;
        let full = |b: &Bucket, rate: Option<f64>| match rate {
            Some(rate) => b.tokens + now.saturating_sub(b.at).as_secs_f64() * rate / 60.0 >= rate,
            None => true,
        };
        let rate = |app: &str, f: fn(&AppLimits) -> Option<f64>| apps.get(app).and_then(f);
        self.rpm.retain(|(app, _), b| !full(b, rate(app, |a| a.user_requests_per_minute.map(f64::from))));
        self.tpm.retain(|(app, _), b| !full(b, rate(app, |a| a.user_tokens_per_minute.map(|t| t as f64))));
    }

    /// Keeps `buckets` below `max_tracked_users` before one more is made:
    /// past it, the tenth closest to full (refill counted) is forgotten. A
    /// forgotten user starts again from a full bucket, which is nearly what
    /// it had, while the users a limit is holding back (near-empty
    /// buckets) keep theirs: a flood of made-up user names costs a bounded
    /// map and lifts no one's limit.
    fn make_room_for_bucket(
        buckets: &mut HashMap<(String, String), Bucket>,
        cfg: &PolicyConfig,
        now: Duration,
        rate: fn(&AppLimits) -> Option<f64>,
    ) {
        let cap = cfg.max_tracked_users.max(1);
        if buckets.len() < cap {
            return;
        }
        let fill = |(app, _): &(String, String), b: &Bucket| match cfg.apps.get(app).and_then(rate) {
            Some(r) if r > 0.0 => ((b.tokens + now.saturating_sub(b.at).as_secs_f64() * r / 60.0) / r).min(1.0),
            _ => 1.0,
        };
        // Down to 90 % of the cap (at least one free place): the scan is
        // paid once per tenth of the cap of new users.
        let cut = buckets.len() - (cap - cap / 10).min(cap - 1);
        let mut fills: Vec<f64> = buckets.iter().map(|(k, b)| fill(k, b)).collect();
        let (_, threshold, _) = fills.select_nth_unstable_by(cut - 1, |a, b| b.total_cmp(a));
        let threshold = *threshold;
        let mut removed = 0;
        buckets.retain(|k, b| {
            let forget = removed < cut && fill(k, &*b) >= threshold;
            removed += usize::from(forget);
            !forget
        });
    }

    /// Invariant checks for tests: counters agree with the task sets.
    #[cfg(test)]
    fn check(&self) {
        for (i, inst) in self.instances.iter().enumerate() {
            let here: Vec<&Running> = self.running.values().filter(|r| r.instance == i).collect();
            assert_eq!(inst.running, here.len());
            assert!(inst.running <= self.cfg.instances[i].max_concurrency, "slots exceeded");
            let general = here.iter().filter(|r| r.info.priority > Priority::P1).count();
            let ip = &self.cfg.instances[i];
            assert!(general <= ip.max_concurrency - ip.reserved_realtime_slots, "reserved slot used by P2-P4");
            let prefill: u64 = here.iter().map(|r| r.prefill).sum();
            assert_eq!(inst.long_prefill, prefill, "long-prompt lane accounting");
            if let Some(cap) = self.cfg.instances[i].max_prefill_tokens {
                // Over the cap only by one prompt that runs alone.
                let alone = here.iter().filter(|r| r.prefill > 0).count() <= 1;
                assert!(prefill <= cap || alone, "long-prompt lane over its cap");
            }
            let kv: u64 = here.iter().map(|r| r.mem_bytes).sum();
            assert_eq!(inst.mem_used, kv + inst.resident_weights.unwrap_or(0), "memory accounting");
            if let Some(b) = ip.memory_budget_bytes {
                // Only weights the engine loaded by itself, while none of
                // ours ran, may exceed it (a model bigger than the budget).
                assert!(inst.mem_used <= b || inst.running == 0, "memory budget exceeded");
            }
        }
        for (m, q) in self.waiting.iter().enumerate() {
            let cap = self.cfg.models[m].queue_capacity;
            let queued = q.iter().filter(|w| !w.overflow).count();
            assert!(queued <= cap + cap / 10 + 1, "queue bound exceeded");
            if let Some(c) = self.cfg.models[m].max_running {
                assert!(self.model_running[m] <= c);
            }
        }
        for (app, c) in &self.app_counts {
            let a = self.app(app);
            if let Some(cap) = a.max_running {
                assert!(c.running <= cap, "app running cap exceeded");
            }
        }
        if let Some(cap) = self.cfg.max_running {
            assert!(self.running.len() <= cap);
        }
    }
}

/// Dispatch order: effective priority, fair-queueing tag, arrival.
type Key = (Priority, f64, u64);

fn cmp_key(a: &Key, b: &Key) -> std::cmp::Ordering {
    a.0.cmp(&b.0).then(a.1.total_cmp(&b.1)).then(a.2.cmp(&b.2))
}

#[cfg(test)]
mod tests;
