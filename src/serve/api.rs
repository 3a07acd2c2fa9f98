//! The OpenAI-compatible request and response shapes `dejavu serve` speaks, their validation,
//! and errors in OpenAI's JSON shape (`{"error": {"message", "type", "param", "code"}}`) with
//! their HTTP status. Parsing never panics: a body that is not a request is a 400.
use crate::text::sampling::SamplerConfig;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

/// An error as the client sees it: a status and OpenAI's error object.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    pub status: u16,
    pub message: String,
    /// OpenAI's `type`: `invalid_request_error`, `authentication_error`, `not_found_error`,
    /// `server_error`, ...
    pub kind: &'static str,
    pub param: Option<&'static str>,
    pub code: Option<&'static str>,
}

impl ApiError {
    pub fn invalid(message: impl Into<String>, param: Option<&'static str>) -> Self {
        Self {
            status: 400,
            message: message.into(),
            kind: "invalid_request_error",
            param,
            code: None,
        }
    }
    pub fn not_found(message: impl Into<String>, code: &'static str) -> Self {
        Self {
            status: 404,
            message: message.into(),
            kind: "invalid_request_error",
            param: None,
            code: Some(code),
        }
    }
    pub fn unauthorized() -> Self {
        Self {
            status: 401,
            message: "invalid or missing API key (send `Authorization: Bearer KEY`)".into(),
            kind: "authentication_error",
            param: None,
            code: Some("invalid_api_key"),
        }
    }
    pub fn busy(message: impl Into<String>) -> Self {
        Self {
            status: 503,
            message: message.into(),
            kind: "server_error",
            param: None,
            code: Some("server_busy"),
        }
    }
    pub fn internal(message: impl Into<String>) -> Self {
        Self {
            status: 500,
            message: message.into(),
            kind: "server_error",
            param: None,
            code: None,
        }
    }
    /// The JSON body.
    pub fn body(&self) -> Value {
        json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.code,
        }})
    }
}

/// A chat message. `content` is a string, or OpenAI's list of parts (the text parts are joined).
#[derive(Debug, Clone, Deserialize)]
pub struct Message {
    pub role: String,
    #[serde(default)]
    pub content: Option<Value>,
}

/// `stop`: one string or a list of up to 4.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

/// The fields of both endpoints' requests that we read. Fields that ask for what we do not do
/// yet ([`UNSUPPORTED`]) are refused with a 400 naming them unless their value is neutral;
/// other fields are accepted and ignored.
#[derive(Debug, Clone, Deserialize)]
pub struct Request {
    #[serde(default)]
    pub model: Option<String>,
    /// `/v1/chat/completions`.
    #[serde(default)]
    pub messages: Option<Vec<Message>>,
    /// `/v1/completions`: a string, or a list holding one string.
    #[serde(default)]
    pub prompt: Option<Value>,
    #[serde(default)]
    pub max_tokens: Option<u64>,
    #[serde(default)]
    pub max_completion_tokens: Option<u64>,
    #[serde(default)]
    pub temperature: Option<f64>,
    #[serde(default)]
    pub top_p: Option<f64>,
    /// An extension (llama.cpp's server has it too).
    #[serde(default)]
    pub top_k: Option<u64>,
    #[serde(default)]
    pub seed: Option<u64>,
    #[serde(default)]
    pub stop: Option<Stop>,
    #[serde(default)]
    pub n: Option<u64>,
    #[serde(default)]
    pub stream: Option<bool>,
    #[serde(default)]
    pub stream_options: Option<StreamOptions>,
    #[serde(default)]
    logprobs: Option<Value>,
    #[serde(default)]
    top_logprobs: Option<Value>,
    #[serde(default)]
    logit_bias: Option<Value>,
    #[serde(default)]
    tools: Option<Value>,
    #[serde(default)]
    tool_choice: Option<Value>,
    #[serde(default)]
    functions: Option<Value>,
    #[serde(default)]
    function_call: Option<Value>,
    #[serde(default)]
    response_format: Option<Value>,
    #[serde(default)]
    presence_penalty: Option<Value>,
    #[serde(default)]
    frequency_penalty: Option<Value>,
    #[serde(default)]
    echo: Option<Value>,
    #[serde(default)]
    suffix: Option<Value>,
    #[serde(default)]
    best_of: Option<Value>,
}

/// Fields that ask for what the server does not do yet, and the values that ask for nothing
/// (what clients send by default): a field is refused unless absent, null or neutral.
pub const UNSUPPORTED: [&str; 13] = [
    "logprobs",
    "top_logprobs",
    "logit_bias",
    "tools",
    "tool_choice",
    "functions",
    "function_call",
    "response_format",
    "presence_penalty",
    "frequency_penalty",
    "echo",
    "suffix",
    "best_of",
];

/// Whether `v`, the value of the unsupported field `name`, asks for nothing.
fn neutral(name: &str, v: &Value) -> bool {
    let zero = v.as_f64() == Some(0.0);
    let empty = |v: &Value| {
        v.as_array().is_some_and(|a| a.is_empty()) || v.as_object().is_some_and(|o| o.is_empty())
    };
    v.is_null()
        || match name {
            "logprobs" | "echo" => v == &Value::Bool(false) || zero,
            "top_logprobs" | "presence_penalty" | "frequency_penalty" => zero,
            "logit_bias" | "tools" | "functions" => empty(v),
            "tool_choice" | "function_call" => v == "none" || v == "auto",
            "response_format" => v.get("type").and_then(Value::as_str) == Some("text"),
            "suffix" => v == "",
            "best_of" => v.as_f64() == Some(1.0),
            _ => false,
        }
}

#[derive(Debug, Clone, Deserialize)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

/// What to generate from: a conversation (through the chat template) or a plain prompt.
#[derive(Debug, Clone, PartialEq)]
pub enum Input {
    Chat(Vec<(String, String)>),
    Text(String),
}

/// A validated request.
#[derive(Debug, Clone)]
pub struct GenRequest {
    pub input: Input,
    pub max_tokens: usize,
    pub sampling: SamplerConfig,
    pub stop: Vec<String>,
    pub stream: bool,
    pub include_usage: bool,
}

/// Replies are capped at this many tokens (and by the context).
pub const MAX_TOKENS_CAP: u64 = 1 << 20;

impl Request {
    /// Parse a body (any bytes: invalid UTF-8 and malformed JSON are 400s).
    pub fn parse(body: &[u8]) -> Result<Self, ApiError> {
        serde_json::from_slice(body)
            .map_err(|e| ApiError::invalid(format!("the body is not a valid request: {e}"), None))
    }

    /// Check every field we read; `chat` says which endpoint this is. `default_max` applies
    /// when the request names none.
    pub fn validate(self, chat: bool, default_max: usize) -> Result<GenRequest, ApiError> {
        let asked = [
            &self.logprobs,
            &self.top_logprobs,
            &self.logit_bias,
            &self.tools,
            &self.tool_choice,
            &self.functions,
            &self.function_call,
            &self.response_format,
            &self.presence_penalty,
            &self.frequency_penalty,
            &self.echo,
            &self.suffix,
            &self.best_of,
        ];
        for (name, v) in UNSUPPORTED.into_iter().zip(asked) {
            if let Some(v) = v.as_ref().filter(|v| !neutral(name, v)) {
                return Err(ApiError::invalid(
                    format!("`{name}`: {v} is not supported by this server yet"),
                    Some(name),
                ));
            }
        }
        if self.n.is_some_and(|n| n != 1) {
            return Err(ApiError::invalid("only n = 1 is supported", Some("n")));
        }
        let input = match chat {
            true => Input::Chat(messages(self.messages)?),
            false => Input::Text(prompt(self.prompt)?),
        };
        let max = self.max_completion_tokens.or(self.max_tokens);
        let max_tokens = match max {
            Some(0) => {
                return Err(ApiError::invalid(
                    "max_tokens must be >= 1",
                    Some("max_tokens"),
                ))
            }
            Some(m) => m.min(MAX_TOKENS_CAP) as usize,
            None => default_max,
        };
        let temperature = self.temperature.unwrap_or(1.0);
        if !(0.0..=2.0).contains(&temperature) {
            return Err(ApiError::invalid(
                "temperature must be in [0, 2]",
                Some("temperature"),
            ));
        }
        let top_p = self.top_p.unwrap_or(1.0);
        if !(top_p > 0.0 && top_p <= 1.0) {
            return Err(ApiError::invalid("top_p must be in (0, 1]", Some("top_p")));
        }
        let stop = match self.stop {
            None => Vec::new(),
            Some(Stop::One(s)) => vec![s],
            Some(Stop::Many(v)) => v,
        };
        if stop.len() > 4 || stop.iter().any(|s| s.is_empty() || s.len() > 256) {
            return Err(ApiError::invalid(
                "stop: up to 4 non-empty strings of at most 256 bytes",
                Some("stop"),
            ));
        }
        let sampling = SamplerConfig {
            temperature: temperature as f32,
            top_k: self.top_k.unwrap_or(0).min(u32::MAX as u64) as usize,
            top_p: top_p as f32,
            min_p: 0.0,
            repeat_penalty: 1.0,
            repeat_last_n: 64,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: self.seed.unwrap_or(0),
        };
        Ok(GenRequest {
            input,
            max_tokens,
            sampling,
            stop,
            stream: self.stream.unwrap_or(false),
            include_usage: self.stream_options.is_some_and(|o| o.include_usage),
        })
    }
}

fn messages(m: Option<Vec<Message>>) -> Result<Vec<(String, String)>, ApiError> {
    let m = m.ok_or_else(|| ApiError::invalid("`messages` is required", Some("messages")))?;
    if m.is_empty() {
        return Err(ApiError::invalid("`messages` is empty", Some("messages")));
    }
    m.into_iter()
        .map(|msg| {
            if !["system", "developer", "user", "assistant"].contains(&msg.role.as_str()) {
                return Err(ApiError::invalid(
                    format!("unsupported message role `{}`", msg.role),
                    Some("messages"),
                ));
            }
            let role = if msg.role == "developer" {
                "system".into()
            } else {
                msg.role
            };
            Ok((role, content_text(msg.content)?))
        })
        .collect()
}

/// A message's text: a string, or the text parts of a list.
fn content_text(c: Option<Value>) -> Result<String, ApiError> {
    let bad = || {
        ApiError::invalid(
            "message content: a string or a list of text parts",
            Some("messages"),
        )
    };
    match c {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(s)) => Ok(s),
        Some(Value::Array(parts)) => parts
            .iter()
            .map(
                |p| match (p.get("type").and_then(Value::as_str), p.get("text")) {
                    (Some("text"), Some(Value::String(t))) => Ok(t.as_str()),
                    _ => Err(bad()),
                },
            )
            .collect::<Result<Vec<_>, _>>()
            .map(|v| v.concat()),
        Some(_) => Err(bad()),
    }
}

fn prompt(p: Option<Value>) -> Result<String, ApiError> {
    match p {
        Some(Value::String(s)) => Ok(s),
        Some(Value::Array(v)) if v.len() == 1 && v[0].is_string() => {
            Ok(v[0].as_str().unwrap_or_default().to_string())
        }
        Some(_) => Err(ApiError::invalid(
            "`prompt` must be a string (or a list of one string)",
            Some("prompt"),
        )),
        None => Err(ApiError::invalid("`prompt` is required", Some("prompt"))),
    }
}

/// Token counts of a reply.
#[derive(Debug, Clone, Copy, Default, Serialize, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub total_tokens: usize,
}

impl Usage {
    pub fn new(prompt: usize, completion: usize) -> Self {
        Self {
            prompt_tokens: prompt,
            completion_tokens: completion,
            total_tokens: prompt + completion,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(s: &str) -> Result<GenRequest, ApiError> {
        Request::parse(s.as_bytes())?.validate(true, 16)
    }

    #[test]
    fn requests_parse_and_bad_ones_are_400s() {
        let ok = req(r#"{"messages":[{"role":"user","content":"hi"}],"max_tokens":5,"temperature":0,"stop":"\n"}"#).unwrap();
        assert_eq!(ok.input, Input::Chat(vec![("user".into(), "hi".into())]));
        assert_eq!((ok.max_tokens, ok.stop.len()), (5, 1));
        let parts = req(r#"{"messages":[{"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]}]}"#).unwrap();
        assert_eq!(parts.input, Input::Chat(vec![("user".into(), "ab".into())]));
        for bad in [
            "",
            "{",
            "[]",
            "null",
            r#"{"messages":[]}"#,
            r#"{"messages":"hi"}"#,
            r#"{"messages":[{"role":"tool","content":"x"}]}"#,
            r#"{"messages":[{"role":"user","content":"x"}],"n":2}"#,
            r#"{"messages":[{"role":"user","content":"x"}],"temperature":-1}"#,
            r#"{"messages":[{"role":"user","content":"x"}],"top_p":0}"#,
            r#"{"messages":[{"role":"user","content":"x"}],"max_tokens":0}"#,
            r#"{"messages":[{"role":"user","content":"x"}],"max_tokens":-3}"#,
            r#"{"messages":[{"role":"user","content":"x"}],"stop":["a","b","c","d","e"]}"#,
            r#"{"messages":[{"role":"user","content":7}]}"#,
        ] {
            assert_eq!(req(bad).map(|_| ()).unwrap_err().status, 400, "{bad}");
        }
        assert_eq!(Request::parse(b"\xff\xfe").unwrap_err().status, 400);
        let c = Request::parse(br#"{"prompt":["once"]}"#)
            .unwrap()
            .validate(false, 8)
            .unwrap();
        assert_eq!(c.input, Input::Text("once".into()));
        assert!(Request::parse(br#"{"prompt":[1,2]}"#)
            .unwrap()
            .validate(false, 8)
            .is_err());
    }
}
