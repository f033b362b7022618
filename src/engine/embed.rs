//! Embedding requests, for both wire families: OpenAI-compatible
//! `POST /v1/embeddings` (llama-server started with `--embeddings`, vLLM)
//! and Ollama's `POST /api/embed`.
//!
//! Owns: the wire structs of those two endpoints and their translation into
//! [`EngineChunk::Embedding`]s, a `Usage` and a `Finish`. The input list
//! of one call goes whole to the engine (which spreads it over its slots);
//! the answer is read whole before any chunk is yielded, so a failure is
//! always one before the call's first vector (the driver may retry it
//! elsewhere: embeddings are deterministic). Does not own: which operation
//! a request is (the adapters dispatch here), splitting a long list into
//! calls of `[models.*] max_batch_inputs` (the scheduler's driver), encoding
//! for the client (base64 is the HTTP ingress's) or retries (the driver's,
//! by the router's rules).

use futures::StreamExt;
use serde::{Deserialize, Serialize};

use super::{truncate, EngineChunk, EngineError, EngineStream};
use crate::config::EngineConfig;

#[derive(Serialize)]
struct OpenAiRequest<'a> {
    model: &'a str,
    input: &'a [String],
    /// Always floats from the engine; the ingress encodes for its client.
    encoding_format: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    dimensions: Option<u32>,
}

#[derive(Deserialize)]
struct OpenAiResponse {
    #[serde(default)]
    data: Vec<OpenAiItem>,
    usage: Option<OpenAiUsage>,
}

#[derive(Deserialize)]
struct OpenAiItem {
    index: Option<u32>,
    embedding: Vec<f32>,
}

#[derive(Deserialize)]
struct OpenAiUsage {
    #[serde(default)]
    prompt_tokens: u32,
}

#[derive(Serialize)]
struct OllamaRequest<'a> {
    model: &'a str,
    input: &'a [String],
    #[serde(skip_serializing_if = "Option::is_none")]
    dimensions: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    keep_alive: Option<&'a str>,
}

#[derive(Deserialize)]
struct OllamaResponse {
    #[serde(default)]
    embeddings: Vec<Vec<f32>>,
    prompt_eval_count: Option<u32>,
}

/// One vector per input, in input order, as the engine reported them.
struct Vectors {
    vectors: Vec<Vec<f32>>,
    input_tokens: Option<u32>,
}

impl TryFrom<(OpenAiResponse, usize)> for Vectors {
    type Error = EngineError;

    fn try_from((r, n): (OpenAiResponse, usize)) -> Result<Self, EngineError> {
        let mut slots: Vec<Option<Vec<f32>>> = vec![None; n];
        for (pos, item) in r.data.into_iter().enumerate() {
            let i = item.index.map_or(pos, |i| i as usize);
            match slots.get_mut(i) {
                Some(slot @ None) => *slot = Some(item.embedding),
                _ => return Err(EngineError::Protocol(format!("embedding index {i} out of range or repeated"))),
            }
        }
        let vectors = slots
            .into_iter()
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| EngineError::Protocol(format!("fewer embeddings than the {n} inputs")))?;
        Ok(Vectors { vectors, input_tokens: r.usage.map(|u| u.prompt_tokens) })
    }
}

impl TryFrom<(OllamaResponse, usize)> for Vectors {
    type Error = EngineError;

    fn try_from((r, n): (OllamaResponse, usize)) -> Result<Self, EngineError> {
        if r.embeddings.len() != n {
            return Err(EngineError::Protocol(format!("{} embeddings for {n} inputs", r.embeddings.len())));
        }
        Ok(Vectors { vectors: r.embeddings, input_tokens: r.prompt_eval_count })
    }
}

impl Vectors {
    fn into_stream(self) -> EngineStream {
        let mut chunks: Vec<Result<EngineChunk, EngineError>> = Vec::with_capacity(self.vectors.len() + 2);
        if let Some(bad) = self.vectors.iter().position(|v| v.is_empty() || v.iter().any(|x| !x.is_finite())) {
            return futures::stream::iter(vec![Err(EngineError::Protocol(format!(
                "embedding {bad} is empty or not finite"
            )))])
            .boxed();
        }
        for (i, v) in self.vectors.into_iter().enumerate() {
            chunks.push(Ok(EngineChunk::Embedding { index: i as u32, vector: v }));
        }
        if let Some(t) = self.input_tokens {
            chunks.push(Ok(EngineChunk::Usage { input_tokens: t, output_tokens: 0 }));
        }
        chunks.push(Ok(EngineChunk::Finish("stop".into())));
        futures::stream::iter(chunks).boxed()
    }
}

/// Posts `body` to `path` and reads the whole answer as `R`.
async fn post<B: Serialize, R: for<'de> Deserialize<'de>>(
    client: &reqwest::Client,
    cfg: &EngineConfig,
    path: &str,
    body: &B,
    traceparent: Option<&str>,
) -> Result<R, EngineError> {
    let mut rb = super::traced(client.post(format!("{}{path}", cfg.base_url)).json(body), traceparent);
    if let Some(key) = &cfg.api_key {
        rb = rb.bearer_auth(key);
    }
    let resp = super::send(rb).await?;
    let status = resp.status();
    if !status.is_success() {
        let text = resp.text().await.unwrap_or_default();
        return Err(EngineError::Status { status: status.as_u16(), body: truncate(&text, 300) });
    }
    let bytes = resp.bytes().await.map_err(|_| EngineError::Truncated)?;
    serde_json::from_slice(&bytes).map_err(|e| EngineError::Protocol(format!("bad embeddings body: {e}")))
}

/// `POST /v1/embeddings` of an OpenAI-compatible server.
pub(super) async fn openai(
    client: &reqwest::Client,
    cfg: &EngineConfig,
    model: &str,
    input: &[String],
    dimensions: Option<u32>,
    traceparent: Option<&str>,
) -> Result<EngineStream, EngineError> {
    let body = OpenAiRequest { model, input, encoding_format: "float", dimensions };
    let r: OpenAiResponse = post(client, cfg, "/v1/embeddings", &body, traceparent).await?;
    Ok(Vectors::try_from((r, input.len()))?.into_stream())
}

/// `POST /api/embed` of Ollama.
pub(super) async fn ollama(
    client: &reqwest::Client,
    cfg: &EngineConfig,
    model: &str,
    input: &[String],
    dimensions: Option<u32>,
    traceparent: Option<&str>,
) -> Result<EngineStream, EngineError> {
    let body = OllamaRequest { model, input, dimensions, keep_alive: cfg.keep_alive.as_deref() };
    let r: OllamaResponse = post(client, cfg, "/api/embed", &body, traceparent).await?;
    Ok(Vectors::try_from((r, input.len()))?.into_stream())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn openai_vectors_follow_their_index_and_must_cover_every_input() {
        let r: OpenAiResponse = serde_json::from_str(
            r#"{"data":[{"index":1,"embedding":[3.0]},{"index":0,"embedding":[1.0,2.0]}],"usage":{"prompt_tokens":4,"total_tokens":4}}"#,
        )
        .unwrap();
        let v = Vectors::try_from((r, 2)).unwrap();
        assert_eq!(v.vectors, vec![vec![1.0, 2.0], vec![3.0]]);
        assert_eq!(v.input_tokens, Some(4));

        for bad in [
            r#"{"data":[{"index":0,"embedding":[1.0]}]}"#,
            r#"{"data":[{"index":0,"embedding":[1.0]},{"index":0,"embedding":[1.0]}]}"#,
            r#"{"data":[{"index":0,"embedding":[1.0]},{"index":5,"embedding":[1.0]}]}"#,
        ] {
            let r: OpenAiResponse = serde_json::from_str(bad).unwrap();
            assert!(matches!(Vectors::try_from((r, 2)), Err(EngineError::Protocol(_))), "{bad}");
        }
    }

    #[test]
    fn ollama_needs_one_vector_per_input() {
        let r: OllamaResponse = serde_json::from_str(r#"{"embeddings":[[0.5]],"prompt_eval_count":3}"#).unwrap();
        assert!(matches!(Vectors::try_from((r, 2)), Err(EngineError::Protocol(_))));
    }
}
