//! `POST /v1/embeddings`: each input's pooled final hidden state, computed by a slot
//! (`worker::Work::Embed`).
use super::worker::{Event, Work};
use super::{enqueue, error, parse, Shared};
use crate::serve::api::ApiError;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};
use std::sync::atomic::Ordering;

/// The body of `/v1/embeddings`.
#[derive(serde::Deserialize)]
struct EmbeddingsRequest {
    #[serde(default)]
    model: Option<String>,
    input: Value,
    /// `float` (the default) or `base64` (little-endian f32s, what the `openai` package asks
    /// for unless told otherwise).
    #[serde(default)]
    encoding_format: Option<String>,
    /// OpenAI's shortened embeddings: not offered (the model's width is the embedding's).
    #[serde(default)]
    dimensions: Option<Value>,
}

/// The most inputs one `/v1/embeddings` request may hold.
const MAX_EMBEDDING_INPUTS: usize = 256;

/// `POST /v1/embeddings`: each input's pooled final hidden state (see `worker::embed`).
pub(super) async fn embeddings(
    State(s): State<Shared>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let req: EmbeddingsRequest = match parse(&s, &headers, &body) {
        Ok(r) => r,
        Err(e) => return error(e),
    };
    s.metrics.requests.fetch_add(1, Ordering::Relaxed);
    let bad = |m: &str, p| error(ApiError::invalid(m.to_string(), p));
    if let Some(m) = req.model.as_deref().filter(|m| !m.is_empty()) {
        if !s.opts.model_names.iter().any(|n| n == m) {
            return error(ApiError::not_found(
                format!("model `{m}` is not served here (GET /v1/models)"),
                "model_not_found",
            ));
        }
    }
    let base64 = match req.encoding_format.as_deref() {
        None | Some("float") => false,
        Some("base64") => true,
        Some(_) => {
            return bad(
                "`encoding_format` is `float` or `base64`",
                Some("encoding_format"),
            )
        }
    };
    if let Some(d) = req.dimensions.as_ref().filter(|d| !d.is_null()) {
        return bad(
            &format!("`dimensions` ({d}): embeddings here have the model's own width"),
            Some("dimensions"),
        );
    }
    let texts: Vec<String> = match &req.input {
        Value::String(t) => vec![t.clone()],
        Value::Array(a) if !a.is_empty() && a.len() <= MAX_EMBEDDING_INPUTS => {
            match a.iter().map(|v| v.as_str().map(String::from)).collect() {
                Some(v) => v,
                None => {
                    return bad(
                        "`input` holds strings only (not token arrays)",
                        Some("input"),
                    )
                }
            }
        }
        _ => {
            return bad(
                &format!("`input` is a string or a list of 1 to {MAX_EMBEDDING_INPUTS} strings"),
                Some("input"),
            )
        }
    };
    if texts.iter().any(String::is_empty) {
        return bad("`input` holds an empty string", Some("input"));
    }
    let (mut rx, prompt_tokens) = match enqueue(&s, Work::Embed(texts)).await {
        Ok(started) => started,
        Err(e) => return error(e),
    };
    let mut data = Vec::new();
    while let Some(ev) = rx.recv().await {
        match ev {
            Event::Embedding(v) => {
                let embedding = match base64 {
                    true => {
                        use base64::Engine as _;
                        let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
                        json!(base64::engine::general_purpose::STANDARD.encode(bytes))
                    }
                    false => json!(v),
                };
                let index = data.len();
                data.push(json!({"object": "embedding", "index": index, "embedding": embedding}));
            }
            Event::Done { .. } => {
                return Json(
                    json!({"object": "list", "data": data, "model": s.opts.model_id,
                    "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}),
                )
                .into_response()
            }
            Event::Error(e) => return error(e),
            _ => {}
        }
    }
    error(ApiError::internal("the slot ended the reply early"))
}
