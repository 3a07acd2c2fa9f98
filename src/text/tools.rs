//! Tool calling (OpenAI's `tools` and `tool_choice`): the tool definitions a chat template
//! renders, how a family's replies write their calls, and reading the calls back out of a reply.
//!
//! A template renders tools when its text reads a `tools` variable. The family's call format is
//! read off the template: Hermes-style `<tool_call>{"name": ..., "arguments": ...}</tool_call>`
//! (Qwen 2.5 and 3, Hermes, SmolLM3), Mistral's `[TOOL_CALLS][{...}]`, and Llama 3.1+'s bare
//! `{"name": ..., "parameters": ...}`. A reply's calls are parsed from its text; where a call
//! is required (`tool_choice` `required` or a named function) the reply is constrained to one
//! call in the family's format through a grammar (`crate::text::constrain`).
use serde_json::{json, Value};

/// How a family's replies write tool calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolFormat {
    /// `<tool_call>\n{"name": N, "arguments": {...}}\n</tool_call>`, one block per call.
    Hermes,
    /// `[TOOL_CALLS][{"name": N, "arguments": {...}}, ...]`.
    Mistral,
    /// The whole reply one object `{"name": N, "parameters": {...}}` (Llama 3.1+), after an
    /// optional `<|python_tag|>`.
    Llama3,
}

/// A tool call read from a reply: the function's name and its arguments as JSON text.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolCall {
    pub name: String,
    pub arguments: String,
}

impl ToolFormat {
    /// The format of the chat template `tpl`: `Ok(None)` when it renders no tools; an error
    /// naming the gap when it renders them in a format not parsed here.
    pub fn of_template(tpl: &str) -> Result<Option<Self>, String> {
        if !tpl.contains("tools") {
            return Ok(None);
        }
        if tpl.contains("<tool_call>") {
            Ok(Some(ToolFormat::Hermes))
        } else if tpl.contains("[TOOL_CALLS]") {
            Ok(Some(ToolFormat::Mistral))
        } else if tpl.contains("<|python_tag|>") || tpl.contains("\"parameters\"") {
            Ok(Some(ToolFormat::Llama3))
        } else {
            Err(
                "this model's chat template renders tools in a call format this server does not \
                 parse (it reads Hermes `<tool_call>`, Mistral `[TOOL_CALLS]` and Llama 3 JSON)"
                    .into(),
            )
        }
    }

    /// The text that opens a call in a reply (`None`: a call is the whole reply).
    fn opening(self) -> Option<&'static str> {
        match self {
            ToolFormat::Hermes => Some("<tool_call>"),
            ToolFormat::Mistral => Some("[TOOL_CALLS]"),
            ToolFormat::Llama3 => None,
        }
    }

    /// The texts of the format's markers, which a tokenizer may hold as control tokens (a
    /// reply's text then shows them: see `serve::worker`).
    pub fn markers(self) -> &'static [&'static str] {
        match self {
            ToolFormat::Hermes => &["<tool_call>", "</tool_call>"],
            ToolFormat::Mistral => &["[TOOL_CALLS]"],
            ToolFormat::Llama3 => &["<|python_tag|>"],
        }
    }

    /// The key of a call's arguments.
    fn arguments_key(self) -> &'static str {
        match self {
            ToolFormat::Llama3 => "parameters",
            _ => "arguments",
        }
    }

    /// How much of the reply so far (`text`) may be shown as content: all of it but a call
    /// (from its opening on) or the start of one (a suffix that could open a call). A reply
    /// that opens with `{` (a bare call: Llama 3's format, and small Hermes-style models that
    /// leave out the tags) or `<|python_tag|>` is held back whole.
    pub fn shown(self, text: &str) -> usize {
        let t = text.trim_start();
        let could = |p: &str| p.starts_with(t) || t.starts_with(p);
        let bare = could("{") || self == ToolFormat::Llama3 && could("<|python_tag|>");
        if bare && self != ToolFormat::Mistral {
            return 0;
        }
        let Some(open) = self.opening() else {
            return text.len();
        };
        if let Some(at) = text.find(open) {
            return at;
        }
        // The longest suffix of `text` that begins `open`.
        (1..open.len().min(text.len() + 1))
            .rev()
            .find(|&k| {
                text.is_char_boundary(text.len() - k) && open.starts_with(&text[text.len() - k..])
            })
            .map_or(text.len(), |k| text.len() - k)
    }

    /// The calls of a whole reply, and the content before them (trimmed; `None` when empty).
    /// `None` when the reply holds no call in this format that parses (it is then all content).
    /// A Hermes-style reply without the tags is read as bare calls, one object a line, each to
    /// one of the functions `names` (small models leave the tags out).
    pub fn parse(self, text: &str, names: &[&str]) -> Option<(Option<String>, Vec<ToolCall>)> {
        let (before, calls) = match self {
            ToolFormat::Hermes if !text.contains("<tool_call>") => {
                let calls = (text.lines().filter(|l| !l.trim().is_empty()))
                    .map(|l| self.call(&serde_json::from_str(l.trim()).ok()?))
                    .collect::<Option<Vec<_>>>()?;
                if !calls.iter().all(|c| names.contains(&c.name.as_str())) {
                    return None;
                }
                (&text[..0], calls)
            }
            ToolFormat::Hermes => {
                let at = text.find("<tool_call>")?;
                let mut calls = Vec::new();
                let mut rest = &text[at..];
                while let Some(body) = rest.strip_prefix("<tool_call>") {
                    let (inner, after) = match body.find("</tool_call>") {
                        Some(end) => (&body[..end], &body[end + "</tool_call>".len()..]),
                        None => (body, ""),
                    };
                    calls.push(self.call(&serde_json::from_str(inner.trim()).ok()?)?);
                    rest = after.trim_start();
                }
                if !rest.is_empty() {
                    return None;
                }
                (&text[..at], calls)
            }
            ToolFormat::Mistral => {
                let at = text.find("[TOOL_CALLS]")?;
                let list: Value = serde_json::from_str(text[at + 12..].trim()).ok()?;
                let calls = (list.as_array()?.iter())
                    .map(|c| self.call(c))
                    .collect::<Option<Vec<_>>>()?;
                (&text[..at], calls)
            }
            ToolFormat::Llama3 => {
                let t = text.trim_start();
                let t = t.strip_prefix("<|python_tag|>").unwrap_or(t);
                (
                    &text[..0],
                    vec![self.call(&serde_json::from_str(t.trim()).ok()?)?],
                )
            }
        };
        if calls.is_empty() {
            return None;
        }
        let before = before.trim();
        Some(((!before.is_empty()).then(|| before.to_string()), calls))
    }

    /// One call object: its `name` and its arguments (an object, or JSON text of one).
    fn call(self, v: &Value) -> Option<ToolCall> {
        let name = v.get("name")?.as_str()?.to_string();
        let args = v.get(self.arguments_key()).or_else(|| v.get("arguments"))?;
        let arguments = match args {
            Value::String(s) if serde_json::from_str::<Value>(s).is_ok_and(|a| a.is_object()) => {
                s.clone()
            }
            a if a.is_object() => a.to_string(),
            _ => return None,
        };
        Some(ToolCall { name, arguments })
    }

    /// A Lark grammar (llguidance's syntax) of one call in this format to one of `tools`
    /// (`only`: to that function alone), each call's arguments valid under its function's
    /// `parameters` schema. A marker that is a control token (`control`: its id, by its text)
    /// is that token (`<[ID]>`), else its text.
    pub fn required(
        self,
        tools: &[Value],
        only: Option<&str>,
        control: &dyn Fn(&str) -> Option<u32>,
    ) -> Result<String, String> {
        let key = self.arguments_key();
        let mut defs = serde_json::Map::new();
        let calls: Vec<Value> = (tools.iter())
            .filter_map(|t| t.get("function"))
            .filter(|f| only.is_none_or(|n| f.get("name").and_then(Value::as_str) == Some(n)))
            .enumerate()
            .map(|(i, f)| {
                let params = f
                    .get("parameters")
                    .cloned()
                    .unwrap_or(json!({"type": "object"}));
                let params = hoist_defs(params, i, &mut defs);
                json!({
                    "type": "object",
                    "properties": {"name": {"const": f.get("name")}, key: params},
                    "required": ["name", key],
                    "additionalProperties": false,
                })
            })
            .collect();
        if calls.is_empty() {
            return Err(format!("no tool named {:?}", only.unwrap_or_default()));
        }
        let mut schema = json!({
            "anyOf": calls,
            "x-guidance": {"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "},
        });
        if !defs.is_empty() {
            schema["$defs"] = Value::Object(defs);
        }
        let call = format!("call: %json {schema}");
        let lit = |t: &str| match control(t) {
            Some(id) => format!("<[{id}]>"),
            None => serde_json::to_string(t).unwrap_or_default(),
        };
        Ok(match self {
            ToolFormat::Hermes => format!(
                "start: {} \"\\n\" call \"\\n\" {}\n{call}",
                lit("<tool_call>"),
                lit("</tool_call>")
            ),
            ToolFormat::Mistral => {
                format!("start: {} \"[\" call \"]\"\n{call}", lit("[TOOL_CALLS]"))
            }
            ToolFormat::Llama3 => format!("start: call\n{call}"),
        })
    }
}

/// Tool `i`'s parameters schema made to sit inside the one schema of a call: its own root
/// becomes `$defs/t{i}` of the call's, its `$defs` (or `definitions`) `$defs/t{i}_NAME`, and
/// its `$ref`s are rewritten to match (pydantic's `#/$defs/Model`, a root's `#`, any
/// `#/pointer`); returns the `$ref` to its root when it refers to anything, else itself.
fn hoist_defs(mut params: Value, i: usize, defs: &mut serde_json::Map<String, Value>) -> Value {
    fn rewrite(v: &mut Value, i: usize, refs: &mut bool) {
        match v {
            Value::Object(o) => {
                if let Some(Value::String(r)) = o.get_mut("$ref") {
                    *refs = true;
                    let named =
                        (r.strip_prefix("#/$defs/")).or_else(|| r.strip_prefix("#/definitions/"));
                    *r = match (r.as_str(), named) {
                        ("#", _) => format!("#/$defs/t{i}"),
                        (_, Some(rest)) => format!("#/$defs/t{i}_{rest}"),
                        (r, None) => match r.strip_prefix("#/") {
                            Some(pointer) => format!("#/$defs/t{i}/{pointer}"),
                            None => r.to_string(), // not a local reference: left to the compiler
                        },
                    };
                }
                o.values_mut().for_each(|v| rewrite(v, i, refs));
            }
            Value::Array(a) => a.iter_mut().for_each(|v| rewrite(v, i, refs)),
            _ => {}
        }
    }
    let mut refs = false;
    if let Some(o) = params.as_object_mut() {
        for k in ["$defs", "definitions"] {
            if let Some(Value::Object(named)) = o.remove(k) {
                for (name, mut schema) in named {
                    rewrite(&mut schema, i, &mut refs);
                    defs.insert(format!("t{i}_{name}"), schema);
                }
            }
        }
    }
    rewrite(&mut params, i, &mut refs);
    if !refs {
        return params;
    }
    defs.insert(format!("t{i}"), params);
    json!({"$ref": format!("#/$defs/t{i}")})
}

/// `tools` as a request gives them: a list of `{"type": "function", "function": {"name",
/// "description"?, "parameters"?}}`, each name distinct and of letters, digits, `_` and `-`
/// (OpenAI's rule, 64 at most), `parameters` a JSON schema object.
pub fn check_tools(tools: &Value) -> Result<Vec<Value>, String> {
    let list = tools.as_array().ok_or("`tools` must be a list")?;
    let mut names: Vec<&str> = Vec::new();
    for t in list {
        let f = match (t.get("type").and_then(Value::as_str), t.get("function")) {
            (Some("function"), Some(f)) if f.is_object() => f,
            _ => return Err("each tool is {\"type\": \"function\", \"function\": {...}}".into()),
        };
        let name = f.get("name").and_then(Value::as_str).unwrap_or_default();
        let ok = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == '-';
        if name.is_empty() || name.len() > 64 || !name.chars().all(ok) {
            return Err(format!(
                "tool name {name:?}: 1 to 64 letters, digits, `_` or `-`"
            ));
        }
        if names.contains(&name) {
            return Err(format!("two tools named {name:?}"));
        }
        names.push(name);
        if f.get("parameters").is_some_and(|p| !p.is_object()) {
            return Err(format!(
                "tool {name:?}: `parameters` must be a JSON schema object"
            ));
        }
    }
    Ok(list.clone())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_are_read_off_templates() {
        let f = |t: &str| ToolFormat::of_template(t);
        assert_eq!(
            f("{% for m in messages %}{{ m.content }}{% endfor %}"),
            Ok(None)
        );
        assert_eq!(
            f("{% if tools %}<tool_call>{% endif %}"),
            Ok(Some(ToolFormat::Hermes))
        );
        assert_eq!(
            f("{% if tools %}[TOOL_CALLS]{% endif %}"),
            Ok(Some(ToolFormat::Mistral))
        );
        assert_eq!(
            f("{%- if tools %}<|python_tag|>"),
            Ok(Some(ToolFormat::Llama3))
        );
        assert!(f("{% if tools %}<function>{% endif %}").is_err());
    }

    #[test]
    fn hermes_calls_parse_with_the_content_before_them() {
        let h = ToolFormat::Hermes;
        let text = "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": \
                    {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"now\", \
                    \"arguments\": {}}\n</tool_call>";
        let (before, calls) = h.parse(text, &[]).unwrap();
        assert_eq!(before.as_deref(), Some("Let me check."));
        assert_eq!(calls.len(), 2);
        assert_eq!(calls[0].name, "get_weather");
        let args: Value = serde_json::from_str(&calls[0].arguments).unwrap();
        assert_eq!(args, json!({"city": "Paris"}));
        assert_eq!(
            (calls[1].name.as_str(), calls[1].arguments.as_str()),
            ("now", "{}")
        );
        // No call, a call that is not JSON, a call without a name, text after the calls.
        for bad in [
            "just text",
            "<tool_call>\n{not json}\n</tool_call>",
            "<tool_call>{\"arguments\": {}}</tool_call>",
            "<tool_call>{\"name\": \"a\", \"arguments\": {}}</tool_call> and more",
        ] {
            assert_eq!(h.parse(bad, &[]), None, "{bad}");
        }
        // Bare calls, one a line, to offered functions only.
        let bare =
            "{\"name\": \"f\", \"arguments\": {\"a\": 1}}\n{\"name\": \"g\", \"arguments\": {}}";
        assert_eq!(h.parse(bare, &["f", "g"]).unwrap().1.len(), 2);
        assert_eq!(h.parse(bare, &["f"]), None);
        assert_eq!(h.parse("{\"a\": 1}", &["f"]), None);
        // An unclosed last call (the reply ran out at its end) still parses.
        let open = "<tool_call>\n{\"name\": \"a\", \"arguments\": {\"x\": 1}}";
        assert_eq!(h.parse(open, &[]).unwrap().1[0].arguments, "{\"x\":1}");
    }

    #[test]
    fn mistral_and_llama3_calls_parse() {
        let m = "[TOOL_CALLS][{\"name\": \"f\", \"arguments\": {\"a\": 1}}, {\"name\": \"g\", \
                 \"arguments\": \"{\\\"b\\\": 2}\"}]";
        let (before, calls) = ToolFormat::Mistral.parse(m, &[]).unwrap();
        assert_eq!(before, None);
        assert_eq!(calls[1].arguments, "{\"b\": 2}");
        let l = "<|python_tag|>{\"name\": \"f\", \"parameters\": {\"a\": 1}}";
        assert_eq!(ToolFormat::Llama3.parse(l, &[]).unwrap().1[0].name, "f");
        assert_eq!(ToolFormat::Llama3.parse("The answer is 4.", &[]), None);
    }

    #[test]
    fn content_is_shown_up_to_a_call_or_the_start_of_one() {
        let h = ToolFormat::Hermes;
        assert_eq!(h.shown("Hello"), 5);
        assert_eq!(h.shown("Hello <tool"), 6);
        assert_eq!(h.shown("Hello <tool_call>\n{"), 6);
        assert_eq!(h.shown("a < b"), 5);
        assert_eq!((h.shown(" {\"name"), h.shown("Sure {")), (0, 6));
        let l = ToolFormat::Llama3;
        assert_eq!(
            (l.shown(""), l.shown(" {\"na"), l.shown("<|pyt")),
            (0, 0, 0)
        );
        assert_eq!(l.shown("Paris is"), 8);
    }

    #[test]
    fn tools_are_checked_and_a_required_call_is_a_grammar() {
        let tools = json!([{"type": "function", "function": {"name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
            "required": ["city"]}}}]);
        let list = check_tools(&tools).unwrap();
        let g = ToolFormat::Hermes.required(&list, None, &|_| None).unwrap();
        assert!(g.starts_with("start: \"<tool_call>\" \"\\n\" call"), "{g}");
        assert!(g.contains("\"const\":\"get_weather\""), "{g}");
        let ids = |t: &str| (t == "<tool_call>").then_some(7);
        let g = ToolFormat::Hermes
            .required(&list, Some("get_weather"), &ids)
            .unwrap();
        assert!(
            g.starts_with("start: <[7]> \"\\n\" call \"\\n\" \"</tool_call>\""),
            "{g}"
        );
        assert!(ToolFormat::Hermes
            .required(&list, Some("other"), &|_| None)
            .is_err());
        for bad in [
            json!({"type": "function"}),
            json!([{"type": "function", "function": {"name": "a b"}}]),
            json!([{"type": "function", "function": {"name": "a", "parameters": 3}}]),
            json!([{"type": "function", "function": {"name": "a"}},
                   {"type": "function", "function": {"name": "a"}}]),
        ] {
            assert!(check_tools(&bad).is_err(), "{bad}");
        }
    }

    /// Issue 52: a tool whose parameters use `$defs` and `$ref` (pydantic's output) compiles
    /// as a required call, its references resolved, and greedy decoding under it on a byte
    /// vocabulary gives a call whose arguments hold the referenced object.
    #[test]
    fn a_required_call_resolves_the_tools_own_defs() {
        use crate::text::constrain::{Constraint, Grammars};
        let tools = json!([{"type": "function", "function": {"name": "ship",
            "parameters": {"type": "object", "$defs": {"Address": {"type": "object",
                "properties": {"zip": {"type": "integer", "minimum": 0, "maximum": 9}},
                "required": ["zip"], "additionalProperties": false}},
                "properties": {"to": {"$ref": "#/$defs/Address"}},
                "required": ["to"], "additionalProperties": false}}},
            {"type": "function", "function": {"name": "tree", "parameters": {"type": "object",
                "properties": {"kids": {"type": "array", "maxItems": 0, "items": {"$ref": "#"}}},
                "required": ["kids"], "additionalProperties": false}}}]);
        let list = check_tools(&tools).unwrap();
        let g = ToolFormat::Llama3
            .required(&list, Some("ship"), &|_| None)
            .unwrap();
        assert!(g.contains("#/$defs/t0_Address"), "{g}");
        let tok = crate::model::tokenizer::Tokenizer::byte_level().unwrap();
        let n = tok.vocab_size();
        let grammars = Grammars::new(&tok, n).unwrap();
        let mut guide = grammars.matcher(&Constraint::Lark(g)).unwrap();
        let mut out = Vec::new();
        for _ in 0..200 {
            let mut logits: Vec<f32> = (0..n).map(|t| -(t as f32)).collect();
            guide.mask(&mut logits).unwrap();
            let next = crate::text::sampling::argmax(&logits);
            out.push(next);
            if guide.advance(next).unwrap() {
                break;
            }
        }
        let text = tok.decode(&out).unwrap();
        let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text}: {e}"));
        assert_eq!(v["name"], "ship", "{text}");
        assert!(v["parameters"]["to"]["zip"].is_u64(), "{text}");
        // A schema that refers to its own root compiles too.
        let g = ToolFormat::Llama3
            .required(&list, Some("tree"), &|_| None)
            .unwrap();
        assert!(grammars.matcher(&Constraint::Lark(g)).is_ok());
    }
}
