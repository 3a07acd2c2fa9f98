//! Tool calling in the server. The request side: `tools` and `tool_choice` checked into a
//! [`ToolUse`], and the tool fields of chat messages (an assistant's `tool_calls`, a tool
//! result's `tool_call_id` and `name`) into what a chat template reads. The reply side: the
//! family's call format ([`tool_format`]), the grammar of a required call ([`constraint_of`]),
//! and the reply's text held back and parsed into calls ([`CallHold`]).
use super::api::{ApiError, GenRequest};
use crate::exec::Engine;
use crate::text::chat::ChatMessage;
use crate::text::constrain::Constraint;
use crate::text::tools::{check_tools, ToolCall, ToolFormat};
use serde_json::{Map, Value};

/// The tools a chat request offers and whether the reply must call one.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolUse {
    /// OpenAI's definitions, as the template renders them.
    pub tools: Vec<Value>,
    pub choice: ToolChoice,
}

/// `tool_choice`: the model decides (`auto`), must call one (`required`), or must call the
/// function named.
#[derive(Debug, Clone, PartialEq)]
pub enum ToolChoice {
    Auto,
    Required,
    Named(String),
}

/// `tools` and `tool_choice` of a request: `None` when no tool is offered or `tool_choice` is
/// `none` (the template then renders no tools and nothing is parsed as a call).
pub fn tool_use(
    tools: Option<&Value>,
    choice: Option<&Value>,
    chat: bool,
) -> Result<Option<ToolUse>, ApiError> {
    let tools = tools.filter(|t| !t.is_null());
    let choice = choice.filter(|c| !c.is_null());
    let bad = |m: String, p| ApiError::invalid(m, Some(p));
    let Some(tools) = tools else {
        return match choice {
            None => Ok(None),
            Some(c) if c == "none" || c == "auto" => Ok(None),
            Some(_) => Err(bad(
                "`tool_choice` names a call but no `tools` are given".into(),
                "tool_choice",
            )),
        };
    };
    if !chat {
        return Err(bad("`tools` are for /v1/chat/completions".into(), "tools"));
    }
    let tools = check_tools(tools).map_err(|e| bad(e, "tools"))?;
    let choice =
        match choice {
            None => ToolChoice::Auto,
            Some(c) if c == "none" => return Ok(None),
            Some(c) if c == "auto" => ToolChoice::Auto,
            Some(c) if c == "required" => ToolChoice::Required,
            Some(c) => {
                let name = (c.get("type").and_then(Value::as_str) == Some("function"))
                    .then(|| c.get("function")?.get("name")?.as_str())
                    .flatten();
                match name {
                    Some(n) if tools.iter().any(|t| t["function"]["name"] == n) => {
                        ToolChoice::Named(n.to_string())
                    }
                    _ => return Err(bad(
                        "`tool_choice`: `none`, `auto`, `required`, or {\"type\": \"function\", \
                         \"function\": {\"name\": ...}} naming one of the tools"
                            .into(),
                        "tool_choice",
                    )),
                }
            }
        };
    if tools.is_empty() {
        return match choice {
            ToolChoice::Auto => Ok(None),
            _ => Err(bad(
                "`tool_choice` asks for a call but `tools` is empty".into(),
                "tool_choice",
            )),
        };
    }
    Ok(Some(ToolUse { tools, choice }))
}

/// A chat message's tool fields, for the template: an assistant's `tool_calls` (each
/// `{"id", "type": "function", "function": {"name", "arguments"}}`, the arguments' JSON text
/// given to the template as the object it holds, as Hugging Face's templates expect), a tool
/// result's `tool_call_id` and `name`.
pub fn tool_fields(
    role: &str,
    tool_calls: Option<Value>,
    tool_call_id: Option<String>,
    name: Option<String>,
) -> Result<Map<String, Value>, ApiError> {
    let bad = |m: &str| ApiError::invalid(m.to_string(), Some("messages"));
    let mut extra = Map::new();
    if let Some(calls) = tool_calls.filter(|c| !c.is_null()) {
        if role != "assistant" {
            return Err(bad("only an assistant's message has `tool_calls`"));
        }
        let list = calls
            .as_array()
            .ok_or_else(|| bad("`tool_calls` must be a list"))?;
        let mut out = Vec::with_capacity(list.len());
        for c in list {
            let f = c
                .get("function")
                .ok_or_else(|| bad("a tool call without `function`"))?;
            let name = f.get("name").and_then(Value::as_str);
            let args = match f.get("arguments") {
                Some(Value::String(s)) => {
                    serde_json::from_str(s).unwrap_or(Value::String(s.clone()))
                }
                Some(v @ Value::Object(_)) => v.clone(),
                None | Some(Value::Null) => Value::Object(Map::new()),
                Some(_) => return Err(bad("a tool call's `arguments`: JSON text of an object")),
            };
            let name = name.ok_or_else(|| bad("a tool call's function has no `name`"))?;
            out.push(serde_json::json!({
                "id": c.get("id").cloned().unwrap_or(Value::Null),
                "type": "function",
                "function": {"name": name, "arguments": args},
            }));
        }
        extra.insert("tool_calls".into(), Value::Array(out));
    }
    if role == "tool" {
        let id = tool_call_id.ok_or_else(|| bad("a tool message needs `tool_call_id`"))?;
        extra.insert("tool_call_id".into(), id.into());
    }
    if let Some(n) = name.filter(|_| role == "tool") {
        extra.insert("name".into(), n.into());
    }
    Ok(extra)
}

/// A message of `role` and `content` with its tool fields.
pub fn chat_message(role: String, content: String, extra: Map<String, Value>) -> ChatMessage {
    ChatMessage {
        role,
        content,
        extra,
    }
}

/// How the model's replies write tool calls, when `req` offers tools: a 400 where its chat
/// template renders none, or in a format not parsed here.
pub fn tool_format(engine: &Engine, req: &GenRequest) -> Result<Option<ToolFormat>, ApiError> {
    if req.tools.is_none() {
        return Ok(None);
    }
    let tpl = engine.tokenizer.chat_template().unwrap_or_default();
    match ToolFormat::of_template(tpl) {
        Ok(Some(f)) => Ok(Some(f)),
        Ok(None) => Err(ApiError::invalid(
            "this model's chat template does not render tools",
            Some("tools"),
        )),
        Err(e) => Err(ApiError::invalid(e, Some("tools"))),
    }
}

/// What the reply must match: `req`'s structured output, or one call in the family's format
/// `fmt` where `tool_choice` requires a call.
pub fn constraint_of(
    engine: &Engine,
    req: &GenRequest,
    fmt: Option<ToolFormat>,
) -> Result<Option<Constraint>, ApiError> {
    let (Some(u), Some(fmt)) = (&req.tools, fmt) else {
        return Ok(req.constraint.clone());
    };
    let only = match &u.choice {
        ToolChoice::Auto => return Ok(req.constraint.clone()),
        ToolChoice::Required => None,
        ToolChoice::Named(n) => Some(n.as_str()),
    };
    let lark = fmt.required(&u.tools, only, &|t| control_token(engine, t));
    Ok(Some(Constraint::Lark(
        lark.map_err(|e| ApiError::invalid(e, Some("tool_choice")))?,
    )))
}

/// The id of the one token whose text is `text` (an added token, such as Qwen's
/// `<tool_call>`), if the tokenizer has one: decoding may hide it, and a grammar names it by id.
fn control_token(engine: &Engine, text: &str) -> Option<u32> {
    let t = &engine.tokenizer;
    match t.encode(text).ok()?.as_slice() {
        [id] if t.token_text(*id) == Some(text) => Some(*id),
        _ => None,
    }
}

/// The format's markers that are control tokens (which the reply's text would not show), by id.
pub fn marker_tokens(engine: &Engine, fmt: Option<ToolFormat>) -> Vec<(u32, &'static str)> {
    let markers = fmt.map_or(&[][..], ToolFormat::markers);
    (markers.iter())
        .filter_map(|&m| Some((control_token(engine, m)?, m)))
        .collect()
}

/// A reply's text on its way out when tools are offered: content is sent as it comes but for
/// a tool call (or what may be the start of one), held back and parsed at the end.
pub struct CallHold {
    fmt: Option<ToolFormat>,
    /// The functions offered.
    names: Vec<String>,
    reply: String,
    shown: usize,
}

impl CallHold {
    pub fn new(fmt: Option<ToolFormat>, tools: Option<&ToolUse>) -> Self {
        let names = (tools.map_or(&[][..], |u| &u.tools).iter())
            .filter_map(|t| Some(t.get("function")?.get("name")?.as_str()?.to_string()))
            .collect();
        Self {
            fmt,
            names,
            reply: String::new(),
            shown: 0,
        }
    }

    /// The part of the reply after `text` that may be shown now.
    pub fn push(&mut self, text: &str) -> String {
        let Some(fmt) = self.fmt else {
            return text.to_string();
        };
        self.reply += text;
        let upto = fmt.shown(&self.reply).max(self.shown);
        let out = self.reply[self.shown..upto].to_string();
        self.shown = upto;
        out
    }

    /// At the reply's end: the content still held back, and its calls (`None`: it holds no
    /// call that parses, so all of it is content).
    pub fn finish(self) -> (String, Option<Vec<ToolCall>>) {
        let Some(fmt) = self.fmt else {
            return (String::new(), None);
        };
        let names: Vec<&str> = self.names.iter().map(String::as_str).collect();
        match fmt.parse(&self.reply, &names) {
            Some((_, calls)) => {
                let at = fmt.shown(&self.reply).max(self.shown);
                (
                    self.reply[self.shown..at].trim_end().to_string(),
                    Some(calls),
                )
            }
            None => (self.reply[self.shown..].to_string(), None),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn tool_choice_and_tool_fields_are_read() {
        let tools = json!([{"type": "function", "function": {"name": "f"}}]);
        let u = |c: Value| tool_use(Some(&tools), Some(&c), true);
        assert_eq!(u(json!("auto")).unwrap().unwrap().choice, ToolChoice::Auto);
        assert_eq!(u(json!("none")).unwrap(), None);
        assert_eq!(
            u(json!("required")).unwrap().unwrap().choice,
            ToolChoice::Required
        );
        let named = json!({"type": "function", "function": {"name": "f"}});
        assert_eq!(
            u(named).unwrap().unwrap().choice,
            ToolChoice::Named("f".into())
        );
        assert!(u(json!({"type": "function", "function": {"name": "g"}})).is_err());
        assert!(u(json!("sometimes")).is_err());
        assert!(
            tool_use(Some(&tools), None, false).is_err(),
            "completions take no tools"
        );
        assert!(tool_use(None, Some(&json!("required")), true).is_err());
        assert_eq!(tool_use(None, Some(&json!("auto")), true).unwrap(), None);
        // An assistant's call: its arguments' JSON text becomes the object it holds.
        let calls = json!([{"id": "c1", "type": "function",
            "function": {"name": "f", "arguments": "{\"a\": 1}"}}]);
        let extra = tool_fields("assistant", Some(calls.clone()), None, None).unwrap();
        assert_eq!(
            extra["tool_calls"][0]["function"]["arguments"],
            json!({"a": 1})
        );
        assert!(tool_fields("user", Some(calls), None, None).is_err());
        let result = tool_fields("tool", None, Some("c1".into()), Some("f".into())).unwrap();
        assert_eq!(
            (result["tool_call_id"].as_str(), result["name"].as_str()),
            (Some("c1"), Some("f"))
        );
        assert!(
            tool_fields("tool", None, None, None).is_err(),
            "a result names its call"
        );
    }
}
