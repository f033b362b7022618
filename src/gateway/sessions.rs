//! Sessions for an identity (`/v1/sessions`), and the session side of a
//! call that names one: its turn begins before the task is queued (the
//! prompt gets the session's recent turns) and ends when the task ends
//! (the user's message and the answer are appended).
//!
//! Every chat call whose prompt gets more than its own messages (configured
//! rules, a session, `edge.context`, the earlier messages of a Responses
//! `previous_response_id` chain) is assembled here, session or not, and
//! so is one whose own messages do not fit its model (admission's
//! estimate; see `crate::context::window`).
//!
//! Owns: reading the API's JSON bodies, gathering what the assembly needs
//! (configuration, the session's turns and memory, the request's
//! `edge.context`), and following a session turn's task to its end. Does not own: the sessions, their limits and ownership
//! (`crate::context::sessions`) or the assembly (`crate::context::assembly`).

use sha2::{Digest, Sha256};

use crate::config::ContextPolicy;
use crate::context::assembly::{Inputs, Piece, Rules, SummaryRef};
use crate::context::fence::SecretFilter;
use crate::context::inputs::{ContextRequest, MemoryQuery, Passage};
use crate::context::sessions::{
    CreateSession, HistoryMessage, MemoryEntry, MemoryWrite, Owner, SessionView, TurnLease,
};
use crate::error::{ErrorCode, GatewayError};
use crate::task::{ChatMessage, FallbackStep, Identity, Operation, TaskEvent, TaskRequest, TaskState};

use super::Gateway;

/// A turn's new messages: those after its last assistant message (a
/// caller may resend the answer its tool results follow), the user's
/// question or the tool results of the session's last answer, without its
/// system and developer messages, which are the call's own instructions
/// and are not kept.
fn new_messages(req: &TaskRequest) -> Vec<ChatMessage> {
    let start = req.messages.iter().rposition(|m| m.role == "assistant").map_or(0, |i| i + 1);
    req.messages[start..].iter().filter(|m| !matches!(m.role.as_str(), "system" | "developer")).cloned().collect()
}

fn parse<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, GatewayError> {
    let mut de = serde_json::Deserializer::from_slice(body);
    serde_path_to_error::deserialize(&mut de).map_err(|e| {
        let path = e.path().to_string();
        GatewayError::invalid(format!("invalid session request at '{path}': {}", e.into_inner()))
    })
}

/// A session turn begun for a call, until its task is queued.
pub(super) struct Turn {
    lease: TurnLease,
    /// The call's own new messages (after its last assistant message: the
    /// user's question, tool results), appended with the answer when the
    /// turn ends well.
    user: Vec<ChatMessage>,
    /// The call's request without its messages: the summary task that may
    /// follow the turn runs for the same caller, data class and routing.
    template: TaskRequest,
}

impl Gateway {
    /// The owner a session request acts for: the caller's user (the
    /// credential's, or the one its application's `user_header` names),
    /// else the user it declares (`declared`). For an application with a
    /// `user_header` only the header names the user, as for its calls
    /// (admission ignores their body's user): a declared one is ignored,
    /// and without the header the session has no user.
    fn owner(&self, who: &Identity, declared: Option<&str>) -> Result<Owner, GatewayError> {
        let header_only = self.config().applications.get(&who.application).is_some_and(|a| a.user_header.is_some());
        Owner::of(who, declared.filter(|_| !header_only))
    }

    /// `POST /v1/sessions`: `user` is the user the caller declares (a
    /// header), used when neither the credential nor the body names one.
    pub fn create_session(&self, who: &Identity, user: Option<&str>, body: &[u8]) -> Result<SessionView, GatewayError> {
        let req: CreateSession =
            if body.iter().all(u8::is_ascii_whitespace) { Default::default() } else { parse(body)? };
        let owner = self.owner(who, req.user_id.as_deref().or(user))?;
        // The class every call of this caller has at least (a call may ask
        // for a stricter one): the session's retention from the start.
        let cfg = self.config();
        let app = cfg.applications.get(&who.application);
        let class = crate::admission::data_class(&cfg, &who.tenant, app, who.data_class, &Default::default());
        self.sessions.create(owner, req, class)
    }

    pub fn session(&self, who: &Identity, user: Option<&str>, id: &str) -> Result<SessionView, GatewayError> {
        self.sessions.get(&self.owner(who, user)?, id)
    }

    pub fn list_sessions(&self, who: &Identity, user: Option<&str>) -> Result<Vec<SessionView>, GatewayError> {
        Ok(self.sessions.list(&self.owner(who, user)?))
    }

    pub fn delete_session(&self, who: &Identity, user: Option<&str>, id: &str) -> Result<(), GatewayError> {
        self.sessions.delete(&self.owner(who, user)?, id)
    }

    pub fn put_session_memory(
        &self,
        who: &Identity,
        user: Option<&str>,
        id: &str,
        body: &[u8],
    ) -> Result<MemoryEntry, GatewayError> {
        let w: MemoryWrite = parse(body)?;
        self.sessions.put_memory(&self.owner(who, user)?, id, w)
    }

    pub fn session_memory(
        &self,
        who: &Identity,
        user: Option<&str>,
        id: &str,
        key: Option<&str>,
        tag: Option<&str>,
    ) -> Result<Vec<MemoryEntry>, GatewayError> {
        self.sessions.memory(&self.owner(who, user)?, id, key, tag)
    }

    pub fn clear_session_memory(&self, who: &Identity, user: Option<&str>, id: &str) -> Result<(), GatewayError> {
        self.sessions.clear_memory(&self.owner(who, user)?, id)
    }

    /// Assembles the prompt of an admitted chat call
    /// ([`assembly::assemble`]: configured rules, the session's turns and
    /// memory, the request's `edge.context`, the `chain` of earlier
    /// messages a call continues), beginning its session turn when it names
    /// a session. A call with nothing to add that fits its model keeps its
    /// messages and skips the assembly; one that does not fit (admission
    /// let it through) is assembled, to switch to a larger window or trim
    /// its earlier turns (`crate::context::window`). `context_policy` is
    /// the request's field (checked at admission).
    pub(super) async fn begin_turn(
        &self,
        req: &mut TaskRequest,
        context: Option<ContextRequest>,
        chain: Vec<ChatMessage>,
        context_policy: Option<&str>,
    ) -> Result<Option<Turn>, GatewayError> {
        if req.operation != Operation::Chat {
            if req.session_id.is_some() {
                return Err(GatewayError::invalid("'session_id' applies to chat calls only"));
            }
            if context.is_some() {
                return Err(GatewayError::invalid("'edge.context' applies to chat calls only"));
            }
            return Ok(None);
        }
        let cfg = self.config();
        let app = cfg.applications.get(&req.identity.application);
        let configured = cfg.context.safety_rules.is_some()
            || app.is_some_and(|a| a.system_prompt.is_some() || a.output_constraints.is_some());
        // Admission's estimate, already made: the common call that fits
        // pays no assembly (nor tokenizing) here.
        let oversized =
            cfg.models.get(&req.logical_model).is_some_and(|m| req.input_tokens_estimate >= m.context_tokens);
        if req.session_id.is_none() && context.is_none() && !configured && chain.is_empty() && !oversized {
            return Ok(None);
        }
        let policy = crate::context::window::policy(&cfg, &req.identity.application, context_policy)?;
        if req.session_id.is_some() && !chain.is_empty() {
            return Err(GatewayError::invalid(
                "'session_id' and 'previous_response_id' cannot be used together: each names the conversation",
            ));
        }
        let context = context.unwrap_or_default();
        let memory = context.memory.clone().unwrap_or_default();
        let (turn, mut history, entries) = match req.session_id.clone() {
            Some(id) => {
                let (turn, entries) = self.begin_session_turn(req, &id, &memory).await?;
                let history = turn.lease.history();
                (Some(turn), history, entries)
            }
            None if !(memory.keys.is_empty() && memory.tags.is_empty()) => {
                return Err(GatewayError::invalid("'edge.context.memory' needs a 'session_id'"));
            }
            // A chain's earlier messages are its history, as a session's.
            None => {
                let history = chain
                    .into_iter()
                    .map(|message| HistoryMessage { tokens: crate::context::estimate_message(&message), message })
                    .collect();
                (None, history, Vec::new())
            }
        };
        let Some(model) = cfg.models.get(&req.logical_model) else { return Ok(turn) };
        let piece = |p: Passage| Piece {
            text: p.text,
            source: p.source.unwrap_or_else(|| "request".into()),
            relevance: p.relevance,
            time_ms: Some(crate::task::unix_ms(req.received_wall)),
        };
        let mut knowledge: Vec<Piece> = context.knowledge.into_iter().map(piece).collect();
        knowledge.extend(entries.into_iter().map(|e| Piece {
            text: e.content,
            source: format!("memory:{}", e.key),
            relevance: None,
            time_ms: Some(e.created_at_ms),
        }));
        let tool_results: Vec<Piece> = context.tool_results.into_iter().map(piece).collect();
        // The session's summary of its older turns, when one is made: the
        // ladder puts it in place of the turns it covers when they do not
        // fit. Untrusted like passages: filtered and fenced as they are.
        let summary = turn.as_ref().and_then(|t| t.lease.summary());
        // Compiled once per configuration, needed only for untrusted text
        // (the summary included: review 14 M2).
        let untrusted = !knowledge.is_empty() || !tool_results.is_empty() || summary.is_some();
        let filter = untrusted.then(|| SecretFilter::of(&cfg));
        let rules = Rules {
            safety_rules: cfg.context.safety_rules.as_deref(),
            system_prompt: app.and_then(|a| a.system_prompt.as_deref()),
            output_constraints: app.and_then(|a| a.output_constraints.as_deref()),
            context_tokens: model.context_tokens,
            budget: model.context_budget,
            filter: filter.as_deref(),
            whole_conversation: policy == ContextPolicy::Disabled,
            ..Default::default()
        };
        let session = req.session_id.clone();
        let summary = summary.as_ref().map(|s| SummaryRef { text: &s.text, covers: s.covers });
        let fence_id = turn.as_ref().map(|t| t.lease.fence_id());
        // Counted by the model's own tokenizer where it has one. A prompt
        // that does not fit after trimming goes to the model's larger-window
        // alternative where the policy lets it (`crate::context::window`);
        // then, for a call without a session under `auto`, its own earlier
        // turns become history the ladder may trim.
        let mut rules = rules;
        let mut switched = Vec::new();
        let mut split = false;
        let mut plan = loop {
            let before = (req.max_output_tokens, req.degrade_reason.clone());
            let inputs = Inputs {
                history: &history,
                session: session.as_deref(),
                summary,
                fence_id: fence_id.clone(),
                knowledge: knowledge.clone(),
                tool_results: tool_results.clone(),
            };
            match self.tokenizers.assemble(&cfg, req, inputs, &rules).await {
                Err(e) if e.code == ErrorCode::ContextTooLarge => {
                    let Some(alt) = crate::context::window::larger_model(&cfg, req) else {
                        let earlier = crate::context::window::earlier_turns(&req.messages);
                        if split || turn.is_some() || policy != ContextPolicy::Auto || earlier.is_empty() {
                            return Err(e);
                        }
                        // After a chain's messages, which are older.
                        history.extend(req.messages.drain(earlier).map(|message| HistoryMessage {
                            tokens: crate::context::estimate_message(&message),
                            message,
                        }));
                        split = true;
                        (req.max_output_tokens, req.degrade_reason) = before;
                        continue;
                    };
                    switched.push(format!(
                        "switched to model '{}' ({} tokens): the prompt does not fit '{}' ({} tokens) after trimming",
                        alt.name, alt.context_tokens, req.logical_model, rules.context_tokens
                    ));
                    (req.max_output_tokens, req.degrade_reason) = before;
                    req.max_output_tokens = req.max_output_tokens.min(alt.max_output_tokens);
                    req.logical_model = alt.name.clone();
                    rules = Rules { context_tokens: alt.context_tokens, budget: alt.context_budget, ..rules };
                }
                r => break r?,
            }
        };
        plan.steps.splice(0..0, switched);
        // The digest of the prompt as sent, beside the caller's own
        // (`prompt_sha256`, which idempotency judges repeats on).
        let sent = hex::encode(Sha256::digest(serde_json::to_vec(&req.messages).unwrap_or_default()));
        for step in &plan.steps {
            self.metrics.context_trims.with_label_values(&[crate::context::assembly::step_kind(step)]).inc();
        }
        req.context = Some(Box::new(plan.meta(sent)));
        tracing::debug!(
            task_id = %req.task_id,
            used = plan.turns_used,
            left_out = plan.turns_left_out,
            steps = ?plan.steps,
            "prompt assembled"
        );
        Ok(turn)
    }

    /// Begins the turn of session `id` (waiting for the one before), and
    /// reads the memory entries `memory` asks for.
    async fn begin_session_turn(
        &self,
        req: &TaskRequest,
        id: &str,
        memory: &MemoryQuery,
    ) -> Result<(Turn, Vec<MemoryEntry>), GatewayError> {
        let owner = Owner::of(&req.identity, None)?;
        let user = new_messages(req);
        let new_tokens = user.iter().map(crate::context::estimate_message).sum();
        let lease = self.sessions.begin_turn(&owner, id, user.len(), new_tokens, req.timeouts.queue).await?;
        let mut entries: Vec<MemoryEntry> = Vec::new();
        let wanted = memory
            .keys
            .iter()
            .map(|k| (Some(k.as_str()), None))
            .chain(memory.tags.iter().map(|t| (None, Some(t.as_str()))));
        for (key, tag) in wanted {
            for e in self.sessions.memory(&owner, id, key, tag)? {
                if !entries.iter().any(|x| x.key == e.key) {
                    entries.push(e);
                }
            }
        }
        let mut template = req.clone();
        template.messages = Vec::new();
        Ok((Turn { lease, user, template }, entries))
    }

    /// The session turn of a task re-queued at recovery (review L5): its
    /// prompt was assembled before the restart (its stored messages are
    /// that prompt, whose new messages follow its last answer, as in
    /// [`Gateway::begin_turn`]); the turn is held again and appended when
    /// the task ends, so the session's next call waits for it and sees it.
    /// `None` (logged) when the session is gone or full, or the prompt
    /// holds fenced untrusted content: the task runs, and nothing is
    /// appended.
    pub(super) async fn resume_turn(&self, req: &TaskRequest) -> Option<Turn> {
        let id = req.session_id.clone()?;
        let owner = Owner::of(&req.identity, None).ok()?;
        let user = new_messages(req);
        // Its stored messages are the assembled prompt: where the assembly
        // fenced untrusted content into the question, appending it would
        // keep that content as the user's own words, outside any fence, in
        // every later prompt (review 14 M1). Such a turn runs, unappended.
        if user.iter().any(|m| m.content.to_string().contains("<untrusted-data id=")) {
            tracing::warn!(task_id = %req.task_id, session = %id, "a re-queued turn with fenced content will not be appended");
            return None;
        }
        let new_tokens = user.iter().map(crate::context::estimate_message).sum();
        let wait = std::time::Duration::ZERO;
        match self.sessions.begin_turn(&owner, &id, user.len(), new_tokens, wait).await {
            Ok(lease) => {
                let mut template = req.clone();
                template.messages = Vec::new();
                Some(Turn { lease, user, template })
            }
            Err(e) => {
                tracing::warn!(task_id = %req.task_id, session = %id, error = %e, "a re-queued turn will not be appended");
                None
            }
        }
    }

    /// Follows a queued session turn's task to its end, then ends the turn
    /// (appending the user's message and the answer when it succeeded).
    /// The turn is held until then, so the session's next call waits for
    /// it and sees it.
    pub(super) fn follow_turn(&self, turn: Turn, task_id: &str) {
        let Some(mut events) = self.scheduler.attach(task_id, 0) else { return };
        let task_id = task_id.to_string();
        let summarizer = crate::context::summary::Summarizer {
            scheduler: self.scheduler.clone(),
            recorder: self.recorder.clone(),
            sessions: self.sessions.clone(),
            outcomes: self.metrics.context_summaries.clone(),
        };
        let config = self.config();
        tokio::spawn(async move {
            let mut answer = String::new();
            let mut succeeded = false;
            let mut calls = Vec::new();
            while let Some((_, ev)) = events.recv().await {
                match ev {
                    TaskEvent::Delta { text } => answer.push_str(&text),
                    TaskEvent::Done(m) => {
                        // A canned answer (no engine could take the call)
                        // is not the model's turn: nothing is appended,
                        // whatever `append_failed_turns` says.
                        if m.route.hops.last().is_some_and(|h| h.step == FallbackStep::Canned) {
                            return;
                        }
                        succeeded = m.status == TaskState::Succeeded;
                        // The calls whole, as the next turn's tool results
                        // answer them (their ids).
                        calls =
                            m.tool_calls.iter().map(|c| (c.id.clone(), c.name.clone(), c.arguments.clone())).collect();
                        break;
                    }
                    TaskEvent::Error { .. } => break,
                    _ => {}
                }
            }
            turn.lease.finish(turn.user, answer, calls, succeeded, &task_id, turn.template.data_class);
            // After the turn is appended and the next one may begin: a
            // summary, when due, is made beside the session's later turns.
            if succeeded {
                let session_id = turn.template.session_id.clone().unwrap_or_default();
                summarizer.after_turn(config, turn.template, session_id).await;
            }
        });
    }
}
