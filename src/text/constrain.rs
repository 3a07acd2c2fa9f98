//! Grammar-constrained sampling (structured output) through llguidance, the parser llama.cpp
//! uses: a JSON schema (OpenAI's `response_format`) or a Lark grammar (llguidance's syntax) is
//! compiled against the model's vocabulary, and at each step the tokens the grammar cannot
//! take next get `-inf` logits before the sampler sees them. End-of-generation tokens are
//! allowed only where the grammar may end.
use crate::model::tokenizer::Tokenizer;
use crate::{Error, Result};
use llguidance::api::TopLevelGrammar;
use llguidance::{Matcher, ParserFactory};

/// What a reply must match.
#[derive(Debug, Clone, PartialEq)]
pub enum Constraint {
    /// A JSON value valid under this JSON schema (`{"type": "object"}` for any object).
    JsonSchema(serde_json::Value),
    /// A Lark grammar in llguidance's syntax.
    Lark(String),
}

/// Compiles constraints for one model's vocabulary (its token trie, built once: a fraction of
/// a second for 150k tokens).
pub struct Grammars {
    factory: ParserFactory,
}

impl Grammars {
    /// For `tok`, with `n_vocab` logits a step (past the tokenizer's vocabulary: never allowed).
    pub fn new(tok: &Tokenizer, n_vocab: usize) -> Result<Self> {
        let bad = |e: anyhow::Error| Error::Tokenizer(format!("structured output: {e}"));
        let json = tok.to_hf_json()?;
        let mut bt =
            toktrie_hf_tokenizers::ByteTokenizer::from_json_bytes(json.as_bytes()).map_err(bad)?;
        if !tok.end_of_generation.is_empty() {
            bt.set_eos_tokens(&tok.end_of_generation);
        }
        let env = bt.into_tok_env(Some(n_vocab)).map_err(bad)?;
        let mut factory = ParserFactory::new_simple(&env).map_err(bad)?;
        factory.quiet();
        Ok(Self { factory })
    }

    /// A matcher at the start of `c`, or a short reason it cannot be one (the caller's error:
    /// a 400). `c` is first held to [`bounds`]; then it compiles on a thread of its own with
    /// [`COMPILE_STACK`] of stack, and its first mask is computed there too, so a grammar that
    /// no text satisfies is refused here rather than at its first step.
    pub fn matcher(&self, c: &Constraint) -> std::result::Result<Guide, String> {
        bounds(c)?;
        let compile = || {
            let grammar = match c {
                Constraint::JsonSchema(s) => TopLevelGrammar::from_json_schema(layout(s)),
                Constraint::Lark(g) => TopLevelGrammar::from_lark(g.clone()),
            };
            let parser =
                (self.factory.create_parser(grammar)).map_err(|e| short(&e.to_string()))?;
            let mut m = Matcher::new(Ok(parser));
            if let Some(e) = m.get_error() {
                return Err(short(&e));
            }
            // The first step's mask: a grammar no text satisfies fails here.
            let first = m.compute_mask();
            first
                .map_err(|e| format!("no reply can start under it ({})", short(&e.to_string())))?;
            match m.get_error() {
                Some(e) => Err(short(&e)),
                None => Ok(Guide(m)),
            }
        };
        std::thread::scope(|s| {
            let t = std::thread::Builder::new()
                .name("grammar".into())
                .stack_size(COMPILE_STACK)
                .spawn_scoped(s, compile)
                .map_err(|e| format!("no thread to compile it on: {e}"))?;
            (t.join()).unwrap_or_else(|_| Err("the grammar compiler failed on it".into()))
        })
    }
}

/// Most bytes of a grammar's text or of a schema's JSON.
pub const MAX_GRAMMAR_BYTES: usize = 128 << 10;
/// Most rules and terminals a Lark grammar defines, and most objects (subschemas and their
/// keyword maps) a JSON schema holds. The compiler recurses once per link of a chain of rules
/// or `$ref`s (about 4 KiB of stack a Lark rule and 10 KiB a schema's link, measured), so a
/// grammar within these bounds compiles within [`COMPILE_STACK`] with room to spare.
pub const MAX_RULES: usize = 4096;
/// The stack of the thread a constraint compiles on (address space, mapped as it is used).
pub const COMPILE_STACK: usize = 256 << 20;

/// `c` within [`MAX_GRAMMAR_BYTES`] and [`MAX_RULES`], or which bound it passes.
pub fn bounds(c: &Constraint) -> std::result::Result<(), String> {
    let (bytes, rules, what) = match c {
        Constraint::Lark(g) => (g.len(), lark_rules(g), "rules"),
        Constraint::JsonSchema(s) => (s.to_string().len(), schema_objects(s), "objects"),
    };
    if bytes > MAX_GRAMMAR_BYTES {
        return Err(format!(
            "it is {bytes} bytes; at most {MAX_GRAMMAR_BYTES} are taken"
        ));
    }
    if rules > MAX_RULES {
        return Err(format!(
            "it has {rules} {what}; at most {MAX_RULES} are taken (the compiler follows each \
             chain of them on its stack)"
        ));
    }
    Ok(())
}

/// The rules and terminals a Lark grammar defines: lines that open with a name (after `?` or
/// `!`, with a `.priority`) and a `:`.
fn lark_rules(g: &str) -> usize {
    let defines = |l: &str| {
        let l = l.trim_start().trim_start_matches(['?', '!']);
        let name = l.find(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == '.'));
        name.is_some_and(|n| n > 0 && l[n..].trim_start().starts_with(':'))
    };
    g.lines().filter(|l| defines(l)).count()
}

/// The JSON objects in `v`, counted without recursion.
fn schema_objects(v: &serde_json::Value) -> usize {
    let (mut n, mut todo) = (0, vec![v]);
    while let Some(v) = todo.pop() {
        match v {
            serde_json::Value::Object(o) => {
                n += 1;
                todo.extend(o.values());
            }
            serde_json::Value::Array(a) => todo.extend(a),
            _ => {}
        }
    }
    n
}

/// The first line of a parser's message, at most 200 characters: the reason, without the
/// parser's state that may follow it.
fn short(e: &str) -> String {
    let line = e
        .lines()
        .map(str::trim)
        .find(|l| !l.is_empty())
        .unwrap_or("rejected");
    match line.char_indices().nth(200) {
        Some((i, _)) => format!("{}...", &line[..i]),
        None => line.to_string(),
    }
}

/// `schema` with llguidance's JSON layout set, unless it sets its own (`x-guidance`): one line,
/// `, ` between items and `: ` after keys (Python's `json.dumps`), no other whitespace. The
/// default (any whitespace between tokens) lets a model fill its reply with newlines.
fn layout(schema: &serde_json::Value) -> serde_json::Value {
    let mut s = schema.clone();
    if let Some(o) = s.as_object_mut() {
        o.entry("x-guidance").or_insert_with(|| {
            serde_json::json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "})
        });
    }
    s
}

/// One reply's place in its grammar.
pub struct Guide(Matcher);

impl Guide {
    /// Set to `-inf` the logits of every token the grammar cannot take next; an error is the
    /// grammar's (a limit of the parser it reached: the request's fault), in short.
    pub fn mask(&mut self, logits: &mut [f32]) -> std::result::Result<(), String> {
        let mask = (self.0.compute_mask()).map_err(|e| short(&e.to_string()))?;
        for (i, l) in logits.iter_mut().enumerate() {
            if !mask.is_allowed(i as u32) {
                *l = f32::NEG_INFINITY;
            }
        }
        Ok(())
    }

    /// Advance past `token`; `true` once the grammar is complete (the reply ends there). An
    /// error is the grammar's, as for [`Self::mask`].
    pub fn advance(&mut self, token: u32) -> std::result::Result<bool, String> {
        (self.0.consume_token(token)).map_err(|e| short(&e.to_string()))?;
        Ok(self.0.is_stopped())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// On a byte-level vocabulary, greedy decoding of arbitrary logits under a schema gives a
    /// document the schema accepts; a bad schema is an error, not a panic.
    #[test]
    fn masked_decoding_follows_the_schema() {
        let tok = Tokenizer::byte_level().unwrap();
        let n = tok.vocab_size();
        let g = Grammars::new(&tok, n).unwrap();
        let schema = serde_json::json!({"type": "object", "properties": {
            "ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
            "required": ["ok", "n"], "additionalProperties": false});
        let mut guide = g.matcher(&Constraint::JsonSchema(schema)).unwrap();
        let mut out = Vec::new();
        for step in 0..64u32 {
            // Logits that prefer a different byte each step.
            let mut logits: Vec<f32> = (0..n as u32)
                .map(|t| ((t * 7 + step * 13) % 31) as f32)
                .collect();
            guide.mask(&mut logits).unwrap();
            let next = crate::text::sampling::argmax(&logits);
            assert!(
                logits[next as usize].is_finite(),
                "nothing allowed at step {step}"
            );
            out.push(next);
            if guide.advance(next).unwrap() {
                break;
            }
        }
        let text = tok.decode(&out).unwrap();
        let v: serde_json::Value =
            serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text}: {e}"));
        assert!(
            v["ok"].is_boolean() && v["n"].as_u64().is_some_and(|n| n <= 9),
            "{text}"
        );
        let lark = g.matcher(&Constraint::Lark("start: \"yes\" | \"no\"".into()));
        assert!(lark.is_ok());
        assert!(g.matcher(&Constraint::Lark("start: ???".into())).is_err());
        assert!(g
            .matcher(&Constraint::JsonSchema(serde_json::json!({"type": 7})))
            .is_err());
    }
}
