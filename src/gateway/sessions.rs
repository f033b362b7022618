//! Sessions for an identity (`/v1/sessions`), and the session side of a
//! call that names one: its turn begins before the task is queued (the
//! prompt gets the session's recent turns) and ends when the task ends
//! (the user's message and the answer are appended).
//!
//! Owns: reading the API's JSON bodies, and following a session turn's
//! task to its end. Does not own: the sessions, their limits and ownership
//! (`crate::context::sessions`) or the assembly (`crate::context::assembly`).

use crate::context::assembly;
use crate::context::sessions::{CreateSession, MemoryEntry, MemoryWrite, Owner, SessionView, TurnLease};
use crate::error::GatewayError;
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
    /// `POST /v1/sessions`: `user` is the user the caller declares (a
    /// header), used when neither the credential nor the body names one.
    pub fn create_session(&self, who: &Identity, user: Option<&str>, body: &[u8]) -> Result<SessionView, GatewayError> {
        let req: CreateSession =
            if body.iter().all(u8::is_ascii_whitespace) { Default::default() } else { parse(body)? };
        let owner = Owner::of(who, req.user_id.as_deref().or(user))?;
        self.sessions.create(owner, req)
    }

    pub fn session(&self, who: &Identity, user: Option<&str>, id: &str) -> Result<SessionView, GatewayError> {
        self.sessions.get(&Owner::of(who, user)?, id)
    }

    pub fn list_sessions(&self, who: &Identity, user: Option<&str>) -> Result<Vec<SessionView>, GatewayError> {
        Ok(self.sessions.list(&Owner::of(who, user)?))
    }

    pub fn delete_session(&self, who: &Identity, user: Option<&str>, id: &str) -> Result<(), GatewayError> {
        self.sessions.delete(&Owner::of(who, user)?, id)
    }

    pub fn put_session_memory(
        &self,
        who: &Identity,
        user: Option<&str>,
        id: &str,
        body: &[u8],
    ) -> Result<MemoryEntry, GatewayError> {
        let w: MemoryWrite = parse(body)?;
        self.sessions.put_memory(&Owner::of(who, user)?, id, w)
    }

    pub fn session_memory(
        &self,
        who: &Identity,
        user: Option<&str>,
        id: &str,
        key: Option<&str>,
        tag: Option<&str>,
    ) -> Result<Vec<MemoryEntry>, GatewayError> {
        self.sessions.memory(&Owner::of(who, user)?, id, key, tag)
    }

    pub fn clear_session_memory(&self, who: &Identity, user: Option<&str>, id: &str) -> Result<(), GatewayError> {
        self.sessions.clear_memory(&Owner::of(who, user)?, id)
    }

    /// Begins the session turn of an admitted call that names a session,
    /// and assembles its prompt with the session's recent turns. `None`
    /// without a session.
    pub(super) async fn begin_turn(&self, req: &mut TaskRequest) -> Result<Option<Turn>, GatewayError> {
        let Some(id) = req.session_id.clone() else { return Ok(None) };
        if req.operation != Operation::Chat {
            return Err(GatewayError::invalid("'session_id' applies to chat calls only"));
        }
        let owner = Owner::of(&req.identity, None)?;
        let user = new_messages(req);
        let new_tokens = user.iter().map(crate::context::estimate_message).sum();
        let lease = self.sessions.begin_turn(&owner, &id, user.len(), new_tokens, req.timeouts.queue).await?;
        if let Some(model) = self.config().models.get(&req.logical_model) {
            let done = assembly::assemble(req, &lease.history(), model.context_tokens);
            tracing::debug!(session = %id, used = done.turns_used, left_out = done.turns_left_out, "session turns in the prompt");
        }
        let mut template = req.clone();
        template.messages = Vec::new();
        Ok(Some(Turn { lease, user, template }))
    }

    /// The session turn of a task re-queued at recovery (review L5): its
    /// prompt was assembled before the restart (its stored messages are
    /// that prompt, whose new messages follow its last answer, as in
    /// [`Gateway::begin_turn`]); the turn is held again and appended when
    /// the task ends, so the session's next call waits for it and sees it.
    /// `None` (logged) when the session is gone or full: the task runs,
    /// and nothing is appended.
    pub(super) async fn resume_turn(&self, req: &TaskRequest) -> Option<Turn> {
        let id = req.session_id.clone()?;
        let owner = Owner::of(&req.identity, None).ok()?;
        let user = new_messages(req);
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
            turn.lease.finish(turn.user, answer, calls, succeeded, &task_id);
            // After the turn is appended and the next one may begin: a
            // summary, when due, is made beside the session's later turns.
            if succeeded {
                let session_id = turn.template.session_id.clone().unwrap_or_default();
                summarizer.after_turn(config, turn.template, session_id).await;
            }
        });
    }
}
