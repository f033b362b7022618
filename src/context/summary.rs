//! Session summaries (FR-3.3): when a session's history has outgrown its
//! share of the window, its oldest turns are summarised by the configured
//! summary model (`[sessions] summary_model`), through the same scheduler
//! as every call, at its own low priority, output budget and deadline.
//!
//! The trigger, checked after each turn is appended: the recent turns that
//! fit `summary_history_share_pct` of the turn's model window start at
//! message `cut` (opened at a question, as the assembly opens a window);
//! once `cut` is `summary_after_messages` or more past what the current
//! summary covers, a summary task is submitted for the messages between
//! them, with the current summary as its starting point, so each summary
//! costs only the turns it adds. The new summary covers the session's
//! first `cut` messages and replaces the old one (version + 1). One summary
//! task runs per session at a time; a summary that is refused, times out
//! or fails leaves the session as it was (its next turn is assembled
//! without the newer summary) and is tried again after a later turn.
//!
//! Owns: the trigger, the summary prompt, the summary task and its result.
//! Does not own: where the summary goes in a prompt (`super::assembly`,
//! which gets [`SessionSummary`] from the turn), nor where it is kept
//! (`super::sessions`, memory and store, text only under the data policy).

use std::sync::Arc;
use std::time::{Instant, SystemTime};

use serde_json::Value;
use sha2::{Digest, Sha256};

use super::sessions::{HistoryMessage, Sessions};
use crate::config::{Config, SummaryConfig};
use crate::error::ErrorCode;
use crate::scheduler::{SchedulerHandle, Submitted};
use crate::task::{ChatMessage, TaskEvent, TaskRequest, TaskState};
use crate::telemetry::lifecycle::Recorder;

/// The instruction of a summary task.
pub const SUMMARY_INSTRUCTION: &str = "You write the running summary of a conversation so that it can continue \
     without its older messages. Keep the facts, names, numbers, decisions and open questions; leave out \
     greetings and repetition. Answer with the summary only, in the conversation's language.";

/// The user a summary task runs as (review 14 L8): the platform's own, so
/// that it spends none of the caller's per-user limits (running, queued,
/// token rate) and a user's next turn never waits behind their own
/// summary. It still runs in the caller's tenant and application (their
/// records, their application's limits).
pub const SUMMARY_USER: &str = "edgeway:summary";

/// A session's summary of its oldest messages.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionSummary {
    pub text: String,
    /// How many of the session's oldest messages it replaces.
    pub covers: usize,
    /// 1 for the first summary, + 1 each time it is replaced.
    pub version: u32,
    /// The logical model that wrote it.
    pub model: String,
    /// Unix milliseconds.
    pub at_ms: i64,
}

/// Where the recent turns that fit `share_tokens` begin: the index of the
/// oldest message kept, opened at a question (never at an answer whose
/// question is left out). `history.len()` when none fits.
pub fn cut(history: &[HistoryMessage], share_tokens: u32) -> usize {
    let mut room = share_tokens;
    let mut first = history.len();
    while first > 0 && history[first - 1].tokens <= room {
        room -= history[first - 1].tokens;
        first -= 1;
    }
    while first < history.len() && history[first].message.role != "user" {
        first += 1;
    }
    first
}

/// The number of oldest messages a new summary should cover, when one is
/// due: `after` or more messages left out of the share and not covered.
pub fn due(history: &[HistoryMessage], covered: usize, share_tokens: u32, after: usize) -> Option<usize> {
    let cut = cut(history, share_tokens);
    (cut >= covered + after.max(1)).then_some(cut)
}

/// A message as a transcript line: its role and its text (the text parts
/// of content parts; an answer's tool calls by name).
fn line(m: &ChatMessage) -> String {
    let mut text = match &m.content {
        Value::String(s) => s.clone(),
        Value::Array(parts) => {
            parts.iter().filter_map(|p| p.get("text").and_then(Value::as_str)).collect::<Vec<_>>().join(" ")
        }
        _ => String::new(),
    };
    if let Some(Value::Array(calls)) = m.extra.get("tool_calls") {
        for c in calls {
            let name = c.pointer("/function/name").and_then(Value::as_str).unwrap_or("?");
            let args = c.pointer("/function/arguments").and_then(Value::as_str).unwrap_or("");
            text.push_str(&format!(" [called {name}({args})]"));
        }
    }
    format!("{}: {}", m.role, text)
}

/// The summary prompt for `previous` (the summary so far, if any) and the
/// messages `new` that follow what it covers, as many of them as fit
/// `room` tokens, cut before a question. Returns the prompt and how many of
/// `new` it holds; `None` when not even one turn fits.
pub fn prompt(previous: Option<&str>, new: &[HistoryMessage], room: u32) -> Option<(Vec<ChatMessage>, usize)> {
    let msg = |role: &str, text: String| ChatMessage {
        role: role.into(),
        content: Value::String(text),
        extra: Default::default(),
    };
    let mut take = new.len();
    loop {
        if take == 0 {
            return None;
        }
        let mut body = String::new();
        if let Some(p) = previous {
            body.push_str("Summary so far:\n");
            body.push_str(p);
            body.push_str("\n\nConversation that follows it:\n");
        } else {
            body.push_str("Conversation:\n");
        }
        for h in &new[..take] {
            body.push_str(&line(&h.message));
            body.push('\n');
        }
        let messages = vec![msg("system", SUMMARY_INSTRUCTION.to_string()), msg("user", body)];
        if super::estimate_tokens(&messages) <= room {
            return Some((messages, take));
        }
        // Fewer messages, still ending before a question.
        take -= 1;
        while take > 0 && new[take].message.role != "user" {
            take -= 1;
        }
    }
}

/// The handles a summary task needs, taken from the gateway.
#[derive(Clone)]
pub struct Summarizer {
    pub scheduler: SchedulerHandle,
    pub recorder: Recorder,
    pub sessions: Arc<Sessions>,
    /// `edgeway_context_summaries_total{outcome}`: `made`, `empty`,
    /// `failed` (refused, timed out, failed or cancelled), `too_large`
    /// (the turns do not fit the summary model).
    pub outcomes: prometheus::IntCounterVec,
}

impl Summarizer {
    /// After a turn of session `session_id` was appended: submits a summary
    /// task when one is due (see the module doc) and keeps its result.
    /// `turn` is the turn's own request (its caller, data class and
    /// routing carry over; its messages do not).
    ///
    /// # Cancel safety
    /// Meant to be spawned; dropping it drops the summary task's stream,
    /// which cancels the task, and the session keeps the summary it had.
    pub async fn after_turn(self, config: Arc<Config>, turn: TaskRequest, session_id: String) {
        let Some(cfg) = config.sessions.summary.clone() else { return };
        let (Some(turn_model), Some(summary_model)) =
            (config.models.get(&turn.logical_model), config.models.get(&cfg.model))
        else {
            return;
        };
        let share = (u64::from(turn_model.context_tokens) * u64::from(cfg.history_share_pct) / 100) as u32;
        let Some(job) = self.sessions.summary_due(&session_id, share, cfg.after_messages as usize) else { return };
        let room = summary_model.context_tokens.saturating_sub(cfg.max_tokens);
        let previous = job.previous.as_ref().map(|s| s.text.as_str());
        let Some((messages, taken)) = prompt(previous, &job.messages, room) else {
            self.outcomes.with_label_values(&["too_large"]).inc();
            tracing::warn!(session = %session_id, "the turns to summarise do not fit the summary model's window");
            return;
        };
        let covers = job.base + taken;
        let version = job.previous.as_ref().map_or(1, |s| s.version + 1);
        let req = request(&cfg, summary_model.max_output_tokens, turn, messages, &session_id, version);
        let task_id = req.task_id.clone();
        let outcome = self.run(req).await;
        let label = match &outcome {
            Ok(text) if !text.trim().is_empty() => "made",
            Ok(_) => "empty",
            Err(_) => "failed",
        };
        self.outcomes.with_label_values(&[label]).inc();
        match outcome {
            Ok(text) if !text.trim().is_empty() => {
                tracing::info!(session = %session_id, task_id, version, covers, "session summary made");
                job.keep(text.trim().to_string(), covers, cfg.model.clone());
            }
            Ok(_) => tracing::warn!(session = %session_id, task_id, "the summary came back empty; not kept"),
            Err(why) => tracing::warn!(session = %session_id, task_id, why, "no summary this time"),
        }
    }

    /// Runs a summary task to its end: its text, or why there is none.
    async fn run(&self, req: TaskRequest) -> Result<String, String> {
        self.recorder.received(&req);
        self.recorder.transition(&req, TaskState::Validating, "admitted; session summary", None, "gateway");
        let mut stream = match self.scheduler.submit(req.clone()).await {
            Ok(Submitted::New(s)) => s,
            // Not reachable (a summary has no idempotency key, the only
            // thing the scheduler judges repeats on); should it happen,
            // the record still ends rather than stay VALIDATING.
            Ok(Submitted::Known(existing)) => {
                let why = format!("a task with its idempotency key exists: {}", existing.task_id);
                self.recorder.refused(&req, ErrorCode::InternalError.as_str(), &why, "scheduler");
                return Err(why);
            }
            Err(e) => {
                self.recorder.refused(&req, e.code.as_str(), e.code.as_str(), "scheduler");
                return Err(e.code.as_str().to_string());
            }
        };
        let mut text = String::new();
        while let Some((_, ev)) = stream.recv().await {
            match ev {
                TaskEvent::Delta { text: t } => text.push_str(&t),
                TaskEvent::Done(m) if m.status == TaskState::Succeeded => return Ok(text),
                TaskEvent::Done(m) => return Err(m.status.as_str().to_string()),
                TaskEvent::Error { .. } => return Err("the task failed".into()),
                _ => {}
            }
        }
        Err("the task's events ended".into())
    }
}

/// The summary task: the turn's caller, the summary model, its priority
/// (never more urgent than the caller may use), output budget and
/// deadline, no session (it is not a turn) and no idempotency key, as the
/// platform's user ([`SUMMARY_USER`]). Its request id,
/// `summary/{session}/v{version}/{task id}`, names its session and is
/// unique (a retried version gets its own); admission refuses `/` in a
/// client's request id, so none can collide with it (review 14 L8). It
/// never leaves the box (`local_only`): it reads older turns, which may
/// have been sent under a stricter data class than the turn that made
/// the summary due (review 14 M6).
fn request(
    cfg: &SummaryConfig,
    model_max_output: u32,
    turn: TaskRequest,
    messages: Vec<ChatMessage>,
    session_id: &str,
    version: u32,
) -> TaskRequest {
    let mut req = turn;
    let limit = cfg.deadline;
    req.task_id = crate::task::new_task_id();
    req.request_id = format!("summary/{session_id}/v{version}/{}", req.task_id);
    req.identity.user_id = Some(SUMMARY_USER.to_string());
    // In the turn's trace, as a span of its own under the turn's.
    req.parent_span_id = Some(std::mem::replace(&mut req.span_id, crate::telemetry::trace::new_span_id()));
    req.logical_model = cfg.model.clone();
    req.priority = cfg.priority.max(req.identity.max_priority);
    req.max_output_tokens = cfg.max_tokens.min(model_max_output);
    req.timeouts.total = limit;
    req.timeouts.queue = req.timeouts.queue.min(limit);
    req.timeouts.first_token = req.timeouts.first_token.min(limit);
    req.timeouts.inference = req.timeouts.inference.min(limit);
    req.routing.local_only = true;
    req.session_id = None;
    req.idempotency_key = None;
    req.tools = None;
    req.params = Default::default();
    req.degrade_reason = None;
    req.prompt_sha256 = hex::encode(Sha256::digest(serde_json::to_vec(&messages).unwrap_or_default()));
    req.input_tokens_estimate = super::estimate_tokens(&messages);
    req.messages = messages;
    req.received_at = Instant::now();
    req.received_wall = SystemTime::now();
    req
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hist(role: &str, text: &str) -> HistoryMessage {
        let message = ChatMessage { role: role.into(), content: Value::String(text.into()), extra: Default::default() };
        HistoryMessage { tokens: crate::context::estimate_message(&message), message }
    }

    fn turns(n: usize) -> Vec<HistoryMessage> {
        (0..n)
            .flat_map(|i| [hist("user", &format!("question {i}")), hist("assistant", &format!("answer {i}"))])
            .collect()
    }

    #[test]
    fn a_summary_is_due_once_enough_messages_left_the_share() {
        let h = turns(10); // 20 messages
        let each: u32 = h[0].tokens + h[1].tokens;
        // Room for 3 turns: the window starts at message 14.
        assert_eq!(cut(&h, 3 * each), 14);
        assert_eq!(due(&h, 0, 3 * each, 6), Some(14));
        assert_eq!(due(&h, 10, 3 * each, 6), None, "only 4 messages past the summary");
        assert_eq!(due(&h, 8, 3 * each, 6), Some(14));
        assert_eq!(due(&h, 0, 100 * each, 2), None, "everything fits");
    }

    /// The room configuration checks for (`[sessions] summary_max_tokens`
    /// against the summary model's window) holds the instruction and a
    /// short turn.
    #[test]
    fn the_least_room_configuration_allows_holds_the_instruction_and_a_turn() {
        let turn = [hist("user", "how hot is pump three today?"), hist("assistant", "about 60 C, as yesterday")];
        let (messages, taken) = prompt(None, &turn, crate::config::SUMMARY_PROMPT_MIN_TOKENS).expect("fits");
        assert_eq!(taken, 2);
        assert!(crate::context::estimate_tokens(&messages) <= crate::config::SUMMARY_PROMPT_MIN_TOKENS);
    }

    #[test]
    fn the_window_opens_at_a_question() {
        let h = turns(4);
        // Room for an answer and a turn: the lone answer is not kept.
        let room = h[7].tokens + h[6].tokens + h[5].tokens;
        assert_eq!(cut(&h, room), 6);
    }

    #[test]
    fn the_prompt_holds_the_summary_so_far_and_ends_before_a_question_when_cut() {
        let h = turns(3);
        let (p, taken) = prompt(Some("they met"), &h, 10_000).unwrap();
        assert_eq!(taken, 6);
        let body = p[1].content.as_str().unwrap();
        assert!(body.starts_with("Summary so far:\nthey met\n"), "{body}");
        assert!(body.contains("user: question 0\nassistant: answer 0\n"), "{body}");
        assert_eq!(p[0].content.as_str().unwrap(), SUMMARY_INSTRUCTION);
        // Room for the instruction and about one turn only.
        let full = crate::context::estimate_tokens(&p);
        let (_, taken) = prompt(Some("they met"), &h, full - 2 * (h[4].tokens + h[5].tokens) + 8).unwrap();
        assert_eq!(taken, 2, "cut before a question");
        assert_eq!(prompt(None, &h, 10), None);
    }

    #[test]
    fn a_summary_task_never_leaves_the_box_and_is_no_turn() {
        let cfg = SummaryConfig {
            model: "general-chat".into(),
            priority: crate::task::Priority::P4,
            max_tokens: 256,
            deadline: std::time::Duration::from_secs(60),
            after_messages: 6,
            history_share_pct: 50,
        };
        let mut turn = TaskRequest::sample(vec![]);
        turn.routing.data_class = Some(crate::task::DataClass::Public);
        turn.session_id = Some("s".into());
        turn.idempotency_key = Some("turn-key".into());
        let req = request(&cfg, 512, turn, vec![], "s", 1);
        assert!(req.routing.local_only, "a summary reads older turns of any class");
        assert_eq!(req.session_id, None);
        // The scheduler answers `Submitted::Known` only for a known
        // idempotency key: a summary has none, so its record cannot be
        // left in VALIDATING that way (unconfirmed report; `run` ends
        // the record anyway should it happen).
        assert_eq!(req.idempotency_key, None);
        assert_eq!(req.request_id, format!("summary/s/v1/{}", req.task_id));
        assert_eq!(req.identity.user_id.as_deref(), Some(SUMMARY_USER));
    }
}
