//! llama-server's `POST /tokenize` and `POST /detokenize`, on the HTTP threads (the model's
//! tokenizer is shared with the slots).
use super::{error, parse, Shared};
use crate::serve::api::ApiError;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

/// The body of llama-server's `/tokenize`.
#[derive(serde::Deserialize)]
struct TokenizeRequest {
    content: String,
    /// Put the model's BOS first, as a prompt gets it.
    #[serde(default)]
    add_special: bool,
    /// Each token with its text (`{"id", "piece"}`) instead of the bare ids.
    #[serde(default)]
    with_pieces: bool,
}

/// `POST /tokenize` (llama-server's): the ids of `content`, on the HTTP thread.
pub(super) async fn tokenize(State(s): State<Shared>, headers: HeaderMap, body: Bytes) -> Response {
    let req: TokenizeRequest = match parse(&s, &headers, &body) {
        Ok(r) => r,
        Err(e) => return error(e),
    };
    let t = &s.opts.tokenizer;
    let ids = match req.add_special {
        true => t.encode_prompt(&req.content),
        false => t.encode_plain(&req.content),
    };
    let ids = match ids {
        Ok(ids) => ids,
        Err(e) => return error(ApiError::invalid(e.to_string(), Some("content"))),
    };
    let tokens: Vec<Value> = match req.with_pieces {
        true => (ids.iter())
            .map(|&id| json!({"id": id, "piece": t.decode(&[id]).unwrap_or_default()}))
            .collect(),
        false => ids.iter().map(|&id| json!(id)).collect(),
    };
    Json(json!({ "tokens": tokens })).into_response()
}

/// The body of llama-server's `/detokenize`.
#[derive(serde::Deserialize)]
struct DetokenizeRequest {
    tokens: Vec<u64>,
}

/// `POST /detokenize` (llama-server's): the text of `tokens` (special tokens skipped).
pub(super) async fn detokenize(
    State(s): State<Shared>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let req: DetokenizeRequest = match parse(&s, &headers, &body) {
        Ok(r) => r,
        Err(e) => return error(e),
    };
    let t = &s.opts.tokenizer;
    let vocab = t.vocab_size();
    if let Some(bad) = req.tokens.iter().find(|&&id| id as usize >= vocab) {
        return error(ApiError::invalid(
            format!("token {bad} is not below the vocabulary's {vocab}"),
            Some("tokens"),
        ));
    }
    let ids: Vec<u32> = req.tokens.iter().map(|&id| id as u32).collect();
    match t.decode(&ids) {
        Ok(content) => Json(json!({ "content": content })).into_response(),
        Err(e) => error(ApiError::invalid(e.to_string(), Some("tokens"))),
    }
}
