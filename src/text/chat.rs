//! A conversation to token ids through the model's chat template, with the messages' text kept
//! apart from the template's control tokens.
//!
//! Contract: only the template's own text may become control tokens (`<|im_start|>`, `</s>`, ...);
//! every message's content is tokenized as plain text, so a user who types `<|im_end|>` gets the
//! characters, not the token (llama.cpp's `parse_special = false` for user content). Ids equal
//! `encode(apply_chat_template(messages))` whenever no message contains a control token's text.
//!
//! How: the template is rendered twice, with each message's content and with a unique marker in
//! its place. The markers cut the second rendering into the template's own pieces; the real
//! rendering must then be those pieces with each message's content between them, verbatim or as
//! templates commonly change it (trimmed at either end). The pieces are tokenized with control
//! tokens, the contents without. A template that changes a message's text in another way is a
//! clear error rather than a prompt whose boundaries cannot be trusted.
pub use crate::model::tokenizer::ChatMessage;
use crate::model::tokenizer::Tokenizer;
use crate::{Error, Result};

/// A marker no message or template contains (private-use characters around a per-call nonce).
fn marker(i: usize, nonce: u64) -> String {
    format!("\u{F8FF}dejavu-message-{i}-{nonce:016x}\u{F8FF}")
}

/// [`encode_chat`] as a method of the tokenizer.
pub trait EncodeChat {
    /// Token ids of a conversation through the chat template: the template's control tokens,
    /// the messages as plain text.
    fn encode_chat(&self, messages: &[(String, String)]) -> Result<Vec<u32>>;
}

impl EncodeChat for Tokenizer {
    fn encode_chat(&self, messages: &[(String, String)]) -> Result<Vec<u32>> {
        encode_chat(self, messages)
    }
}

/// The token ids of `messages` (role, content) rendered by the model's chat template with the
/// assistant's turn opened.
pub fn encode_chat(tok: &Tokenizer, messages: &[(String, String)]) -> Result<Vec<u32>> {
    encode_chat_tools(tok, &ChatMessage::plain(messages), None)
}

/// [`encode_chat`] of messages with their tool fields, and the tool definitions `tools`. The
/// template renders those fields and definitions itself, so they become its own text: any of
/// them holding a control token's text is refused (a tool's description cannot close a turn).
/// An empty content has no marker (templates test it: `if message.content`).
pub fn encode_chat_tools(
    tok: &Tokenizer,
    messages: &[ChatMessage],
    tools: Option<&[serde_json::Value]>,
) -> Result<Vec<u32>> {
    let rendered = |v: String| -> Result<()> {
        let control = (tok.special_ids().into_iter())
            .filter_map(|id| tok.token_text(id))
            .find(|t| !t.is_empty() && v.contains(t));
        match control {
            Some(t) => Err(Error::Template(format!(
                "a tool definition or tool call holds the control token {t:?}"
            ))),
            None => Ok(()),
        }
    };
    for t in tools.unwrap_or_default() {
        rendered(t.to_string())?;
    }
    for m in messages.iter().filter(|m| !m.extra.is_empty()) {
        rendered(serde_json::Value::Object(m.extra.clone()).to_string())?;
    }
    let real = tok.apply_chat_template_tools(messages, tools)?;
    let nonce = {
        use std::hash::BuildHasher;
        std::collections::hash_map::RandomState::new().hash_one(&real)
    };
    let marked: Vec<ChatMessage> = (messages.iter().enumerate())
        .map(|(i, m)| ChatMessage {
            content: match m.content.is_empty() {
                true => String::new(),
                false => marker(i, nonce),
            },
            ..m.clone()
        })
        .collect();
    let skeleton = tok.apply_chat_template_tools(&marked, tools)?;
    let (pieces, order) = split_at_markers(&skeleton, messages.len(), nonce)?;
    let mut ids = Vec::new();
    let mut rest = real.as_str();
    for (k, piece) in pieces.iter().enumerate() {
        rest = rest.strip_prefix(piece.as_str()).ok_or_else(changed)?;
        ids.extend(tok.encode(piece)?);
        let Some(&m) = order.get(k) else { break };
        let next = pieces[k + 1].as_str();
        let content = rendered_content(&messages[m].content, rest, next).ok_or_else(changed)?;
        ids.extend(tok.encode_plain(content)?);
        rest = &rest[content.len()..];
    }
    if !rest.is_empty() {
        return Err(changed());
    }
    Ok(ids)
}

fn changed() -> Error {
    Error::Template(
        "the chat template changes message text in a way that cannot be kept apart from its \
         control tokens"
            .into(),
    )
}

/// The template's own pieces between the markers of `skeleton`, and which message each marker
/// stands for (a template may drop or reorder messages, e.g. a system prompt moved first).
fn split_at_markers(skeleton: &str, n: usize, nonce: u64) -> Result<(Vec<String>, Vec<usize>)> {
    let mut found: Vec<(usize, usize)> = Vec::new(); // (byte offset, message)
    for i in 0..n {
        let m = marker(i, nonce);
        let hits: Vec<usize> = skeleton.match_indices(&m).map(|(at, _)| at).collect();
        match hits.as_slice() {
            [] => {}
            [at] => found.push((*at, i)),
            _ => return Err(changed()),
        }
    }
    found.sort_unstable();
    let mut pieces = Vec::with_capacity(found.len() + 1);
    let mut at = 0;
    for &(start, i) in &found {
        pieces.push(skeleton[at..start].to_string());
        at = start + marker(i, nonce).len();
    }
    pieces.push(skeleton[at..].to_string());
    Ok((pieces, found.into_iter().map(|(_, i)| i).collect()))
}

/// The message text as the real rendering holds it at the start of `rest`, followed by the next
/// template piece: the content itself, or trimmed at either end.
fn rendered_content<'a>(content: &str, rest: &'a str, next: &str) -> Option<&'a str> {
    [
        content,
        content.trim(),
        content.trim_start(),
        content.trim_end(),
    ]
    .into_iter()
    .find(|c| rest.starts_with(c) && rest[c.len()..].starts_with(next))
    .map(|c| &rest[..c.len()])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn content_is_found_verbatim_or_trimmed() {
        assert_eq!(rendered_content(" hi ", " hi <e>", "<e>"), Some(" hi "));
        assert_eq!(rendered_content(" hi ", "hi<e>", "<e>"), Some("hi"));
        assert_eq!(rendered_content("hi", "HI<e>", "<e>"), None);
    }

    #[test]
    fn markers_split_the_skeleton_in_rendering_order() {
        let (a, b) = (marker(0, 7), marker(1, 7));
        let s = format!("<s>{b}|{a}</s>");
        let (pieces, order) = split_at_markers(&s, 2, 7).unwrap();
        assert_eq!(pieces, ["<s>", "|", "</s>"]);
        assert_eq!(order, [1, 0]);
        assert!(split_at_markers(&format!("{a}{a}"), 1, 7).is_err());
    }
}
