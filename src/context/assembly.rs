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

use sha2::{Digest, Sha256};

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
/// the request's estimate and prompt digest to the assembled prompt.
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
        req.prompt_sha256 = hex::encode(Sha256::digest(serde_json::to_vec(&req.messages).unwrap_or_default()));
    }
    Assembled { turns_used: history.len() - first, turns_left_out: first }
}
