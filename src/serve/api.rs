//! The OpenAI-compatible request and response shapes `dejavu serve` speaks, their validation,
//! and errors in OpenAI's JSON shape (`{"error": {"message", "type", "param", "code"}}`) with
//! their HTTP status. Parsing never panics: a body that is not a request is a 400.
use super::tool_api::{chat_message, tool_fields, tool_use, ToolChoice, ToolUse};
use crate::text::chat::ChatMessage;
use crate::text::constrain::Constraint;
use crate::text::gbnf;
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
    /// An assistant's calls (see `super::tool_api::tool_fields`).
    #[serde(default)]
    pub tool_calls: Option<Value>,
    /// A tool result's call and function.
    #[serde(default)]
    pub tool_call_id: Option<String>,
    #[serde(default)]
    pub name: Option<String>,
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
    /// Chat: `true` for each reply token's log-probability; completions: how many alternatives
    /// (0-20) to list beside each.
    #[serde(default)]
    logprobs: Option<Value>,
    /// Chat: how many alternatives (0-20) to list beside each token (needs `logprobs`).
    #[serde(default)]
    top_logprobs: Option<Value>,
    /// Token id (a decimal string) to a bias in [-100, 100] added to its logit.
    #[serde(default)]
    logit_bias: Option<Value>,
    /// llama-server's extensions its clients send: min-p, the repetition penalty and its
    /// window, generating past end-of-generation tokens, and whether the prompt may reuse the
    /// slot's cached prefix.
    #[serde(default)]
    min_p: Option<f64>,
    #[serde(default)]
    repeat_penalty: Option<f64>,
    #[serde(default)]
    repeat_last_n: Option<u64>,
    #[serde(default)]
    ignore_eos: Option<bool>,
    #[serde(default)]
    cache_prompt: Option<bool>,
    #[serde(default)]
    tools: Option<Value>,
    #[serde(default)]
    tool_choice: Option<Value>,
    #[serde(default)]
    functions: Option<Value>,
    #[serde(default)]
    function_call: Option<Value>,
    /// `{"type": "text"}`, `{"type": "json_object"}`, or `{"type": "json_schema",
    /// "json_schema": {"schema": ...}}`: structured output (`crate::text::constrain`).
    #[serde(default)]
    response_format: Option<Value>,
    /// A grammar the reply must match (llama-server's field): GBNF, as llama-server takes it,
    /// or llguidance's Lark syntax.
    #[serde(default)]
    grammar: Option<String>,
    #[serde(default)]
    presence_penalty: Option<f64>,
    #[serde(default)]
    frequency_penalty: Option<f64>,
    #[serde(default)]
    echo: Option<Value>,
    #[serde(default)]
    suffix: Option<Value>,
    #[serde(default)]
    best_of: Option<Value>,
    /// OpenAI's predicted outputs, output modalities and audio output.
    #[serde(default)]
    prediction: Option<Value>,
    #[serde(default)]
    modalities: Option<Value>,
    #[serde(default)]
    audio: Option<Value>,
}

/// A request body as `T`: a 400 for bytes that are not JSON, for JSON that is not `T`, and for
/// an object anywhere in it that names a key twice (serde_json would keep the last silently;
/// which one a client meant is not ours to guess).
pub fn parse_body<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    let bad = |e: String| ApiError::invalid(format!("the body is not a valid request: {e}"), None);
    let mut de = serde_json::Deserializer::from_slice(body);
    serde::de::Deserializer::deserialize_any(&mut de, NoDuplicates)
        .map_err(|e| bad(e.to_string()))?;
    serde_json::from_slice(body).map_err(|e| bad(e.to_string()))
}

/// Walks a JSON document, failing at the first object that names a key twice.
struct NoDuplicates;

impl<'de> serde::de::DeserializeSeed<'de> for NoDuplicates {
    type Value = ();
    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> serde::de::Visitor<'de> for NoDuplicates {
    type Value = ();
    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("JSON")
    }
    fn visit_bool<E>(self, _: bool) -> Result<(), E> {
        Ok(())
    }
    fn visit_i64<E>(self, _: i64) -> Result<(), E> {
        Ok(())
    }
    fn visit_u64<E>(self, _: u64) -> Result<(), E> {
        Ok(())
    }
    fn visit_f64<E>(self, _: f64) -> Result<(), E> {
        Ok(())
    }
    fn visit_str<E>(self, _: &str) -> Result<(), E> {
        Ok(())
    }
    fn visit_unit<E>(self) -> Result<(), E> {
        Ok(())
    }
    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut a: A) -> Result<(), A::Error> {
        while a.next_element_seed(NoDuplicates)?.is_some() {}
        Ok(())
    }
    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut a: A) -> Result<(), A::Error> {
        let mut seen = std::collections::HashSet::new();
        while let Some(k) = a.next_key::<String>()? {
            if !seen.insert(k.clone()) {
                return Err(serde::de::Error::custom(format!(
                    "the key `{k}` appears twice"
                )));
            }
            a.next_value_seed(NoDuplicates)?;
        }
        Ok(())
    }
}

/// Fields that ask for what the server does not do yet, and the values that ask for nothing
/// (what clients send by default): a field is refused unless absent, null or neutral.
pub const UNSUPPORTED: [&str; 8] = [
    "functions",
    "function_call",
    "echo",
    "suffix",
    "best_of",
    "prediction",
    "modalities",
    "audio",
];

/// Whether `v`, the value of the unsupported field `name`, asks for nothing.
fn neutral(name: &str, v: &Value) -> bool {
    let empty = |v: &Value| {
        v.as_array().is_some_and(|a| a.is_empty()) || v.as_object().is_some_and(|o| o.is_empty())
    };
    v.is_null()
        || match name {
            "echo" => v == &Value::Bool(false),
            "functions" => empty(v),
            "function_call" => v == "none" || v == "auto",
            "suffix" => v == "",
            "best_of" => v.as_f64() == Some(1.0),
            "modalities" => v == &serde_json::json!(["text"]),
            _ => false,
        }
}

/// What `response_format` and `grammar` ask the reply to match (`None`: free text).
fn constraint(
    format: Option<&Value>,
    grammar: Option<&str>,
) -> Result<Option<Constraint>, ApiError> {
    let bad = |m: &str| ApiError::invalid(m.to_string(), Some("response_format"));
    let format = match format.filter(|v| !v.is_null()) {
        None => None,
        Some(f) => match f.get("type").and_then(Value::as_str) {
            Some("text") => None,
            Some("json_object") => Some(Constraint::JsonSchema(
                serde_json::json!({"type": "object"}),
            )),
            Some("json_schema") => match f.get("json_schema").and_then(|j| j.get("schema")) {
                Some(s) if s.is_object() || s.is_boolean() => {
                    Some(Constraint::JsonSchema(s.clone()))
                }
                _ => {
                    return Err(bad(
                        "`response_format.json_schema.schema` must be a JSON schema",
                    ))
                }
            },
            _ => {
                return Err(bad(
                    "`response_format.type` is `text`, `json_object` or `json_schema`",
                ))
            }
        },
    };
    match (format, grammar.filter(|g| !g.trim().is_empty())) {
        (Some(_), Some(_)) => Err(ApiError::invalid(
            "`grammar` and a JSON `response_format` together: give one",
            Some("grammar"),
        )),
        (Some(c), None) => Ok(Some(c)),
        (None, Some(g)) if gbnf::is_gbnf(g) => match gbnf::to_lark(g) {
            Ok(lark) => Ok(Some(Constraint::Lark(lark))),
            Err(e) => Err(ApiError::invalid(
                format!("the GBNF grammar: {e}"),
                Some("grammar"),
            )),
        },
        (None, Some(g)) => Ok(Some(Constraint::Lark(g.to_string()))),
        (None, None) => Ok(None),
    }
}

/// Most alternatives a reply token's log-probabilities list (OpenAI's limit).
pub const MAX_TOP_LOGPROBS: usize = 20;

/// How many alternatives to list per token: `None` for no log-probabilities. Chat takes
/// `logprobs: true` and `top_logprobs: K`; completions take `logprobs: K`.
fn logprobs(
    chat: bool,
    lp: Option<&Value>,
    top: Option<&Value>,
) -> Result<Option<usize>, ApiError> {
    let count = |v: &Value, name: &'static str| match v.as_u64() {
        Some(k) if k as usize <= MAX_TOP_LOGPROBS => Ok(k as usize),
        _ => Err(ApiError::invalid(
            format!("`{name}` must be an integer in [0, {MAX_TOP_LOGPROBS}]"),
            Some(name),
        )),
    };
    let lp = lp.filter(|v| !v.is_null());
    let top = top.filter(|v| !v.is_null());
    if !chat {
        if top.is_some() {
            return Err(ApiError::invalid(
                "`top_logprobs` is a chat field: completions take `logprobs: K`",
                Some("top_logprobs"),
            ));
        }
        return lp.map(|v| count(v, "logprobs")).transpose();
    }
    let on = match lp {
        None => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => {
            return Err(ApiError::invalid(
                "`logprobs` is true or false in a chat request",
                Some("logprobs"),
            ))
        }
    };
    let k = top.map(|v| count(v, "top_logprobs")).transpose()?;
    match (on, k) {
        (false, Some(k)) if k > 0 => Err(ApiError::invalid(
            "`top_logprobs` needs `logprobs: true`",
            Some("top_logprobs"),
        )),
        (false, _) => Ok(None),
        (true, k) => Ok(Some(k.unwrap_or(0))),
    }
}

/// `logit_bias`: token ids (decimal strings, below `vocab`) to biases in [-100, 100].
fn logit_bias(v: Option<&Value>, vocab: usize) -> Result<Vec<(u32, f32)>, ApiError> {
    let bad = |m: String| ApiError::invalid(m, Some("logit_bias"));
    let Some(v) = v.filter(|v| !v.is_null()) else {
        return Ok(Vec::new());
    };
    let map = v
        .as_object()
        .ok_or_else(|| bad("`logit_bias` maps token ids to biases".into()))?;
    if map.len() > 1024 {
        return Err(bad("`logit_bias`: at most 1024 tokens".into()));
    }
    map.iter()
        .map(|(k, b)| {
            let id = (k.parse::<u32>().ok())
                .filter(|&id| (id as usize) < vocab)
                .ok_or_else(|| {
                    bad(format!(
                        "`logit_bias`: `{k}` is not a token id below {vocab}"
                    ))
                })?;
            match b.as_f64() {
                Some(b) if (-100.0..=100.0).contains(&b) => Ok((id, b as f32)),
                _ => Err(bad(format!(
                    "`logit_bias`: the bias of {k} must lie in [-100, 100]"
                ))),
            }
        })
        .collect()
}

#[derive(Debug, Clone, Deserialize)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

/// What to generate from: a conversation (through the chat template) or a plain prompt.
#[derive(Debug, Clone, PartialEq)]
pub enum Input {
    Chat(Vec<ChatMessage>),
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
    /// Choices to generate from the one prompt (`n`).
    pub n: usize,
    /// Each reply token's log-probability with this many alternatives (`None`: none).
    pub logprobs: Option<usize>,
    /// Generate past end-of-generation tokens (they are banned), to `max_tokens`.
    pub ignore_eos: bool,
    /// The prompt may reuse the slot's cached prefix (llama-server's `cache_prompt`).
    pub cache_prompt: bool,
    /// What the reply must match (structured output).
    pub constraint: Option<Constraint>,
    /// The tools offered (chat), and whether a call is required.
    pub tools: Option<ToolUse>,
}

/// The most choices (`n`) one request may ask for.
pub const MAX_CHOICES: u64 = 16;

/// Replies are capped at this many tokens (and by the context).
pub const MAX_TOKENS_CAP: u64 = 1 << 20;

impl Request {
    /// Parse a body (any bytes: invalid UTF-8 and malformed JSON are 400s).
    pub fn parse(body: &[u8]) -> Result<Self, ApiError> {
        parse_body(body)
    }

    /// Check every field we read; `chat` says which endpoint this is. `default_max` applies
    /// when the request names none; token ids are below `vocab`.
    pub fn validate(
        self,
        chat: bool,
        default_max: usize,
        vocab: usize,
    ) -> Result<GenRequest, ApiError> {
        let asked = [
            &self.functions,
            &self.function_call,
            &self.echo,
            &self.suffix,
            &self.best_of,
            &self.prediction,
            &self.modalities,
            &self.audio,
        ];
        for (name, v) in UNSUPPORTED.into_iter().zip(asked) {
            if let Some(v) = v.as_ref().filter(|v| !neutral(name, v)) {
                return Err(ApiError::invalid(
                    format!("`{name}`: {v} is not supported by this server yet"),
                    Some(name),
                ));
            }
        }
        let n = match self.n.unwrap_or(1) {
            n @ 1..=MAX_CHOICES => n as usize,
            _ => {
                return Err(ApiError::invalid(
                    format!("n must be in [1, {MAX_CHOICES}]"),
                    Some("n"),
                ))
            }
        };
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
            min_p: self.min_p.unwrap_or(0.0) as f32,
            repeat_penalty: self.repeat_penalty.unwrap_or(1.0) as f32,
            repeat_last_n: self.repeat_last_n.unwrap_or(64).min(1 << 20) as usize,
            presence_penalty: self.presence_penalty.unwrap_or(0.0) as f32,
            frequency_penalty: self.frequency_penalty.unwrap_or(0.0) as f32,
            logit_bias: logit_bias(self.logit_bias.as_ref(), vocab)?,
            seed: self.seed.unwrap_or(0),
        };
        if let Err(e) = sampling.validate() {
            // Temperature and top-p were checked above: what is left names one of these.
            let field = ["presence", "frequency", "repeat", "min-p"]
                .into_iter()
                .zip([
                    "presence_penalty",
                    "frequency_penalty",
                    "repeat_penalty",
                    "min_p",
                ])
                .find_map(|(word, field)| e.contains(word).then_some(field))
                .unwrap_or("min_p");
            return Err(ApiError::invalid(format!("{field}: {e}"), Some(field)));
        }
        let logprobs = logprobs(chat, self.logprobs.as_ref(), self.top_logprobs.as_ref())?;
        let constraint = constraint(self.response_format.as_ref(), self.grammar.as_deref())?;
        let tools = tool_use(self.tools.as_ref(), self.tool_choice.as_ref(), chat)?;
        if constraint.is_some() && tools.as_ref().is_some_and(|t| t.choice != ToolChoice::Auto) {
            return Err(ApiError::invalid(
                "a required tool call and `response_format` or `grammar` together: give one",
                Some("tool_choice"),
            ));
        }
        Ok(GenRequest {
            input,
            max_tokens,
            sampling,
            stop,
            stream: self.stream.unwrap_or(false),
            include_usage: self.stream_options.is_some_and(|o| o.include_usage),
            n,
            logprobs,
            ignore_eos: self.ignore_eos.unwrap_or(false),
            cache_prompt: self.cache_prompt.unwrap_or(true),
            constraint,
            tools,
        })
    }
}

fn messages(m: Option<Vec<Message>>) -> Result<Vec<ChatMessage>, ApiError> {
    let m = m.ok_or_else(|| ApiError::invalid("`messages` is required", Some("messages")))?;
    if m.is_empty() {
        return Err(ApiError::invalid("`messages` is empty", Some("messages")));
    }
    m.into_iter()
        .map(|msg| {
            if !["system", "developer", "user", "assistant", "tool"].contains(&msg.role.as_str()) {
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
            let extra = tool_fields(&role, msg.tool_calls, msg.tool_call_id, msg.name)?;
            Ok(chat_message(role, content_text(msg.content)?, extra))
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
        Request::parse(s.as_bytes())?.validate(true, 16, 100)
    }

    #[test]
    fn requests_parse_and_bad_ones_are_400s() {
        let ok = req(r#"{"messages":[{"role":"user","content":"hi"}],"max_tokens":5,"temperature":0,"stop":"\n"}"#).unwrap();
        let plain = |m: &[(&str, &str)]| {
            let owned: Vec<(String, String)> = m
                .iter()
                .map(|(r, c)| (r.to_string(), c.to_string()))
                .collect();
            Input::Chat(ChatMessage::plain(&owned))
        };
        assert_eq!(ok.input, plain(&[("user", "hi")]));
        assert_eq!((ok.max_tokens, ok.stop.len()), (5, 1));
        let parts = req(r#"{"messages":[{"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]}]}"#).unwrap();
        assert_eq!(parts.input, plain(&[("user", "ab")]));
        for bad in [
            "",
            "{",
            "[]",
            "null",
            r#"{"messages":[]}"#,
            r#"{"messages":"hi"}"#,
            r#"{"messages":[{"role":"tool","content":"x"}]}"#,
            r#"{"messages":[{"role":"user","content":"x"}],"n":0}"#,
            r#"{"messages":[{"role":"user","content":"x"}],"n":17}"#,
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
            .validate(false, 8, 100)
            .unwrap();
        assert_eq!(c.input, Input::Text("once".into()));
        assert!(Request::parse(br#"{"prompt":[1,2]}"#)
            .unwrap()
            .validate(false, 8, 100)
            .is_err());
    }

    #[test]
    fn sampling_fields_and_logprobs_are_read() {
        let r = req(r#"{"messages":[{"role":"user","content":"hi"}],"logit_bias":{"7":-100,"99":2.5},
            "presence_penalty":0.5,"frequency_penalty":-1,"min_p":0.1,"repeat_penalty":1.2,
            "repeat_last_n":8,"logprobs":true,"top_logprobs":4,"ignore_eos":true,"cache_prompt":false}"#)
        .unwrap();
        let mut bias = r.sampling.logit_bias.clone();
        bias.sort_by_key(|b| b.0);
        assert_eq!(bias, [(7, -100.0), (99, 2.5)]);
        let c = &r.sampling;
        assert_eq!((c.presence_penalty, c.frequency_penalty), (0.5, -1.0));
        assert_eq!((c.min_p, c.repeat_penalty, c.repeat_last_n), (0.1, 1.2, 8));
        assert_eq!(
            (r.logprobs, r.ignore_eos, r.cache_prompt),
            (Some(4), true, false)
        );
        let plain = req(r#"{"messages":[{"role":"user","content":"hi"}]}"#).unwrap();
        assert_eq!(
            (plain.logprobs, plain.ignore_eos, plain.cache_prompt),
            (None, false, true)
        );
        let on = req(r#"{"messages":[{"role":"user","content":"hi"}],"logprobs":true}"#).unwrap();
        assert_eq!(on.logprobs, Some(0));
        let comp = |body: &str| Request::parse(body.as_bytes())?.validate(false, 8, 100);
        assert_eq!(
            comp(r#"{"prompt":"a","logprobs":3}"#).unwrap().logprobs,
            Some(3)
        );
        for bad in [
            r#"{"prompt":"a","logprobs":true}"#,
            r#"{"prompt":"a","logprobs":21}"#,
            r#"{"prompt":"a","top_logprobs":2}"#,
        ] {
            assert_eq!(comp(bad).map(|_| ()).unwrap_err().status, 400, "{bad}");
        }
        for (bad, field) in [
            (r#""logit_bias":{"100":1}"#, "logit_bias"),
            (r#""logit_bias":{"-1":1}"#, "logit_bias"),
            (r#""logit_bias":[1]"#, "logit_bias"),
            (r#""logit_bias":{"1":"x"}"#, "logit_bias"),
            (r#""top_logprobs":3"#, "top_logprobs"),
            (r#""logprobs":true,"top_logprobs":-1"#, "top_logprobs"),
            (r#""logprobs":1"#, "logprobs"),
            (r#""presence_penalty":-2.5"#, "presence_penalty"),
            (r#""frequency_penalty":9"#, "frequency_penalty"),
            (r#""repeat_penalty":-1"#, "repeat_penalty"),
            (r#""min_p":-0.1"#, "min_p"),
        ] {
            let body = format!(r#"{{"messages":[{{"role":"user","content":"x"}}],{bad}}}"#);
            let e = req(&body).map(|_| ()).unwrap_err();
            assert_eq!((e.status, e.param), (400, Some(field)), "{bad}");
        }
    }
}
