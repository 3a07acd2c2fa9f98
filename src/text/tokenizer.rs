//! The model's own tokenizer, built from the GGUF vocabulary with the `tokenizers` crate, and its
//! chat template rendered with `minijinja`.
//!
//! GGUF stores a byte-level BPE (`tokenizer.ggml.model = gpt2`) as the token strings (already in
//! GPT-2's byte-to-unicode alphabet), their types, and the merges; `tokenizer.ggml.pre` names the
//! pre-tokenizer, which we map to the same pipeline the model's original `tokenizer.json` used.
use crate::engine::names::*;
use crate::{Error, Result};
use dejavu_formats::gguf::GgufHeader;
use tokenizers::models::bpe::BPE;
use tokenizers::normalizers::unicode::NFC;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{AddedToken, PreTokenizerWrapper, SplitDelimiterBehavior};

/// Qwen2's split pattern (from its tokenizer.json), case-insensitive contractions spelled out.
const QWEN2_PATTERN: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// GGUF token types (llama.cpp's `llama_token_type`).
const TOKEN_CONTROL: i64 = 3;
const TOKEN_USER_DEFINED: i64 = 4;

/// Tokens that end a turn in the chat formats we know, beyond the file's declared EOS/EOT.
const END_OF_TURN: [&str; 4] = ["<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<end_of_turn>"];

pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// Token ids that end generation.
    pub end_of_generation: Vec<u32>,
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    tokens: Vec<String>,
    chat_template: Option<String>,
}

impl Tokenizer {
    pub fn from_gguf(h: &GgufHeader) -> Result<Self> {
        let model = meta_str(h, TOK_MODEL)?;
        if model != "gpt2" {
            return Err(Error::Tokenizer(format!(
                "tokenizer model `{model}` is not supported (only byte-level BPE, `gpt2`)"
            )));
        }
        let pre = h.get(TOK_PRE).and_then(|v| v.as_str()).unwrap_or("default");
        let tokens: Vec<String> = string_array(h, TOK_TOKENS)?;
        let types: Vec<i64> = match h.get(TOK_TYPES).and_then(|v| v.as_array()) {
            Some(a) => a.iter().map(|v| v.as_i64().unwrap_or(1)).collect(),
            None => vec![1; tokens.len()],
        };
        if types.len() != tokens.len() {
            return Err(Error::Tokenizer(format!(
                "{} token types for {} tokens",
                types.len(),
                tokens.len()
            )));
        }
        let merges: Vec<(String, String)> = string_array(h, TOK_MERGES)?
            .into_iter()
            .map(|m| {
                m.split_once(' ')
                    .map(|(a, b)| (a.to_string(), b.to_string()))
                    .ok_or_else(|| Error::Tokenizer(format!("malformed merge `{m}`")))
            })
            .collect::<Result<_>>()?;
        let vocab: tokenizers::models::bpe::Vocab = tokens
            .iter()
            .enumerate()
            .map(|(i, t)| (t.clone(), i as u32))
            .collect();
        let bpe = BPE::builder()
            .vocab_and_merges(vocab, merges)
            .build()
            .map_err(|e| Error::Tokenizer(format!("building BPE: {e}")))?;
        let mut inner = tokenizers::Tokenizer::new(bpe);
        let byte_level = |use_regex| ByteLevel::new(false, true, use_regex);
        let pre_tok: PreTokenizerWrapper = match pre {
            "smollm" => {
                Sequence::new(vec![Digits::new(true).into(), byte_level(true).into()]).into()
            }
            "qwen2" => {
                inner.with_normalizer(Some(NFC));
                let split = Split::new(
                    SplitPattern::Regex(QWEN2_PATTERN.into()),
                    SplitDelimiterBehavior::Isolated,
                    false,
                )
                .map_err(|e| Error::Tokenizer(format!("qwen2 pattern: {e}")))?;
                Sequence::new(vec![split.into(), byte_level(false).into()]).into()
            }
            "default" | "gpt2" | "gpt-2" => byte_level(true).into(),
            other => {
                return Err(Error::Tokenizer(format!(
                    "pre-tokenizer `{other}` is not supported (smollm, qwen2, gpt2)"
                )))
            }
        };
        inner.with_pre_tokenizer(Some(pre_tok));
        inner.with_decoder(Some(ByteLevel::default()));
        let special: Vec<AddedToken> = tokens
            .iter()
            .zip(&types)
            .filter(|(_, &t)| t == TOKEN_CONTROL || t == TOKEN_USER_DEFINED)
            .map(|(s, &t)| AddedToken::from(s.clone(), t == TOKEN_CONTROL))
            .collect();
        inner.add_special_tokens(&special);

        let id = |key: &str| {
            h.get(key)
                .and_then(|v| v.as_u64())
                .filter(|&i| (i as usize) < tokens.len())
                .map(|i| i as u32)
        };
        let (bos, eos) = (id(TOK_BOS), id(TOK_EOS));
        let mut end_of_generation: Vec<u32> = [eos, id(TOK_EOT)].into_iter().flatten().collect();
        for t in END_OF_TURN {
            if let Some(&i) = inner.get_vocab(true).get(t) {
                end_of_generation.push(i);
            }
        }
        end_of_generation.sort_unstable();
        end_of_generation.dedup();
        let chat_template = h
            .get(CHAT_TEMPLATE)
            .and_then(|v| v.as_str())
            .map(String::from);
        Ok(Self {
            inner,
            end_of_generation,
            bos,
            eos,
            tokens,
            chat_template,
        })
    }

    /// Token ids of `text`; special tokens written in the text (`<|im_start|>`) are recognised; no
    /// BOS is added (neither model of this project wants one).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode(text, false)
            .map_err(|e| Error::Tokenizer(e.to_string()))?;
        Ok(enc.get_ids().to_vec())
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

    pub fn token_text(&self, id: u32) -> Option<&str> {
        self.tokens.get(id as usize).map(String::as_str)
    }

    pub fn has_chat_template(&self) -> bool {
        self.chat_template.is_some()
    }

    /// Render the model's chat template for `messages` (role, content), ending with the assistant's
    /// turn opened (`add_generation_prompt`).
    pub fn apply_chat_template(&self, messages: &[(String, String)]) -> Result<String> {
        let tpl = self
            .chat_template
            .as_deref()
            .ok_or_else(|| Error::Template("the model has no chat template".into()))?;
        let mut env = minijinja::Environment::new();
        minijinja_contrib::add_to_environment(&mut env);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |msg: String| -> std::result::Result<String, minijinja::Error> {
                Err(minijinja::Error::new(
                    minijinja::ErrorKind::InvalidOperation,
                    msg,
                ))
            },
        );
        env.add_template("chat", tpl)
            .map_err(|e| Error::Template(e.to_string()))?;
        let msgs: Vec<_> = messages
            .iter()
            .map(|(r, c)| minijinja::context! { role => r, content => c })
            .collect();
        let tok = |i: Option<u32>| i.and_then(|i| self.token_text(i)).unwrap_or("").to_string();
        let ctx = minijinja::context! {
            messages => msgs,
            add_generation_prompt => true,
            bos_token => tok(self.bos),
            eos_token => tok(self.eos),
        };
        env.get_template("chat")
            .and_then(|t| t.render(ctx))
            .map_err(|e| Error::Template(e.to_string()))
    }
}

fn meta_str<'a>(h: &'a GgufHeader, key: &str) -> Result<&'a str> {
    h.get(key)
        .ok_or_else(|| Error::MissingKey(key.into()))?
        .as_str()
        .ok_or_else(|| Error::BadKey {
            key: key.into(),
            reason: "not a string".into(),
        })
}

fn string_array(h: &GgufHeader, key: &str) -> Result<Vec<String>> {
    let a = h.get(key).ok_or_else(|| Error::MissingKey(key.into()))?;
    let bad = || Error::BadKey {
        key: key.into(),
        reason: "expected an array of strings".into(),
    };
    a.as_array()
        .ok_or_else(bad)?
        .iter()
        .map(|v| v.as_str().map(String::from).ok_or_else(bad))
        .collect()
}
