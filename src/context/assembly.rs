//! Prompt assembly: the one place where a call's messages and what the
//! gateway keeps for it (today: the recent turns of its session) become
//! the prompt sent to the engine.
//!
//! The order is fixed: the request's leading system (and developer)
//! messages, then the session's recent turns, then the rest of the
//! request. Recent turns are the newest that fit the model's window with
//! the request and its output budget (the existing estimate); older ones
//! are left out, whole messages at a time, and a window never starts with
//! an answer whose question was left out.
//!
//! Does not own (they join here in a later part of issue 12): the session
//! summary, knowledge passages, tool results, the per-segment budgets and
//! the trimming ladder, untrusted-content fencing.

use super::sessions::HistoryMessage;
use crate::task::{ChatMessage, TaskRequest};

/// What the assembly did, for the record and the tests.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Assembled {
    /// History messages put into the prompt.
    pub turns_used: usize,
    /// History messages left out for lack of room.
    pub turns_left_out: usize,
}

/// Puts `history` (oldest first) into `req`'s prompt as far as it fits
/// `context_tokens` beside the request and its output budget, and updates
/// the request's estimate to the assembled prompt (not its digest: see
/// the body).
pub fn assemble(req: &mut TaskRequest, history: &[HistoryMessage], context_tokens: u32) -> Assembled {
    let own = super::estimate_tokens(&req.messages);
    let mut room = context_tokens.saturating_sub(own).saturating_sub(req.max_output_tokens);
    let mut first = history.len();
    while first > 0 && history[first - 1].tokens <= room {
        room -= history[first - 1].tokens;
        first -= 1;
    }
    // The window opens with a question, not with an orphaned answer.
    while first < history.len() && history[first].message.role != "user" {
        first += 1;
    }
    let window: Vec<ChatMessage> = history[first..].iter().map(|h| h.message.clone()).collect();
    if !window.is_empty() {
        let lead = req.messages.iter().take_while(|m| matches!(m.role.as_str(), "system" | "developer")).count();
        let rest = req.messages.split_off(lead);
        req.messages.extend(window);
        req.messages.extend(rest);
        req.input_tokens_estimate = super::estimate_tokens(&req.messages);
        // `prompt_sha256` stays the digest of the caller's own messages: it
        // is what an idempotency key is judged on, and a repeat of this
        // call would assemble another prompt (this turn's answer in it).
    }
    Assembled { turns_used: history.len() - first, turns_left_out: first }
}

#[cfg(test)]
mod tests {

    use serde_json::Value;

    use super::*;

    fn msg(role: &str, text: &str) -> ChatMessage {
        ChatMessage { role: role.into(), content: Value::String(text.into()), extra: Default::default() }
    }

    fn hist(role: &str, text: &str) -> HistoryMessage {
        let message = msg(role, text);
        HistoryMessage { tokens: crate::context::estimate_message(&message), message }
    }

    fn request(messages: Vec<ChatMessage>, max_output_tokens: u32) -> TaskRequest {
        let mut req = TaskRequest::sample(messages);
        req.input_tokens_estimate = crate::context::estimate_tokens(&req.messages);
        req.max_output_tokens = max_output_tokens;
        req.session_id = Some("s".into());
        req
    }

    fn roles_and_text(req: &TaskRequest) -> Vec<(String, String)> {
        req.messages.iter().map(|m| (m.role.clone(), m.content.as_str().unwrap().to_string())).collect()
    }

    #[test]
    fn turns_go_after_the_system_messages_and_before_the_request() {
        let mut req = request(vec![msg("system", "rules"), msg("user", "now")], 16);
        let history = [hist("user", "q1"), hist("assistant", "a1")];
        let done = assemble(&mut req, &history, 2048);
        assert_eq!(done, Assembled { turns_used: 2, turns_left_out: 0 });
        let want: Vec<(String, String)> = [("system", "rules"), ("user", "q1"), ("assistant", "a1"), ("user", "now")]
            .iter()
            .map(|(r, t)| (r.to_string(), t.to_string()))
            .collect();
        assert_eq!(roles_and_text(&req), want);
        assert_eq!(req.input_tokens_estimate, crate::context::estimate_tokens(&req.messages));
        assert_eq!(req.prompt_sha256, "", "the caller's digest is kept");
    }

    #[test]
    fn only_the_newest_turns_that_fit_go_in_and_never_an_orphaned_answer() {
        let long = "x".repeat(700); // 204 tokens
        let history = [hist("user", &long), hist("assistant", "a1"), hist("user", "q2"), hist("assistant", "a2")];
        let mut req = request(vec![msg("user", "now")], 100);
        // Room for the last three messages but not the long question: its
        // answer is left out with it.
        let own = crate::context::estimate_tokens(&req.messages);
        let window = own + 100 + history[1..].iter().map(|h| h.tokens).sum::<u32>();
        let done = assemble(&mut req, &history, window);
        assert_eq!(done, Assembled { turns_used: 2, turns_left_out: 2 });
        let texts: Vec<String> = roles_and_text(&req).into_iter().map(|(_, t)| t).collect();
        assert_eq!(texts, vec!["q2", "a2", "now"]);

        // No room at all: the request alone, untouched.
        let mut req = request(vec![msg("user", "now")], 100);
        let before = req.messages.clone();
        let done = assemble(&mut req, &history, own + 100);
        assert_eq!((done.turns_used, req.messages), (0, before));
    }
}
