//! `dejavu`: the command line. Parses arguments and calls the library; errors print one clear
//! message and exit non-zero.
use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand};
use dejavu::eval::perplexity::{perplexity, Feed};
use dejavu::exec::KvType;
use dejavu::exec::{Engine, EngineOptions};
use dejavu::fetch;
use dejavu::model::synthetic::{self, SyntheticOptions};
use dejavu::quantize::mix::FileType;
use dejavu::text::chat::EncodeChat;
use dejavu::text::generate::Stop;
use dejavu::text::sampling::{Sampler, SamplerConfig};
use std::io::Write;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

mod backend_choice;
use backend_choice::{with_decoder, with_sessions, BackendKind, Placement};

mod bench_cmd;
mod chat_cmd;
mod inspect_cmd;
mod llama_flags;
mod quantize_cmd;
mod serve_cmd;
mod sparsity_cmd;

#[derive(Parser)]
#[command(
    name = "dejavu",
    version,
    about = "CPU-first LLM inference with contextual sparsity (Deja Vu)"
)]
struct Cli {
    /// Log choices made at start-up (kernel ISA tier, threads, context) to stderr.
    #[arg(long, short, global = true)]
    verbose: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate a continuation of a prompt; streams only the new text to stdout, timing to stderr.
    Generate(GenerateArgs),
    /// Interactive chat with the model's chat template (a line editor on a terminal; /exit ends).
    Chat(chat_cmd::ChatArgs),
    /// Perplexity of a text file, computed as llama.cpp's llama-perplexity does.
    Perplexity(PerplexityArgs),
    /// Prefill and decode speed, llama-bench style (markdown to stdout; JSON/CSV on request).
    Bench(bench_cmd::BenchArgs),
    /// Fit the sparsity predictors on text and store them with a recommended setting.
    Calibrate(sparsity_cmd::CalibrateArgs),
    /// The quality/speed frontier of sparsity policies on a text: markdown, JSON and a PNG plot.
    Report(sparsity_cmd::ReportArgs),
    /// An OpenAI-compatible HTTP server (chat and text completions, streamed or whole) with a
    /// chat page at `/`.
    Serve(serve_cmd::ServeArgs),
    /// Convert a Hugging Face directory or a GGUF into a GGUF of one weight type.
    Quantize(quantize_cmd::QuantizeArgs),
    /// Print a model's config and tensor table (GGUF: also its metadata).
    Inspect {
        /// The GGUF file, Hugging Face directory or known model name.
        path: std::ffi::OsString,
    },
    /// Download a known model into the cache (default: the default model; `all` for every model).
    Fetch {
        /// Model name (smollm2-135m-instruct, qwen2.5-coder-0.5b-instruct, all).
        name: Option<String>,
    },
}

#[derive(Args, Clone)]
struct ModelArgs {
    /// GGUF file, Hugging Face checkpoint directory or known model name (default:
    /// smollm2-135m-instruct, fetched on first use).
    #[arg(long, short)]
    model: Option<std::ffi::OsString>,
    /// Worker threads (default: all cores).
    #[arg(long, short)]
    threads: Option<usize>,
    /// How long idle worker threads poll for work before sleeping, 0-100 (llama.cpp's
    /// `--poll`): 0 sleeps at once (least CPU when idle), 100 spins longest.
    #[arg(long, default_value_t = dejavu_backend_cpu::pool::DEFAULT_POLL,
          value_parser = clap::value_parser!(u32).range(0..=100))]
    poll: u32,
    /// KV cache element type: f16 (half the memory, llama.cpp's default) or f32.
    #[arg(long, default_value = "f16", value_parser = parse_kv_type)]
    kv_type: KvType,
    #[command(flatten)]
    synthetic: SyntheticArgs,
    /// Keep the file's row layout (skip repacking Q8_0/Q4_0/Q4_1/Q5_0 rows at load).
    #[arg(long)]
    no_repack: bool,
    /// Where to run: cpu, or cuda (a build with `--features cuda`).
    #[arg(long, value_enum, default_value = "cpu")]
    backend: BackendKind,
    /// Same request, same reply (the CPU's default, `true`): every token is computed as its own
    /// decode step computes it, so its logits do not depend on how its prompt was split, on a
    /// cached prefix, on the requests batched beside it or on `--threads`. `false`: prompts of
    /// 16 tokens and more go through faster tiles whose rounding differs, so a near tie can
    /// flip. On the GPU the default is `false`; `true` runs its batch-invariant kernels (one
    /// GPU, dense plans), at a cost in speed (README: Deterministic generation).
    #[arg(long, value_name = "BOOL", num_args = 0..=1, default_missing_value = "true")]
    deterministic: Option<bool>,
    /// Tensor parallelism: split the model over this many GPUs (`-tp N`; with `--backend cuda`,
    /// one GPU per rank, NCCL between them).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=64))]
    tensor_parallel: u16,
}

/// How a `--model synthetic:NAME` is built (random weights at a published shape, for speed only).
#[derive(Args, Clone, Copy)]
struct SyntheticArgs {
    /// File type of a synthetic model (each matrix in the type llama-quantize gives it): f16,
    /// bf16, q8_0, q4_0, q4_k_s, q4_k_m, q5_k_s, q5_k_m or q6_k.
    #[arg(long, default_value = "f16", value_parser = parse_dtype)]
    dtype: FileType,
    /// Rank of a synthetic model's predictors (default: d_model / 16, in multiples of 32).
    #[arg(long)]
    predictor_rank: Option<usize>,
}

impl SyntheticArgs {
    fn options(self) -> SyntheticOptions {
        SyntheticOptions {
            dtype: self.dtype,
            predictor_rank: self.predictor_rank,
            seed: 0,
        }
    }
}

fn parse_dtype(s: &str) -> std::result::Result<FileType, String> {
    FileType::parse(s)
        .filter(|f| synthetic::DTYPES.contains(f))
        .ok_or_else(|| format!("`{s}`: expected one of {}", synthetic::dtype_names()))
}

fn parse_kv_type(s: &str) -> std::result::Result<KvType, String> {
    KvType::from_name(s).ok_or_else(|| format!("`{s}`: expected f32 or f16"))
}

impl ModelArgs {
    /// Where the model runs: the backend, over how many ranks.
    fn placement(&self) -> Placement {
        Placement {
            backend: self.backend,
            tensor_parallel: self.tensor_parallel as usize,
            deterministic: self.deterministic == Some(true),
        }
    }

    fn load(&self, n_ctx: Option<usize>) -> Result<Engine> {
        dejavu_backend_cpu::pool::set_poll(self.poll);
        let path = fetch::resolve_model(self.model.as_deref())?;
        let engine = load_engine(
            &path,
            EngineOptions {
                threads: capped_threads(self.threads),
                n_ctx,
                kv_type: self.kv_type,
                synthetic: self.synthetic.options(),
                // A GPU uploads the file's layout (repacking is the CPU's).
                keep_file_layout: self.no_repack || self.backend == BackendKind::Cuda,
                prompt_tiles: self.deterministic == Some(false),
            },
        )?;
        if engine.model.synthetic_source().is_some() {
            eprintln!(
                "note: {}: for speed measurements only; its output means nothing",
                engine.model.label()
            );
        }
        Ok(engine)
    }
}

#[derive(Args)]
struct SparsityArgs {
    /// Sparsity policy. Whole policies:
    ///   dense                    every neuron and head (the default)
    ///   recommended              the setting `dejavu calibrate` chose for this model
    ///   paper[...]               Deja Vu's recipe: dejavu:0.1+dejavu-attn:0.5+lookahead
    /// or parts joined by `+` (KEEP in (0, 1]; EDGE: first/last layers kept dense):
    ///   oracle:KEEP[:EDGE]       MLP: the KEEP fraction of neurons with the largest true output
    ///   oracle                   MLP (ReLU models): exactly the nonzero neurons
    ///   relu-exact               MLP (ReLU models): the nonzero neurons, found from fc1
    ///   gate-first:KEEP[:EDGE]   MLP (gated): neurons by |gate| (CATS-style)
    ///   up-first:KEEP[:EDGE]     MLP (gated): neurons by |up|
    ///   dejavu:KEEP[:EDGE]       MLP: Deja Vu's low-rank predictor (needs calibrate)
    ///   dejavu:auto[:SCALE]      MLP: the predictor at calibrated per-layer densities
    ///   attn-norm:KEEP[:EDGE]    heads: by the norm of each head's output
    ///   dejavu-attn:KEEP[:EDGE]  heads: Deja Vu's head predictor (needs calibrate)
    ///   lookahead                predict layer l+1 while layer l runs
    ///   lazy-kv                  recompute skipped heads' K/V only when needed (MHA models)
    ///   head:RANK:CANDIDATES     output head: a rank-RANK preview picks CANDIDATES exact logits
    ///   teal:S[:uniform][:always] every projection: drop the share S of inputs smallest in
    ///                            |x| (thresholds from calibrate; synthetic models: measured),
    ///                            shared across the inputs as calibrate's greedy search found
    ///                            (`:uniform`: S at every input); matrices whose sparse
    ///                            products would be slower than dense on this device at their
    ///                            share stay dense (`bench` counts their bytes; `:always`: none)
    ///   wina:S[:uniform][:always] as teal, ranking inputs by |x_i| * ||W[:, i]||
    #[arg(long, default_value = "dense", verbatim_doc_comment)]
    sparsity: String,
    /// Predictors file (default: the `dejavu calibrate` output next to the model, if present).
    #[arg(long)]
    predictors: Option<std::path::PathBuf>,
}

impl SparsityArgs {
    fn policy(&self, engine: &Engine) -> Result<dejavu::sparsity::policy::Policy> {
        policy_for(engine, &self.sparsity, self.predictors.as_deref())
    }
}

fn policy_for(
    engine: &Engine,
    spec: &str,
    predictors: Option<&std::path::Path>,
) -> Result<dejavu::sparsity::policy::Policy> {
    // Parts that read the predictors file: recommended, paper, head:, dejavu:, dejavu-attn:,
    // teal:, wina:.
    let needs = ["recommended", "paper", "head", "dejavu", "teal", "wina"]
        .iter()
        .any(|p| spec.contains(p));
    let preds = if needs || predictors.is_some() {
        engine.predictors(predictors)?
    } else {
        None
    };
    Ok(engine.policy(spec, preds.as_ref())?)
}

#[derive(Args)]
struct SamplingArgs {
    /// Sampling temperature; 0 = greedy.
    #[arg(
        long,
        visible_alias = "temp",
        default_value_t = 0.8,
        allow_negative_numbers = true
    )]
    temperature: f32,
    /// Keep only the K most likely tokens (0 = off).
    #[arg(long, default_value_t = 40)]
    top_k: usize,
    /// Nucleus sampling: keep the smallest set of tokens with probability >= P.
    #[arg(long, default_value_t = 0.95)]
    top_p: f32,
    /// Drop tokens less likely than MIN_P times the most likely one.
    #[arg(long, default_value_t = 0.05)]
    min_p: f32,
    /// Penalty for tokens seen in the last `--repeat-last-n` (1.0 = off).
    #[arg(long, default_value_t = 1.0)]
    repeat_penalty: f32,
    /// How many recent tokens the penalties look at.
    #[arg(long, default_value_t = 64)]
    repeat_last_n: usize,
    /// Subtract this from the logit of every token seen in that window (0 = off).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    presence_penalty: f32,
    /// Subtract this once per occurrence in that window (0 = off).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    frequency_penalty: f32,
    /// Random seed: the same seed gives the same text (default: a random one, printed with
    /// --verbose).
    #[arg(long, short = 's')]
    seed: Option<u64>,
}

/// A seed from the clock and the process (the standard library's randomly keyed hasher).
fn random_seed() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    h.write_u32(std::process::id());
    h.finish()
}

impl SamplingArgs {
    fn sampler(&self) -> Result<Sampler> {
        let cfg = SamplerConfig {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            repeat_penalty: self.repeat_penalty,
            repeat_last_n: self.repeat_last_n,
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
            seed: self.seed.unwrap_or_else(random_seed),
            ..Default::default()
        };
        if VERBOSE.load(std::sync::atomic::Ordering::Relaxed) {
            eprintln!("seed: {}", cfg.seed);
        }
        cfg.validate().map_err(anyhow::Error::msg)?;
        Ok(Sampler::new(cfg))
    }
}

#[derive(Args)]
struct GenerateArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// The prompt (`-` reads it from standard input).
    #[arg(long, short, required_unless_present = "file", conflicts_with = "file")]
    prompt: Option<String>,
    /// Read the prompt from this file (`-`: standard input), as llama.cpp's `-f`.
    #[arg(long, short = 'f')]
    file: Option<std::path::PathBuf>,
    /// Process escapes in the prompt (\n, \t, \\, \", \'), as llama.cpp's `-e`.
    #[arg(short = 'e', long = "escape")]
    escape: bool,
    /// Maximum number of tokens to generate.
    #[arg(long, short = 'n', visible_alias = "n-predict", default_value_t = 128)]
    max_tokens: usize,
    /// Stop when the text contains this string (repeatable; not printed), as llama.cpp's
    /// `-r/--reverse-prompt`.
    #[arg(long = "stop", short = 'r', visible_alias = "reverse-prompt")]
    stop: Vec<String>,
    /// Keep generating past end-of-generation tokens (up to --max-tokens).
    #[arg(long)]
    ignore_eos: bool,
    /// Wrap the prompt in the model's chat template as a user message.
    #[arg(long)]
    chat: bool,
    /// Context window in tokens (default: min(model's, 4096)).
    #[arg(long, short = 'c', visible_alias = "ctx-size")]
    ctx: Option<usize>,
    /// Lossless speculation: the --sparsity plan drafts up to K tokens, the dense model checks
    /// them in one pass and keeps the agreeing ones plus its own next token. The text is the
    /// dense model's (greedy: the same tokens, bit for bit on the CPU); the speed depends on how
    /// cheap the drafts are and how many survive (reported on stderr).
    #[arg(long, value_name = "K")]
    speculate: Option<usize>,
    #[command(flatten)]
    sampling: SamplingArgs,
    #[command(flatten)]
    sparsity: SparsityArgs,
}

#[derive(Args)]
struct PerplexityArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// The text file to score.
    #[arg(long, short)]
    file: std::path::PathBuf,
    /// Tokens per chunk.
    #[arg(long, default_value_t = 512)]
    ctx: usize,
    /// Score each position one token at a time through the KV cache (the decode kernels, with
    /// 8-bit activations) instead of one batch per chunk (the prefill kernels). Implied by a
    /// sparse policy, which is then compared with dense decoding (KL divergence, top-1 agreement).
    #[arg(long)]
    token_by_token: bool,
    /// Score at most this many chunks (default: all).
    #[arg(long)]
    chunks: Option<usize>,
    /// Also write the result as JSON to this file: ppl, dense ppl, KL, top-1 agreement, MLP and
    /// head density, bytes per token (for a sparse policy; dense runs write ppl only).
    #[arg(long)]
    json: Option<std::path::PathBuf>,
    #[command(flatten)]
    sparsity: SparsityArgs,
}

fn main() {
    // `-tp N` (vLLM's spelling) is `--tensor-parallel N`: clap's short flags are one letter, and
    // `-t` is the thread count.
    let args = match llama_flags::llama_cpp_spellings(std::env::args_os().collect()) {
        Ok(args) => args,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(2);
        }
    };
    let cli = Cli::parse_from(args);
    VERBOSE.store(cli.verbose, std::sync::atomic::Ordering::Relaxed);
    if let Err(e) = run(cli) {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

static VERBOSE: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Bench(a) => bench_cmd::cmd_bench(a),
        Command::Generate(a) => cmd_generate(a),
        Command::Chat(a) => chat_cmd::cmd_chat(a),
        Command::Perplexity(a) => cmd_perplexity(a),
        Command::Inspect { path } => {
            let path = fetch::resolve_model(Some(&path))?;
            inspect_cmd::print_out(&inspect_cmd::cmd_inspect(&path)?)
        }
        Command::Quantize(a) => quantize_cmd::cmd_quantize(a),
        Command::Serve(a) => serve_cmd::cmd_serve(a),
        Command::Calibrate(a) => sparsity_cmd::cmd_calibrate(a),
        Command::Report(a) => sparsity_cmd::cmd_report(a),
        Command::Fetch { name } => {
            let names: Vec<&str> = match name.as_deref() {
                None => vec![fetch::DEFAULT_MODEL],
                Some("all") => fetch::KNOWN_MODELS.to_vec(),
                Some(n) => vec![n],
            };
            for n in names {
                println!("{}", fetch::fetch(n)?.display());
            }
            Ok(())
        }
    }
}

/// `--threads`, capped at the cores: the pool's threads spin, and more of them than cores make
/// decoding over 100x slower (measured: 160x at 8 threads on 2 cores).
fn capped_threads(threads: Option<usize>) -> Option<usize> {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    match threads {
        Some(n) if n > cores => {
            eprintln!("warning: --threads {n} exceeds the {cores} cores; using {cores}");
            Some(cores)
        }
        t => t,
    }
}

fn load_engine(path: &std::path::Path, opts: EngineOptions) -> Result<Engine> {
    let engine =
        Engine::load(path, &opts).with_context(|| format!("loading {}", path.display()))?;
    if VERBOSE.load(std::sync::atomic::Ordering::Relaxed) {
        let c = &engine.model.config;
        eprintln!(
            "model: {} ({}, {} layers, d_model {}, n_ff {}, {} heads / {} kv heads, vocab {})",
            path.display(),
            c.arch.name(),
            c.n_layers,
            c.d_model,
            c.n_ff,
            c.n_heads,
            c.n_kv_heads,
            c.vocab_size
        );
        eprintln!(
            "kernels: {} (DEJAVU_ISA overrides) | threads: {} | context: {}",
            engine.isa(),
            engine.threads(),
            engine.n_ctx
        );
    }
    Ok(engine)
}

/// The prompt of `generate`: `-p TEXT`, `-p -` or `-f -` (standard input), or `-f FILE`, with
/// escapes processed under `-e`.
fn prompt_text(a: &GenerateArgs) -> Result<String> {
    let stdin = || -> Result<String> {
        let mut s = String::new();
        let cap = dejavu::fsio::MAX_TEXT_BYTES;
        let mut input = std::io::Read::take(std::io::stdin().lock(), cap + 1);
        std::io::Read::read_to_string(&mut input, &mut s)
            .context("reading the prompt from standard input (it must be UTF-8)")?;
        if s.len() as u64 > cap {
            bail!("the prompt on standard input is longer than {cap} bytes");
        }
        Ok(s)
    };
    let text = match (&a.prompt, &a.file) {
        (Some(p), _) if p == "-" => stdin()?,
        (Some(p), _) => p.clone(),
        (None, Some(f)) if f.as_os_str() == "-" => stdin()?,
        (None, Some(f)) => dejavu::fsio::read_text(f, dejavu::fsio::MAX_TEXT_BYTES, false)?,
        (None, None) => bail!("give a prompt with -p TEXT or -f FILE"),
    };
    Ok(if a.escape { unescape(&text) } else { text })
}

/// llama.cpp's `-e`: \n, \r, \t, \\, \", \' and \0 become the characters; others stay.
fn unescape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut it = s.chars();
    while let Some(c) = it.next() {
        if c != '\\' {
            out.push(c);
            continue;
        }
        match it.next() {
            Some('n') => out.push('\n'),
            Some('r') => out.push('\r'),
            Some('t') => out.push('\t'),
            Some('0') => out.push('\0'),
            Some(c @ ('\\' | '"' | '\'')) => out.push(c),
            Some(c) => {
                out.push('\\');
                out.push(c);
            }
            None => out.push('\\'),
        }
    }
    out
}

fn cmd_generate(a: GenerateArgs) -> Result<()> {
    let prompt = prompt_text(&a)?;
    let engine = a.model.load(a.ctx)?;
    let mut sampler = a.sampling.sampler()?;
    // A rendered chat template places its own BOS (and keeps the prompt's text plain); a plain
    // prompt gets the model's.
    let ids = match a.chat {
        true => (engine.tokenizer).encode_chat(&[("user".into(), prompt)])?,
        false => engine.tokenizer.encode_prompt(&prompt)?,
    };
    // Set when standard output goes away mid-reply: generation stops there.
    let closed = Arc::new(AtomicBool::new(false));
    let rules = dejavu::text::generate::StopRules {
        stop: a.stop.clone(),
        ignore_eos: a.ignore_eos,
        cancel: Some(closed.clone()),
    };
    if rules.stop.iter().any(String::is_empty) {
        bail!("--stop: an empty stop string would stop at once");
    }
    let policy = a.sparsity.policy(&engine)?;
    let mut stdout = std::io::stdout().lock();
    let (stats, last) = with_decoder(&engine, a.model.placement(), &policy, |dec| {
        let (_, stats) = dejavu::text::generate::generate_speculative(
            &engine,
            dec,
            &ids,
            a.max_tokens,
            &mut sampler,
            &rules,
            a.speculate,
            stream_to(&mut stdout, &closed),
        )?;
        Ok((stats, dec.last_step()?))
    })?;
    // A reader that went away (`| head -c 5`) is not an error: end quietly.
    if let Err(e) = writeln!(stdout).and_then(|_| stdout.flush()) {
        if e.kind() == std::io::ErrorKind::BrokenPipe {
            return Ok(());
        }
        return Err(e.into());
    }
    if let (false, Some(s)) = (policy.is_dense(), last) {
        eprintln!(
            "sparsity: {} | last step: {:.1} MB of weights, MLP density {:.2}, head density {:.2}, {} exact logits",
            policy.name,
            s.weight_bytes as f64 / 1e6,
            s.mlp_kept as f64 / s.mlp_total.max(1) as f64,
            s.heads_kept as f64 / s.heads_total.max(1) as f64,
            s.exact_logits
        );
        if s.input_groups_whole > 0 {
            eprintln!(
                "input groups read whole: {} of {} (sparsity 0, or sparse products expected slower \
                 than dense on this device; `:always` runs them sparse)",
                s.input_groups_whole, s.input_groups
            );
        }
    }
    if let Some(sp) = stats.speculation {
        eprintln!(
            "speculation: {} dense passes, {:.2} tokens each | drafts kept: {} of {} ({:.0}%)",
            sp.dense_passes,
            sp.tokens_per_pass(),
            sp.accepted,
            sp.drafted,
            100.0 * sp.acceptance()
        );
    }
    if stats.stop == Stop::ContextFull {
        eprintln!(
            "stopped early: the context window of {} tokens is full (raise --ctx)",
            engine.n_ctx
        );
    }
    let on = match a.model.backend {
        BackendKind::Cpu => format!("{} threads", engine.threads()),
        BackendKind::Cuda => "cuda".into(),
    };
    eprintln!(
        "prompt: {} tokens, {:.1} tok/s | decode: {} tokens, {:.1} tok/s | {on}",
        stats.prompt_tokens,
        stats.prompt_tok_per_s(),
        stats.generated_tokens,
        stats.decode_tok_per_s(),
    );
    Ok(())
}

/// A `generate` callback that prints each piece of text as it arrives. A write that fails (a
/// closed pipe) sets `closed`, which the generation's stop rules read as a cancel: no tokens
/// are generated for a reader that is gone. The final `writeln!` reports the error.
fn stream_to<'a>(
    out: &'a mut std::io::StdoutLock<'static>,
    closed: &'a AtomicBool,
) -> impl FnMut(&str) + 'a {
    |s| {
        if out
            .write_all(s.as_bytes())
            .and_then(|_| out.flush())
            .is_err()
        {
            closed.store(true, std::sync::atomic::Ordering::Relaxed);
        }
    }
}

fn cmd_perplexity(a: PerplexityArgs) -> Result<()> {
    // Read what --chunks of --ctx tokens can use (64 bytes a token is far more than any
    // tokenizer takes), and never more than MAX_TEXT_BYTES.
    let need = (a.chunks)
        .map(|c| (c as u64).saturating_mul(a.ctx as u64).saturating_mul(64))
        .unwrap_or(u64::MAX);
    let cap = dejavu::fsio::MAX_TEXT_BYTES;
    let text = dejavu::fsio::read_text(&a.file, need.min(cap), need < cap)?;
    let engine = a.model.load(Some(a.ctx))?;
    refuse_overwrites(
        &[("--json", a.json.as_deref())],
        &[&engine.model.path, &a.file],
    )?;
    let mut tokens = engine.tokenizer.encode_document(&text)?;
    if let Some(c) = a.chunks {
        tokens.truncate(c.saturating_mul(a.ctx));
    }
    let policy = a.sparsity.policy(&engine)?;
    let n_chunks = tokens.len() / a.ctx;
    eprintln!("{} tokens, {n_chunks} chunks of {}", tokens.len(), a.ctx);
    let bar = dejavu::progress::bar(n_chunks as u64, "chunks");
    let t0 = std::time::Instant::now();
    let at = a.model.placement();
    // A sparse policy against dense, side by side on one device (a tensor-parallel world runs
    // the policy alone, below).
    if !policy.is_dense() && at.tensor_parallel == 1 {
        let r = with_sessions(&engine, at, true, |on| {
            let r = dejavu::eval::perplexity::compare(
                &engine,
                on,
                &tokens,
                a.ctx,
                &policy,
                |i, _, d, s| {
                    bar.set_position(i as u64);
                    bar.set_message(format!("ppl dense {d:.4} sparse {s:.4}"));
                },
            )?;
            Ok(r)
        })?;
        bar.finish_and_clear();
        eprintln!(
            "{} chunks, {} scored tokens, {:.1} s",
            r.dense.n_chunks,
            r.dense.n_scored,
            t0.elapsed().as_secs_f64()
        );
        println!("sparsity: {}", policy.name);
        println!("ppl dense (decode path): {:.4}", r.dense.ppl);
        println!(
            "ppl sparse: {:.4} ({:+.2}%)",
            r.sparse.ppl,
            (r.sparse.ppl / r.dense.ppl - 1.0) * 100.0
        );
        println!("kl(dense || sparse): {:.5} nats/token", r.kl);
        println!("top-1 agreement: {:.2}%", r.top1_agreement * 100.0);
        println!(
            "decode speedup over dense (scored steps, interleaved): {:.2}x",
            r.speedup()
        );
        println!(
            "weights read: {:.2} MB/token ({:.1}% of dense {:.2}) | MLP density {:.3} | head density {:.3} | exact logits {:.0}",
            r.steps.mean_bytes() / 1e6,
            r.steps.mean_bytes() / engine.model.dense_bytes_per_token() as f64 * 100.0,
            engine.model.dense_bytes_per_token() as f64 / 1e6,
            r.steps.mlp_density(),
            r.steps.head_density(),
            r.steps.mean_exact_logits()
        );
        if let Some(p) = &a.json {
            let dense_bytes = engine.model.dense_bytes_per_token() as f64;
            let v = serde_json::json!({
                "model": engine.model.label(),
                "sparsity": policy.name,
                "ctx": a.ctx,
                "n_scored": r.sparse.n_scored,
                "ppl": r.sparse.ppl,
                "dense_ppl": r.dense.ppl,
                "ppl_ratio": r.sparse.ppl / r.dense.ppl,
                "kl": r.kl,
                "top1_agreement": r.top1_agreement,
                "mlp_density": r.steps.mlp_density(),
                "head_density": r.steps.head_density(),
                "weight_bytes_per_token": r.steps.mean_bytes(),
                "dense_weight_bytes_per_token": dense_bytes,
                "speedup_vs_dense": r.speedup(),
            });
            write_json(p, &v)?;
        }
        // The contract of every perplexity run: the last line is `ppl: <value>`, here the
        // policy's.
        println!("ppl: {:.4}", r.sparse.ppl);
        return Ok(());
    }
    // A world of GPUs gathers only the last row's logits: token by token.
    let feed = match a.token_by_token || at.tensor_parallel > 1 {
        true => Feed::TokenByToken,
        false => Feed::Batch,
    };
    // Each chunk's running perplexity on its own line, as llama-perplexity prints `[i]ppl`.
    let r = with_decoder(&engine, at, &policy, |dec| {
        Ok(perplexity(
            &engine,
            dec,
            &tokens,
            a.ctx,
            feed,
            |i, n, ppl| {
                let line = format!("[{i}/{n}] ppl {ppl:.4}");
                match bar.is_hidden() {
                    true => eprintln!("{line}"),
                    false => bar.println(line),
                }
                bar.set_position(i as u64);
                bar.set_message(format!("ppl {ppl:.4}"));
            },
        )?)
    })?;
    bar.finish_and_clear();
    eprintln!(
        "{} chunks, {} scored tokens, {:.1} s ({:.0} tok/s); final estimate: PPL = {:.4} +/- {:.4}",
        r.n_chunks,
        r.n_scored,
        t0.elapsed().as_secs_f64(),
        (r.n_chunks * a.ctx) as f64 / t0.elapsed().as_secs_f64(),
        r.ppl,
        r.ppl_err
    );
    if let Some(p) = &a.json {
        let mut v = serde_json::json!({
            "model": engine.model.label(),
            "sparsity": policy.name,
            "ctx": a.ctx,
            "n_scored": r.n_scored,
            "ppl": r.ppl,
        });
        if policy.is_dense() {
            v["dense_ppl"] = r.ppl.into();
            v["weight_bytes_per_token"] = engine.model.dense_bytes_per_token().into();
        }
        write_json(p, &v)?;
    }
    println!("ppl: {:.4}", r.ppl);
    Ok(())
}

/// Refuse, before any work, an output (flag, path) that would replace one of `inputs` (a model
/// file or checkpoint directory, a text): outputs are renamed into place, which would lose it.
pub(crate) fn refuse_overwrites(
    outputs: &[(&str, Option<&std::path::Path>)],
    inputs: &[&std::path::Path],
) -> Result<()> {
    for (flag, out) in outputs {
        let Some(out) = out else { continue };
        for input in inputs {
            dejavu::fsio::refuse_overwrite(flag, out, input)?;
        }
    }
    Ok(())
}

fn write_json(path: &std::path::Path, v: &serde_json::Value) -> Result<()> {
    dejavu::fsio::write(path, serde_json::to_string_pretty(v)?)
        .with_context(|| format!("writing {}", path.display()))
}
