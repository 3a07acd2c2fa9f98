//! The model's own tokenizer, built with the `tokenizers` crate, and its chat template rendered
//! with `minijinja`. Sources:
//! - a Hugging Face directory's `tokenizer.json` (post-processor included, so a BOS it adds is
//!   added), or GPT-2 `vocab.json` + `merges.txt` (byte-level BPE, as facebook/opt-* ship, BOS
//!   per `add_bos_token`); `tokenizer_config.json`, `generation_config.json` and `config.json`
//!   give BOS/EOS and the chat template;
//! - a GGUF vocabulary as llama.cpp writes it (`gguf.rs`).
mod gguf;
use crate::model::weights::{Model, Source};
use crate::{Error, Result};
use dejavu_formats::hf::HfCheckpoint;
use serde_json::Value;
use tokenizers::models::bpe::BPE;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::processors::template::TemplateProcessing;
use tokenizers::AddedToken;

/// Tokens that end a turn in the chat formats we know, beyond the file's declared EOS/EOT.
const END_OF_TURN: [&str; 4] = ["<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<end_of_turn>"];

pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// Token ids that end generation.
    pub end_of_generation: Vec<u32>,
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    /// The BOS that [`Self::encode_prompt`] puts first (the model was trained with it).
    add_bos: Option<u32>,
    tokens: Vec<String>,
    chat_template: Option<String>,
    /// A copy of `inner` that reads control tokens' text as plain text (message content).
    plain: std::sync::OnceLock<tokenizers::Tokenizer>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab", &self.tokens.len())
            .field("bos", &self.bos)
            .field("eos", &self.eos)
            .finish_non_exhaustive()
    }
}

impl Tokenizer {
    /// The tokenizer of a loaded model (GGUF metadata or the checkpoint directory's files).
    pub fn from_model(model: &Model) -> Result<Self> {
        match &model.source {
            Source::Gguf(f) => Self::from_gguf(&f.header),
            Source::Hf(c) => Self::from_hf(c),
            Source::Synthetic(_) => Self::byte_level(),
        }
    }

    /// A byte-level tokenizer of 256 tokens (ids 0..256, no merges and no special tokens), for
    /// synthetic models, whose vocabulary means nothing.
    pub fn byte_level() -> Result<Self> {
        let mut chars: Vec<char> = ByteLevel::alphabet().into_iter().collect();
        chars.sort_unstable();
        let tokens: Vec<String> = chars.iter().map(|c| c.to_string()).collect();
        let vocab: tokenizers::models::bpe::Vocab = (tokens.iter().enumerate())
            .map(|(i, t)| (t.clone(), i as u32))
            .collect();
        let bpe = BPE::builder()
            .vocab_and_merges(vocab, Vec::new())
            .build()
            .map_err(|e| Error::Tokenizer(format!("building BPE: {e}")))?;
        let mut inner = tokenizers::Tokenizer::new(bpe);
        inner.with_pre_tokenizer(Some(ByteLevel::new(false, true, false)));
        inner.with_decoder(Some(ByteLevel::default()));
        Ok(Self::assemble(inner, tokens, None, None, Vec::new(), None))
    }

    /// A Hugging Face checkpoint's tokenizer (see the module docs).
    pub fn from_hf(ckpt: &HfCheckpoint) -> Result<Self> {
        let dir = ckpt.dir.as_path();
        // An optional JSON file of the directory (`Null` when absent).
        let json = |name: &str| -> Result<Value> {
            match ckpt.optional_text(name)? {
                Some(t) => {
                    serde_json::from_str(&t).map_err(|e| Error::Tokenizer(format!("{name}: {e}")))
                }
                None => Ok(Value::Null),
            }
        };
        let tcfg = json("tokenizer_config.json")?;
        let gen = json("generation_config.json")?;
        let model_cfg: Value = serde_json::from_str(&ckpt.config).unwrap_or(Value::Null);
        let tok_err = |e: Box<dyn std::error::Error + Send + Sync>| Error::Tokenizer(e.to_string());
        let token_str = |key: &str| -> Option<String> {
            match tcfg.get(key)? {
                Value::String(s) => Some(s.clone()),
                v => v.get("content")?.as_str().map(String::from),
            }
        };
        let has_tokenizer_json = dir.join("tokenizer.json").is_file();
        let mut inner = if has_tokenizer_json {
            let path = dir.join("tokenizer.json");
            let text = std::fs::read_to_string(&path)
                .map_err(|e| Error::Tokenizer(format!("{}: {e}", path.display())))?;
            parse_hf_json(&text, "tokenizer.json")?
        } else if dir.join("vocab.json").is_file() && dir.join("merges.txt").is_file() {
            let (v, m) = (dir.join("vocab.json"), dir.join("merges.txt"));
            let bpe = BPE::from_file(&v.to_string_lossy(), &m.to_string_lossy())
                .build()
                .map_err(tok_err)?;
            let mut t = tokenizers::Tokenizer::new(bpe);
            t.with_pre_tokenizer(Some(ByteLevel::new(false, true, true)));
            t.with_decoder(Some(ByteLevel::default()));
            let special: Vec<AddedToken> = ["bos_token", "eos_token", "unk_token", "pad_token"]
                .iter()
                .filter_map(|k| token_str(k))
                .map(|s| AddedToken::from(s, true))
                .collect();
            t.add_special_tokens(&special);
            t
        } else {
            return Err(Error::Tokenizer(format!(
                "{} has neither tokenizer.json nor vocab.json + merges.txt",
                dir.display()
            )));
        };
        let id_of = |s: Option<String>| s.and_then(|s| inner.token_to_id(&s));
        // An id past u32 (2^40, say) saturates, so the range check below refuses it rather than
        // a truncation finding some token.
        let id32 = |i: u64| u32::try_from(i).unwrap_or(u32::MAX);
        let int = |v: &Value, k: &str| v.get(k).and_then(Value::as_u64).map(id32);
        let bos = id_of(token_str("bos_token"))
            .or_else(|| int(&gen, "bos_token_id"))
            .or_else(|| int(&model_cfg, "bos_token_id"));
        let eos = id_of(token_str("eos_token"))
            .or_else(|| int(&gen, "eos_token_id"))
            .or_else(|| int(&model_cfg, "eos_token_id"));
        // GPT-2 files have no post-processor: `add_bos_token` asks for the BOS.
        let wants_bos = tcfg.get("add_bos_token").and_then(Value::as_bool) == Some(true);
        if !has_tokenizer_json && wants_bos {
            prepend_bos(&mut inner, bos)?;
        }
        let mut eog: Vec<u32> = [eos].into_iter().flatten().collect();
        for cfg in [&gen, &model_cfg] {
            match cfg.get("eos_token_id") {
                Some(Value::Array(a)) => eog.extend(a.iter().filter_map(|v| v.as_u64().map(id32))),
                Some(v) => eog.extend(v.as_u64().map(id32)),
                None => {}
            }
        }
        let chat_template = match tcfg.get("chat_template") {
            Some(Value::String(t)) => Some(t.clone()),
            Some(Value::Array(named)) => named
                .iter()
                .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
                .or(named.first())
                .and_then(|t| t.get("template")?.as_str().map(String::from)),
            _ => ckpt.optional_text("chat_template.jinja")?,
        };
        let n = inner.get_vocab_size(true);
        let named = [("bos_token_id", bos), ("eos_token_id", eos)];
        let outside = (named.into_iter())
            .filter_map(|(k, id)| Some((k, id?)))
            .chain(eog.iter().map(|&i| ("eos_token_id", i)))
            .find(|&(_, id)| id as usize >= n);
        if let Some((key, id)) = outside {
            return Err(Error::Tokenizer(format!(
                "{key} {id} lies outside the tokenizer's {n} tokens"
            )));
        }
        let tokens = (0..n as u32)
            .map(|i| inner.id_to_token(i).unwrap_or_default())
            .collect();
        Ok(Self::assemble(inner, tokens, bos, eos, eog, chat_template))
    }

    /// The common tail of every source: end-of-generation ids (declared ones plus the end-of-turn
    /// tokens of the chat formats we know) and the BOS the post-processor adds.
    pub(super) fn assemble(
        inner: tokenizers::Tokenizer,
        tokens: Vec<String>,
        bos: Option<u32>,
        eos: Option<u32>,
        mut end_of_generation: Vec<u32>,
        chat_template: Option<String>,
    ) -> Self {
        for t in END_OF_TURN {
            if let Some(i) = inner.token_to_id(t) {
                end_of_generation.push(i);
            }
        }
        end_of_generation.retain(|&i| (i as usize) < tokens.len());
        end_of_generation.sort_unstable();
        end_of_generation.dedup();
        let add_bos = match (bos, inner.encode("", true)) {
            (Some(b), Ok(e)) if e.get_ids().first() == Some(&b) => Some(b),
            _ => None,
        };
        Self {
            inner,
            end_of_generation,
            bos,
            eos,
            add_bos,
            tokens,
            chat_template,
            plain: std::sync::OnceLock::new(),
        }
    }

    /// Token ids of `text`, nothing added; special tokens written in the text (`<|im_start|>`)
    /// are recognised. For rendered chat templates (which place their own BOS) and raw text.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode(text, false)
            .map_err(|e| Error::Tokenizer(e.to_string()))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Token ids of `text` as plain text: a control token's text (`<|im_end|>`) is read as its
    /// characters, never as the token (message content of a chat).
    pub fn encode_plain(&self, text: &str) -> Result<Vec<u32>> {
        let plain = self.plain.get_or_init(|| {
            let mut t = self.inner.clone();
            t.set_encode_special_tokens(true);
            t
        });
        let enc = plain
            .encode(text, false)
            .map_err(|e| Error::Tokenizer(e.to_string()))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Token ids of a prompt as the model expects it: with the special tokens its post-processor
    /// adds (the BOS of models trained with one), as Hugging Face's `tokenizer(text)`.
    pub fn encode_prompt(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode(text, true)
            .map_err(|e| Error::Tokenizer(e.to_string()))?;
        Ok(enc.get_ids().to_vec())
    }

    /// A document for perplexity or calibration: the BOS (if the model takes one), then `text`
    /// with nothing added (llama.cpp's tokenization for llama-perplexity).
    pub fn encode_document(&self, text: &str) -> Result<Vec<u32>> {
        let mut ids: Vec<u32> = self.add_bos.into_iter().collect();
        ids.extend(self.encode(text)?);
        Ok(ids)
    }

    /// The BOS that prompts start with, if the model takes one.
    pub fn bos_prefix(&self) -> Option<u32> {
        self.add_bos
    }

    /// Text of `ids`, special tokens skipped.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.inner
            .decode(ids, true)
            .map_err(|e| Error::Tokenizer(e.to_string()))
    }

    pub fn vocab_size(&self) -> usize {
        self.tokens.len()
    }

    /// The most bytes of text one token stands for, bounded above by the longest token's text
    /// (byte-level and SentencePiece spellings take at least a byte per byte they stand for).
    /// A text of `n` bytes is then at least `n / max_token_bytes()` tokens: a prompt that
    /// cannot fit the context is refused before it is tokenized.
    pub fn max_token_bytes(&self) -> usize {
        self.tokens
            .iter()
            .map(String::len)
            .max()
            .unwrap_or(1)
            .max(1)
    }

    pub fn token_text(&self, id: u32) -> Option<&str> {
        self.tokens.get(id as usize).map(String::as_str)
    }

    /// The whole tokenizer as Hugging Face `tokenizer.json` text (post-processor included).
    pub fn to_hf_json(&self) -> Result<String> {
        self.inner
            .to_string(false)
            .map_err(|e| Error::Tokenizer(format!("serializing: {e}")))
    }

    /// Ids of the special (control) tokens.
    pub fn special_ids(&self) -> Vec<u32> {
        let mut v: Vec<u32> = (self.inner.get_added_tokens_decoder().iter())
            .filter(|(_, t)| t.special)
            .map(|(&i, _)| i)
            .collect();
        v.sort_unstable();
        v
    }

    pub fn chat_template(&self) -> Option<&str> {
        self.chat_template.as_deref()
    }

    pub fn has_chat_template(&self) -> bool {
        self.chat_template.is_some()
    }

    /// Render the model's chat template for `messages` (role, content), ending with the assistant's
    /// turn opened (`add_generation_prompt`).
    pub fn apply_chat_template(&self, messages: &[(String, String)]) -> Result<String> {
        self.apply_chat_template_tools(&ChatMessage::plain(messages), None)
    }

    /// [`Self::apply_chat_template`] of messages with their tool fields, and the tool
    /// definitions (`tools`, OpenAI's list) when given.
    pub fn apply_chat_template_tools(
        &self,
        messages: &[ChatMessage],
        tools: Option<&[serde_json::Value]>,
    ) -> Result<String> {
        let tpl = self
            .chat_template
            .as_deref()
            .ok_or_else(|| Error::Template("the model has no chat template".into()))?;
        let tok = |i: Option<u32>| i.and_then(|i| self.token_text(i)).unwrap_or("");
        render_chat(tpl, messages, tools, tok(self.bos), tok(self.eos))
    }
}

/// A chat message: its role and text, and the fields a template reads beside them on tool
/// turns (`tool_calls` of an assistant's turn, `tool_call_id` and `name` of a tool's result).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
    pub extra: serde_json::Map<String, serde_json::Value>,
}

impl ChatMessage {
    /// `(role, content)` pairs as messages without tool fields.
    pub fn plain(messages: &[(String, String)]) -> Vec<Self> {
        (messages.iter())
            .map(|(role, content)| ChatMessage {
                role: role.clone(),
                content: content.clone(),
                extra: Default::default(),
            })
            .collect()
    }
}

/// Instructions a chat template may run per rendering (minijinja's fuel). Real templates use
/// a few thousand for a long conversation; a template from a model file that loops without end
/// stops with an error here instead of holding its slot.
pub const TEMPLATE_FUEL: u64 = 2_000_000;

/// Render a Jinja chat template (Hugging Face's `chat_template`) for `messages` (role, content)
/// with `add_generation_prompt`, `bos_token` and `eos_token`, as `transformers` does. Any
/// template text is accepted: a bad one is an `Error::Template`, never a panic or a hang.
pub fn render_chat_template(
    tpl: &str,
    messages: &[(String, String)],
    bos: &str,
    eos: &str,
) -> Result<String> {
    render_chat(tpl, &ChatMessage::plain(messages), None, bos, eos)
}

/// [`render_chat_template`] of messages with their tool fields, and `tools` (the template's
/// `tools` variable) when given.
pub fn render_chat(
    tpl: &str,
    messages: &[ChatMessage],
    tools: Option<&[serde_json::Value]>,
    bos: &str,
    eos: &str,
) -> Result<String> {
    // A model file's template is a stranger's program: bounded in size, run on a thread whose
    // stack its nesting cannot exhaust (a chain of 100,000 filters, a list nested as deep),
    // with fuel, widths and output bounded (see `guarded`).
    if tpl.len() > MAX_TEMPLATE_BYTES {
        return Err(Error::Template(format!(
            "the chat template is {} bytes; at most {MAX_TEMPLATE_BYTES} are taken",
            tpl.len()
        )));
    }
    std::thread::scope(|scope| {
        let t = std::thread::Builder::new()
            .name("chat-template".into())
            .stack_size(TEMPLATE_STACK)
            .spawn_scoped(scope, || render_guarded(tpl, messages, tools, bos, eos))
            .map_err(|e| Error::Template(format!("no thread to render it on: {e}")))?;
        (t.join()).unwrap_or_else(|_| Err(Error::Template("the template engine failed".into())))
    })
}

/// Most bytes of a chat template (the largest in use are about 10 KiB).
pub const MAX_TEMPLATE_BYTES: usize = 128 << 10;
/// Most bytes a template renders to.
pub const MAX_RENDERED_BYTES: usize = 16 << 20;
/// The widest `indent` and `format` width a template may ask for.
pub const MAX_TEMPLATE_WIDTH: usize = 4096;
/// The deepest value a template may hand `tojson`.
pub const MAX_TEMPLATE_NESTING: usize = 256;
/// The stack of the thread a template renders on (address space, mapped as it is used):
/// within [`MAX_TEMPLATE_BYTES`] no chain of filters or nesting of values comes near it.
const TEMPLATE_STACK: usize = 256 << 20;

fn template_error(msg: String) -> minijinja::Error {
    minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, msg)
}

/// The widths a printf-style format string asks for (after each `%`: flags, then the width and
/// the precision).
fn format_widths(f: &str) -> impl Iterator<Item = usize> + '_ {
    f.split('%').skip(1).flat_map(|spec| {
        let spec = spec.trim_start_matches(['-', '+', ' ', '#', '0']);
        let num = |s: &str| -> (usize, usize) {
            let n = s.bytes().take_while(u8::is_ascii_digit).count();
            (
                s[..n].parse().unwrap_or(if n > 0 { usize::MAX } else { 0 }),
                n,
            )
        };
        let (width, n) = num(spec);
        let precision = spec[n..].strip_prefix('.').map_or(0, |p| num(p).0);
        [width, precision]
    })
}

/// The depth of `v`'s nesting, counted without recursion, stopping past `limit`.
fn nesting(v: &minijinja::Value, limit: usize) -> usize {
    let mut todo = vec![(v.clone(), 1usize)];
    let mut deepest = 0;
    while let Some((v, d)) = todo.pop() {
        deepest = deepest.max(d);
        if deepest > limit {
            break;
        }
        if matches!(
            v.kind(),
            minijinja::value::ValueKind::Seq | minijinja::value::ValueKind::Map
        ) {
            if let Ok(items) = v.try_iter() {
                for k in items {
                    let item = match v.kind() {
                        minijinja::value::ValueKind::Map => v.get_item(&k).unwrap_or_default(),
                        _ => k,
                    };
                    todo.push((item, d + 1));
                }
            }
        }
    }
    deepest
}

/// A writer that refuses to grow past [`MAX_RENDERED_BYTES`].
struct Bounded(Vec<u8>);

impl std::io::Write for Bounded {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if self.0.len() + buf.len() > MAX_RENDERED_BYTES {
            return Err(std::io::Error::other(format!(
                "the template renders past {MAX_RENDERED_BYTES} bytes"
            )));
        }
        self.0.extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// [`render_chat`]'s work, on its thread.
fn render_guarded(
    tpl: &str,
    messages: &[ChatMessage],
    tools: Option<&[serde_json::Value]>,
    bos: &str,
    eos: &str,
) -> Result<String> {
    let mut env = minijinja::Environment::new();
    minijinja_contrib::add_to_environment(&mut env);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.set_fuel(Some(TEMPLATE_FUEL));
    env.add_function(
        "raise_exception",
        |msg: String| -> std::result::Result<String, minijinja::Error> {
            Err(minijinja::Error::new(
                minijinja::ErrorKind::InvalidOperation,
                msg,
            ))
        },
    );
    // Llama 3.1+ templates put today's date in the system turn.
    env.add_function(
        "strftime_now",
        |fmt: String| -> std::result::Result<String, minijinja::Error> {
            use std::fmt::Write;
            let mut out = String::new();
            // An unknown specifier is an error of `write!`, never a panic.
            write!(out, "{}", chrono::Local::now().format(&fmt)).map_err(|_| {
                minijinja::Error::new(
                    minijinja::ErrorKind::InvalidOperation,
                    format!("strftime_now: bad format {fmt:?}"),
                )
            })?;
            Ok(out)
        },
    );
    // Builtins that could allocate without bound in one step, with their arguments bounded.
    env.add_filter(
        "indent",
        |v: minijinja::value::StringInput<'_>,
         width: Option<usize>,
         first: Option<bool>,
         blank: Option<bool>,
         kwargs: minijinja::value::Kwargs| {
            if width.unwrap_or(0) > MAX_TEMPLATE_WIDTH {
                return Err(template_error(format!(
                    "indent: a width past {MAX_TEMPLATE_WIDTH}"
                )));
            }
            minijinja::filters::indent(v, width, first, blank, kwargs)
        },
    );
    env.add_filter(
        "format",
        |state: &minijinja::State,
         f: &minijinja::Value,
         args: minijinja::value::Rest<minijinja::Value>| {
            let widest = f
                .as_str()
                .map_or(0, |f| format_widths(f).max().unwrap_or(0));
            if widest > MAX_TEMPLATE_WIDTH {
                return Err(template_error(format!(
                    "format: a width past {MAX_TEMPLATE_WIDTH}"
                )));
            }
            minijinja::filters::format(state, f, args)
        },
    );
    env.add_filter(
        "tojson",
        |v: &minijinja::Value,
         indent: Option<minijinja::Value>,
         kwargs: minijinja::value::Kwargs| {
            if nesting(v, MAX_TEMPLATE_NESTING) > MAX_TEMPLATE_NESTING {
                return Err(template_error(format!(
                    "tojson: a value nested past {MAX_TEMPLATE_NESTING} levels"
                )));
            }
            minijinja::filters::tojson(v, indent, kwargs)
        },
    );
    env.add_template("chat", tpl)
        .map_err(|e| Error::Template(e.to_string()))?;
    let msgs: Vec<minijinja::Value> = (messages.iter())
        .map(|m| {
            let mut o = m.extra.clone();
            o.insert("role".into(), m.role.clone().into());
            o.insert("content".into(), m.content.clone().into());
            minijinja::Value::from_serialize(&o)
        })
        .collect();
    let tools = tools.map(minijinja::Value::from_serialize);
    let ctx = minijinja::context! {
        messages => msgs,
        tools => tools,
        add_generation_prompt => true,
        bos_token => bos,
        eos_token => eos,
    };
    let mut out = Bounded(Vec::new());
    env.get_template("chat")
        .and_then(|t| t.render_captured_to(ctx, &mut out).map(drop))
        .map_err(|e| Error::Template(e.to_string()))?;
    String::from_utf8(out.0).map_err(|_| Error::Template("the template rendered bad UTF-8".into()))
}

/// A Hugging Face `tokenizer.json` (from a file or a GGUF's metadata: either may come from a
/// stranger). The text is checked to be JSON first: the `tokenizers` crate panics (an `expect`
/// in its decoder parsing) on a document that is not.
pub(super) fn parse_hf_json(text: &str, what: &str) -> Result<tokenizers::Tokenizer> {
    let bad = |e: String| Error::Tokenizer(format!("{what}: {e}"));
    serde_json::from_str::<serde::de::IgnoredAny>(text).map_err(|e| bad(e.to_string()))?;
    text.parse()
        .map_err(|e: tokenizers::Error| bad(e.to_string()))
}

/// A post-processor that puts `bos` before every sequence.
pub(super) fn prepend_bos(inner: &mut tokenizers::Tokenizer, bos: Option<u32>) -> Result<()> {
    let id = bos
        .ok_or_else(|| Error::Tokenizer("add_bos_token is set but there is no BOS token".into()))?;
    let text = inner
        .id_to_token(id)
        .ok_or_else(|| Error::Tokenizer(format!("BOS id {id} is not in the vocabulary")))?;
    let tp = TemplateProcessing::builder()
        .try_single(format!("{text} $A"))
        .and_then(|b| b.try_pair(format!("{text} $A {text} $B")))
        .map_err(|e| Error::Tokenizer(format!("BOS template: {e}")))?
        .special_tokens(vec![(text.clone(), id)])
        .build()
        .map_err(|e| Error::Tokenizer(format!("BOS template: {e}")))?;
    inner.with_post_processor(Some(tp));
    Ok(())
}
