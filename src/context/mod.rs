//! Context: how many tokens a prompt takes and how much output still fits
//! in a model's context window, the sessions that keep a conversation's
//! history (`sessions.rs`, with redaction of what they keep in
//! `redact.rs`), the assembly of a prompt from a call, its session and
//! its `edge.context` (`inputs.rs`) in a token budget (`assembly.rs`), with
//! untrusted content fenced and filtered (`fence.rs`), the summaries of
//! a session's older turns (`summary.rs`), and exact counts from the
//! engine's tokenizer, cached per text (`tokens.rs`), and whether a call
//! may go to a model with a larger window (`window.rs`).
//!
//! Owns: token estimates, the fit decision, sessions and assembly. Does
//! not own: admission of the call (`crate::admission`) or when a turn
//! ends (the gateway follows the task).

pub mod assembly;
pub mod fence;
pub mod inputs;
pub mod redact;
pub mod sessions;
pub mod summary;
pub mod tokens;
pub mod window;

use crate::task::ChatMessage;

/// Per-message overhead of chat templates (role markers, separators).
pub(crate) const TOKENS_PER_MESSAGE: u32 = 4;

/// A conservative estimate of prompt tokens: about 3.5 bytes per token for
/// English text with BPE/SentencePiece vocabularies, rounded up, plus the
/// template overhead. Engines report the real count in usage.
pub fn estimate_tokens(messages: &[ChatMessage]) -> u32 {
    messages.iter().map(estimate_message).sum::<u32>() + 2
}

/// The estimate of one message (as [`estimate_tokens`] counts it inside a
/// prompt, without the prompt's own overhead).
pub fn estimate_message(m: &ChatMessage) -> u32 {
    TOKENS_PER_MESSAGE + ((m.text_len() as u64 * 2).div_ceil(7)) as u32
}

/// How a request fits a context window.
#[derive(Debug, PartialEq, Eq)]
pub enum Fit {
    Fits,
    /// Fits only with a smaller output budget.
    ReduceOutput(u32),
    TooLarge,
}

pub fn fit(input_tokens: u32, max_output_tokens: u32, context_tokens: u32) -> Fit {
    if input_tokens >= context_tokens {
        Fit::TooLarge
    } else if input_tokens.saturating_add(max_output_tokens) > context_tokens {
        Fit::ReduceOutput(context_tokens - input_tokens)
    } else {
        Fit::Fits
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn budgets() {
        assert_eq!(fit(10, 20, 100), Fit::Fits);
        assert_eq!(fit(90, 20, 100), Fit::ReduceOutput(10));
        assert_eq!(fit(100, 1, 100), Fit::TooLarge);
        let m = ChatMessage { role: "user".into(), content: "x".repeat(700).into(), extra: Default::default() };
        assert_eq!(estimate_tokens(&[m]), 4 + 200 + 2);
    }
}
