//! `dejavu chat`: a conversation through the model's chat template.
//!
//! On a terminal the turns come from a line editor (rustyline): editing, history (Up/Down),
//! a line ending in `\` continues on the next, `/clear` starts over (the system prompt kept),
//! `/exit` or Ctrl-D ends the session, Ctrl-C clears the line at the prompt and stops a reply
//! mid-way (the conversation keeps what was said). From a pipe, each line is a turn and the end
//! of input ends the session; empty lines are skipped in both.
use crate::backend_choice::with_decoder;
use crate::{stream_to, ModelArgs, SamplingArgs, SparsityArgs};
use anyhow::{bail, Result};
use clap::Args;
use dejavu::exec::Decoder;
use dejavu::exec::Engine;
use dejavu::text::chat::EncodeChat;
use dejavu::text::generate::{generate_with, reusable, Stop, StopRules};
use dejavu::text::sampling::Sampler;
use std::io::{BufRead, IsTerminal, Write};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

#[derive(Args)]
pub struct ChatArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// System prompt (default: the template's own).
    #[arg(long)]
    system: Option<String>,
    /// Maximum tokens per reply.
    #[arg(long, short = 'n', default_value_t = 512)]
    max_tokens: usize,
    /// Context window in tokens (default: min(model's, 4096)); when a conversation outgrows
    /// it, the oldest turns are dropped.
    #[arg(long, short = 'c', visible_alias = "ctx-size")]
    ctx: Option<usize>,
    #[command(flatten)]
    sampling: SamplingArgs,
    #[command(flatten)]
    sparsity: SparsityArgs,
}

pub fn cmd_chat(a: ChatArgs) -> Result<()> {
    let engine = a.model.load(a.ctx)?;
    if !engine.tokenizer.has_chat_template() {
        bail!("this model has no chat template; use `generate` instead");
    }
    let mut sampler = a.sampling.sampler()?;
    let policy = a.sparsity.policy(&engine)?;
    with_decoder(&engine, a.model.placement(), &policy, |dec| {
        chat_loop(&engine, dec, &a, &mut sampler)
    })
}

/// A user's turn, or what they asked for instead.
enum Turn {
    Say(String),
    Clear,
    End,
}

/// Most bytes of one line of piped input: far past any context (a million-token context
/// holds a few MiB of text), far below what would strain the machine.
const MAX_LINE: u64 = 16 << 20;

/// Where turns come from: the line editor on a terminal, plain lines from a pipe.
enum Source {
    Editor(Box<rustyline::DefaultEditor>),
    Lines(std::io::StdinLock<'static>),
}

impl Source {
    fn open() -> Result<Self> {
        if std::io::stdin().is_terminal() {
            return Ok(Self::Editor(Box::new(rustyline::DefaultEditor::new()?)));
        }
        Ok(Self::Lines(std::io::stdin().lock()))
    }

    /// One raw line; `None` at the end of input.
    fn line(&mut self, prompt: &str) -> Result<Option<String>> {
        use rustyline::error::ReadlineError;
        match self {
            Self::Editor(ed) => loop {
                match ed.readline(prompt) {
                    Ok(l) => return Ok(Some(l)),
                    Err(ReadlineError::Interrupted) => continue, // Ctrl-C: a fresh line
                    Err(ReadlineError::Eof) => return Ok(None),
                    Err(e) => return Err(e.into()),
                }
            },
            Self::Lines(input) => loop {
                // At most MAX_LINE bytes a line (endless input without a newline is refused,
                // not held); a line that is not UTF-8 is skipped with an error, the chat
                // goes on.
                let mut l = Vec::new();
                let n = std::io::Read::take(&mut *input, MAX_LINE + 1).read_until(b'\n', &mut l)?;
                if n == 0 {
                    return Ok(None);
                }
                if l.len() as u64 > MAX_LINE {
                    bail!("a line of standard input is longer than {MAX_LINE} bytes");
                }
                match String::from_utf8(l) {
                    Ok(l) => return Ok(Some(l.trim_end_matches(['\n', '\r']).to_string())),
                    Err(_) => eprintln!("error: a line of standard input is not UTF-8; skipped"),
                }
            },
        }
    }

    /// The next turn: lines joined while they end in `\`, commands recognised.
    fn turn(&mut self) -> Result<Turn> {
        let mut text = String::new();
        let mut prompt = "> ";
        loop {
            let Some(line) = self.line(prompt)? else {
                return Ok(Turn::End);
            };
            match line.strip_suffix('\\') {
                Some(part) => {
                    text.push_str(part);
                    text.push('\n');
                    prompt = ". ";
                }
                None => {
                    text.push_str(&line);
                    break;
                }
            }
        }
        match text.trim() {
            "" => self.turn(),
            "/exit" | "/quit" | "/bye" => Ok(Turn::End),
            "/clear" => Ok(Turn::Clear),
            _ => {
                if let Self::Editor(ed) = self {
                    let _ = ed.add_history_entry(text.as_str());
                }
                Ok(Turn::Say(text))
            }
        }
    }
}

/// Read turns and reply to each on `dec`, reusing the cached prefix of the conversation.
fn chat_loop(
    engine: &Engine,
    dec: &mut dyn Decoder,
    a: &ChatArgs,
    sampler: &mut Sampler,
) -> Result<()> {
    let system: Vec<(String, String)> = (a.system.iter())
        .map(|s| ("system".into(), s.clone()))
        .collect();
    let mut messages = system.clone();
    let mut cached: Vec<u32> = Vec::new();
    let mut source = Source::open()?;
    // On a terminal, Ctrl-C during a reply stops the reply, not the session (at the prompt,
    // the line editor reads it as a key). From a pipe, Ctrl-C ends the process as usual.
    let cancel = Arc::new(AtomicBool::new(false));
    if let Source::Editor(_) = source {
        let flag = cancel.clone();
        let _ = ctrlc::set_handler(move || flag.store(true, Ordering::Relaxed));
    }
    let rules = StopRules {
        cancel: Some(cancel.clone()),
        ..Default::default()
    };
    eprintln!(
        "chat with the model: `\\` at a line's end continues it, /clear starts over, /exit or \
         Ctrl-D ends; Ctrl-C stops a reply"
    );
    loop {
        let text = match source.turn()? {
            Turn::End => return Ok(()),
            Turn::Clear => {
                messages = system.clone();
                eprintln!("(conversation cleared)");
                continue;
            }
            Turn::Say(t) => t,
        };
        messages.push(("user".into(), text));
        let Some(ids) = fit_conversation(engine, &mut messages)? else {
            eprintln!(
                "error: this message alone does not fit the context of {} tokens (--ctx); try a \
                 shorter one",
                engine.n_ctx
            );
            messages.pop();
            continue;
        };
        let common = reusable(&cached, &ids);
        dec.truncate(common);
        cancel.store(false, Ordering::Relaxed);
        let mut stdout = std::io::stdout().lock();
        let (reply, stats) = generate_with(
            engine,
            dec,
            &ids[common..],
            a.max_tokens,
            sampler,
            &rules,
            stream_to(&mut stdout, &cancel),
        )?;
        // Standard output gone (a closed pipe): the reply stopped at its first piece; end.
        if writeln!(stdout).and_then(|_| stdout.flush()).is_err() {
            eprintln!("(standard output closed; chat ends)");
            return Ok(());
        }
        match stats.stop {
            Stop::ContextFull => eprintln!(
                "(reply cut: the context window of {} tokens is full)",
                engine.n_ctx
            ),
            Stop::Cancelled => eprintln!("(reply stopped)"),
            _ => {}
        }
        // What the cache holds now: the prompt and every reply token that was fed back (those
        // only where a later prompt may reuse them: see `Decoder::reuses_steps`).
        cached = ids;
        if dec.reuses_steps() {
            cached.extend(&reply);
        }
        cached.truncate(dec.len());
        messages.push(("assistant".into(), engine.tokenizer.decode(&reply)?));
    }
}

/// The conversation's tokens, dropping the oldest turns (system prompt kept) until the prompt
/// leaves room for a reply; `None` when even the latest message alone does not fit.
fn fit_conversation(
    engine: &Engine,
    messages: &mut Vec<(String, String)>,
) -> Result<Option<Vec<u32>>> {
    loop {
        let ids = engine.tokenizer.encode_chat(messages)?;
        // Leave at least a quarter of the window (and one token) for the reply.
        if ids.len() + (engine.n_ctx / 4).max(1) < engine.n_ctx {
            return Ok(Some(ids));
        }
        let first = messages.iter().position(|(r, _)| r != "system");
        match first {
            Some(i) if i + 1 < messages.len() => {
                messages.remove(i);
                eprintln!("(context full: dropped the oldest turn)");
            }
            _ => return Ok(None),
        }
    }
}
