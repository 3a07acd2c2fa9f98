//! Vocabularies as llama.cpp writes them into a GGUF (`tokenizer.ggml.*`), rebuilt as the
//! `tokenizers` pipeline the model's original `tokenizer.json` ran, so that a GGUF tokenizes as
//! Hugging Face (and llama.cpp) do. Checked against llama.cpp's own tokenizer test vocabularies
//! and their expected ids (`tests/tokenizer.rs`).
//!
//! - `tokenizer.ggml.model = gpt2`: byte-level BPE. The token strings are in GPT-2's
//!   byte-to-unicode alphabet, with their types and the merges; `tokenizer.ggml.pre` names the
//!   pre-tokenizer (the split pattern), and an unknown one is refused by name.
//! - `tokenizer.ggml.model = llama`: SentencePiece BPE (Llama 2, Mistral 7B, Phi-3, Gemma):
//!   tokens with scores, `<0xXX>` byte tokens for byte fallback, spaces written as `▁`, and a
//!   `▁` put before the text (and after each special token, as llama.cpp does) unless
//!   `tokenizer.ggml.add_space_prefix` is false. A merge of two pieces ranks by the score of the
//!   piece it makes (llama.cpp's bigram queue; Hugging Face's SentencePiece extractor).
use super::{parse_hf_json, prepend_bos, Tokenizer};
use crate::model::names::*;
use crate::{Error, Result};
use dejavu_formats::gguf::GgufHeader;
use std::collections::HashMap;
use tokenizers::decoders::byte_fallback::ByteFallback;
use tokenizers::decoders::fuse::Fuse;
use tokenizers::decoders::sequence::Sequence as DecoderSequence;
use tokenizers::decoders::strip::Strip;
use tokenizers::models::bpe::BPE;
use tokenizers::normalizers::replace::Replace;
use tokenizers::normalizers::unicode::NFC;
use tokenizers::normalizers::{Prepend, Sequence as NormSequence};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::SplitDelimiterBehavior;
use tokenizers::{AddedToken, DecoderWrapper, NormalizerWrapper, PreTokenizerWrapper};

/// Qwen2's split pattern (from its tokenizer.json), case-insensitive contractions spelled out.
const QWEN2_PATTERN: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Llama 3's split pattern (Qwen2's with digits in runs of up to three).
const LLAMA3_PATTERN: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Mistral's Tekken split pattern (Mistral Nemo, Pixtral, Ministral), from its tokenizer.json.
const TEKKEN_PATTERN: &str = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// GGUF token types (llama.cpp's `llama_token_type`).
const TOKEN_NORMAL: i64 = 1;
const TOKEN_CONTROL: i64 = 3;
const TOKEN_USER_DEFINED: i64 = 4;

/// The pre-tokenizers of byte-level BPE vocabularies, by llama.cpp's names.
const BPE_PRE: &str = "gpt2, llama-bpe (llama3, llama-v3, falcon3, pixtral), tekken, qwen2, smollm";

/// A GGUF's token list with the types of its tokens.
struct Vocab {
    tokens: Vec<String>,
    types: Vec<i64>,
}

impl Tokenizer {
    pub fn from_gguf(h: &GgufHeader) -> Result<Self> {
        if let Some(json) = h.get(TOK_HF_JSON).and_then(|v| v.as_str()) {
            return Self::from_gguf_hf_json(h, json);
        }
        let v = Vocab::read(h)?;
        let model = meta_str(h, TOK_MODEL)?;
        let (mut inner, add_bos_default) = match model {
            "gpt2" => byte_level_bpe(h, &v)?,
            "llama" => (sentencepiece(h, &v)?, true),
            other => {
                return Err(Error::Tokenizer(format!(
                    "tokenizer model `{other}` is not supported (gpt2: byte-level BPE, llama: \
                     SentencePiece)"
                )))
            }
        };
        let special: Vec<AddedToken> = (v.tokens.iter().zip(&v.types))
            .filter(|(_, &t)| t == TOKEN_CONTROL || t == TOKEN_USER_DEFINED)
            .map(|(s, &t)| AddedToken::from(s.clone(), t == TOKEN_CONTROL))
            .collect();
        inner.add_special_tokens(&special);
        // llama.cpp's key; absent, its default for the vocabulary (SentencePiece and Llama 3's
        // pre-tokenizers add one, plain GPT-2 BPE does not).
        let add_bos = match h.get(TOK_ADD_BOS).and_then(|x| x.as_bool()) {
            Some(b) => b,
            None => add_bos_default,
        };
        finish(h, inner, v.tokens, add_bos)
    }

    /// A GGUF that carries the whole Hugging Face `tokenizer.json` (`tokenizer.huggingface.json`,
    /// as `dejavu quantize` writes): built from it exactly, post-processor included; ids of
    /// BOS/EOS and the chat template from the usual keys.
    fn from_gguf_hf_json(h: &GgufHeader, json: &str) -> Result<Self> {
        let inner = parse_hf_json(json, TOK_HF_JSON)?;
        let n = inner.get_vocab_size(true);
        let tokens: Vec<String> = (0..n as u32)
            .map(|i| inner.id_to_token(i).unwrap_or_default())
            .collect();
        // Its own post-processor adds what it adds.
        finish(h, inner, tokens, false)
    }
}

/// The common end of a GGUF tokenizer: the BOS, EOS and EOT ids the keys give (those inside the
/// vocabulary `tokens`), a post-processor that puts the BOS first when `add_bos`, and the chat
/// template.
fn finish(
    h: &GgufHeader,
    mut inner: tokenizers::Tokenizer,
    tokens: Vec<String>,
    add_bos: bool,
) -> Result<Tokenizer> {
    // A special token's id, when its key is given: inside the vocabulary, or the file is
    // refused (an end-of-generation id past it would never end a reply).
    let id = |key: &str| -> Result<Option<u32>> {
        let Some(v) = h.get(key) else {
            return Ok(None);
        };
        match v.as_u64().filter(|&i| (i as usize) < tokens.len()) {
            Some(i) => Ok(Some(i as u32)),
            None => Err(Error::BadKey {
                key: key.into(),
                reason: format!(
                    "{v:?} is not a token id of the {} in the vocabulary",
                    tokens.len()
                ),
            }),
        }
    };
    let (bos, eos) = (id(TOK_BOS)?, id(TOK_EOS)?);
    if add_bos {
        prepend_bos(&mut inner, bos)?;
    }
    let eog: Vec<u32> = [eos, id(TOK_EOT)?].into_iter().flatten().collect();
    let chat_template = h
        .get(CHAT_TEMPLATE)
        .and_then(|x| x.as_str())
        .map(String::from);
    Ok(Tokenizer::assemble(
        inner,
        tokens,
        bos,
        eos,
        eog,
        chat_template,
    ))
}

impl Vocab {
    fn read(h: &GgufHeader) -> Result<Self> {
        let tokens = string_array(h, TOK_TOKENS)?;
        // llama.cpp's types run from 0 (undefined) to 6 (byte); anything else is a broken file.
        let types: Vec<i64> = match h.get(TOK_TYPES).and_then(|v| v.as_array()) {
            Some(a) => (a.iter().enumerate())
                .map(|(i, v)| match v.as_i64() {
                    Some(t @ 0..=6) => Ok(t),
                    _ => Err(Error::BadKey {
                        key: TOK_TYPES.into(),
                        reason: format!("token {i} has type {v:?} (types are 0 to 6)"),
                    }),
                })
                .collect::<Result<_>>()?,
            None => vec![TOKEN_NORMAL; tokens.len()],
        };
        if types.len() != tokens.len() {
            return Err(Error::Tokenizer(format!(
                "{} token types for {} tokens",
                types.len(),
                tokens.len()
            )));
        }
        Ok(Self { tokens, types })
    }

    fn ids(&self) -> tokenizers::models::bpe::Vocab {
        (self.tokens.iter().enumerate())
            .map(|(i, t)| (t.clone(), i as u32))
            .collect()
    }
}

/// A byte-level BPE of the GGUF's merges, with the pre-tokenizer `tokenizer.ggml.pre` names;
/// and whether that vocabulary adds a BOS by default.
fn byte_level_bpe(h: &GgufHeader, v: &Vocab) -> Result<(tokenizers::Tokenizer, bool)> {
    let pre = h.get(TOK_PRE).and_then(|x| x.as_str()).unwrap_or("default");
    let merges: Vec<(String, String)> = string_array(h, TOK_MERGES)?
        .into_iter()
        .map(|m| {
            m.split_once(' ')
                .map(|(a, b)| (a.to_string(), b.to_string()))
                .ok_or_else(|| Error::Tokenizer(format!("malformed merge `{m}`")))
        })
        .collect::<Result<_>>()?;
    let split = |pattern: &str| -> Result<PreTokenizerWrapper> {
        let s = Split::new(
            SplitPattern::Regex(pattern.into()),
            SplitDelimiterBehavior::Isolated,
            false,
        );
        let s = s.map_err(|e| Error::Tokenizer(format!("{pre} pattern: {e}")))?;
        Ok(Sequence::new(vec![s.into(), ByteLevel::new(false, true, false).into()]).into())
    };
    // (pre-tokenizer, NFC first, a word in the vocabulary is one token, BOS by default)
    let (pre_tok, nfc, ignore_merges, bos): (PreTokenizerWrapper, bool, bool, bool) = match pre {
        "default" | "gpt2" | "gpt-2" => (
            ByteLevel::new(false, true, true).into(),
            false,
            false,
            false,
        ),
        "smollm" => {
            let digits = Digits::new(true).into();
            let seq = Sequence::new(vec![digits, ByteLevel::new(false, true, true).into()]);
            (seq.into(), false, false, false)
        }
        "qwen2" | "deepseek-r1-qwen" => (split(QWEN2_PATTERN)?, true, false, false),
        "llama-bpe" | "llama3" | "llama-v3" | "falcon3" | "pixtral" => {
            (split(LLAMA3_PATTERN)?, false, true, true)
        }
        "tekken" => (split(TEKKEN_PATTERN)?, false, true, true),
        other => {
            return Err(Error::Tokenizer(format!(
                "pre-tokenizer `{other}` is not supported ({BPE_PRE})"
            )))
        }
    };
    let bpe = BPE::builder()
        .vocab_and_merges(v.ids(), merges)
        .ignore_merges(ignore_merges)
        .build()
        .map_err(|e| Error::Tokenizer(format!("building BPE: {e}")))?;
    let mut inner = tokenizers::Tokenizer::new(bpe);
    if nfc {
        inner.with_normalizer(Some(NFC));
    }
    inner.with_pre_tokenizer(Some(pre_tok));
    inner.with_decoder(Some(ByteLevel::default()));
    Ok((inner, bos))
}

/// A SentencePiece BPE vocabulary (`tokenizer.ggml.model = llama`) as a `tokenizers` BPE with
/// byte fallback, its merges derived from the scores.
fn sentencepiece(h: &GgufHeader, v: &Vocab) -> Result<tokenizers::Tokenizer> {
    let scores: Vec<f64> = match h.get(TOK_SCORES).and_then(|x| x.as_array()) {
        Some(a) => a.iter().map(|x| x.as_f64().unwrap_or(f64::NAN)).collect(),
        None => return Err(Error::MissingKey(TOK_SCORES.into())),
    };
    // The merges are ranked by score: a score that is not a finite number ranks nothing.
    if let Some(i) = scores.iter().position(|s| !s.is_finite()) {
        return Err(Error::BadKey {
            key: TOK_SCORES.into(),
            reason: format!("token {i}'s score is not a finite number"),
        });
    }
    if scores.len() != v.tokens.len() {
        return Err(Error::Tokenizer(format!(
            "{} token scores for {} tokens",
            scores.len(),
            v.tokens.len()
        )));
    }
    let unk = h
        .get(TOK_UNK)
        .and_then(|x| x.as_u64())
        .and_then(|i| v.tokens.get(i as usize))
        .cloned();
    let mut b = BPE::builder()
        .vocab_and_merges(v.ids(), spm_merges(v, &scores))
        .byte_fallback(true)
        .fuse_unk(true);
    if let Some(u) = unk {
        b = b.unk_token(u);
    }
    let bpe = b
        .build()
        .map_err(|e| Error::Tokenizer(format!("building SentencePiece BPE: {e}")))?;
    let mut inner = tokenizers::Tokenizer::new(bpe);
    let space_prefix = (h.get(TOK_ADD_SPACE_PREFIX).and_then(|x| x.as_bool())).unwrap_or(true);
    let spaces: NormalizerWrapper = Replace::new(" ", "▁")
        .map_err(|e| Error::Tokenizer(e.to_string()))?
        .into();
    let normalizer: NormalizerWrapper = match space_prefix {
        true => NormSequence::new(vec![Prepend::new("▁".into()).into(), spaces]).into(),
        false => spaces,
    };
    inner.with_normalizer(Some(normalizer));
    let mut decoders: Vec<DecoderWrapper> = vec![
        tokenizers::decoders::DecoderWrapper::Replace(
            Replace::new("▁", " ").map_err(|e| Error::Tokenizer(e.to_string()))?,
        ),
        ByteFallback::new().into(),
        Fuse::new().into(),
    ];
    if space_prefix {
        decoders.push(Strip::new(' ', 1, 0).into());
    }
    inner.with_decoder(Some(DecoderSequence::new(decoders)));
    Ok(inner)
}

/// Merges of a SentencePiece vocabulary: every split of a normal piece into two normal pieces,
/// ranked by the merged piece's score (highest first), then by the halves' ids.
fn spm_merges(v: &Vocab, scores: &[f64]) -> Vec<(String, String)> {
    let normal = |i: usize| v.types[i] == TOKEN_NORMAL;
    let ids: HashMap<&str, usize> = (v.tokens.iter().enumerate())
        .filter(|(i, _)| normal(*i))
        .map(|(i, t)| (t.as_str(), i))
        .collect();
    let mut order: Vec<usize> = (0..v.tokens.len()).filter(|&i| normal(i)).collect();
    order.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]).then(a.cmp(&b)));
    let mut merges = Vec::new();
    for i in order {
        let piece = v.tokens[i].as_str();
        let mut local: Vec<(usize, usize, &str, &str)> = (piece.char_indices().skip(1))
            .filter_map(|(at, _)| {
                let (l, r) = piece.split_at(at);
                Some((*ids.get(l)?, *ids.get(r)?, l, r))
            })
            .collect();
        local.sort_unstable();
        merges.extend(
            local
                .into_iter()
                .map(|(_, _, l, r)| (l.to_string(), r.to_string())),
        );
    }
    merges
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
