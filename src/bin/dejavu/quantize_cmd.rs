//! `dejavu quantize`: any loadable model to a GGUF of one of llama.cpp's file types (its
//! per-tensor mixes), with an optional importance matrix from a calibration text and an optional
//! perplexity check of the result against its source.
use anyhow::{Context, Result};
use clap::Args;
use dejavu::eval::perplexity::{perplexity, Feed};
use dejavu::exec::{Engine, EngineOptions};
use dejavu::model::tokenizer::Tokenizer;
use dejavu::model::weights::Model;
use dejavu::quantize::{FileType, Imatrix, Options};
use dejavu::sparsity::policy::Policy;
use dejavu_backend_api::quantize::Rounding;
use std::path::{Path, PathBuf};

#[derive(Args)]
pub struct QuantizeArgs {
    /// A Hugging Face checkpoint directory or a GGUF file.
    input: PathBuf,
    /// File type, as llama-quantize names them: q4_k_m, q5_k_m, q6_k, q8_0, q3_k_m, q2_k,
    /// iq4_xs, q4_0, f16, ... (the README lists them and their per-tensor rules). (`-t` is the
    /// thread count, as in every other command.)
    #[arg(long = "type")]
    qtype: String,
    /// Every matrix in the file type's base type (llama-quantize's --pure).
    #[arg(long)]
    pure: bool,
    /// Weight the rounding by an importance matrix computed from this calibration text
    /// (llama-imatrix's method: mean squared input of every matrix column over chunks of --ctx
    /// tokens).
    #[arg(long)]
    imatrix: Option<PathBuf>,
    /// Round the 32-wide types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, and the K-quant mixes' fallbacks)
    /// to the scale of least squared error instead of ggml's max scaling, where no importance
    /// matrix weights them (lower error; the file is then not llama-quantize's bytes).
    #[arg(long)]
    search_scales: bool,
    /// At most this many chunks of the --imatrix text.
    #[arg(long)]
    chunks: Option<usize>,
    /// Threads of the `--ppl` check (default: all cores).
    #[arg(long, short)]
    threads: Option<usize>,
    /// Output GGUF file.
    #[arg(long, short)]
    out: PathBuf,
    /// After writing, compare the perplexity of the source and the output on this text.
    #[arg(long)]
    ppl: Option<PathBuf>,
    /// Context (chunk size) of the importance matrix and of the perplexity check.
    #[arg(long, default_value_t = 512)]
    ctx: usize,
}

pub fn cmd_quantize(a: QuantizeArgs) -> Result<()> {
    let ftype = FileType::parse(&a.qtype)
        .with_context(|| format!("--type {}: expected one of {}", a.qtype, FileType::names()))?;
    // Before any work (the library refuses both again for its other callers).
    crate::refuse_overwrites(&[("--out", Some(&a.out))], &[&a.input])?;
    dejavu::fsio::refuse_unwritable("--out", &a.out)?;
    if ftype.needs_imatrix() && a.imatrix.is_none() {
        return Err(dejavu::quantize::needs_imatrix(ftype).into());
    }
    let load = || -> Result<(Model, Tokenizer)> {
        let m = Model::load(&a.input)?;
        let t = Tokenizer::from_model(&m)?;
        Ok((m, t))
    };
    let (model, tokenizer) = load().with_context(|| format!("loading {}", a.input.display()))?;
    // The scalar reference dequantizes the source (plain `d * q + m`, as ggml's dequantizers),
    // so a requantized file is llama-quantize's to the bit.
    let backend = dejavu_backend_cpu::CpuBackend::f32_reference(1);
    let imatrix = match &a.imatrix {
        Some(path) => Some(importance(&a, path)?),
        None => None,
    };
    let opts = Options {
        ftype,
        pure: a.pure,
        imatrix,
        rounding: match a.search_scales {
            true => Rounding::Search,
            false => Rounding::Ggml,
        },
    };
    let t0 = std::time::Instant::now();
    let s = dejavu::quantize::quantize(&model, &tokenizer, &backend, &opts, &a.out)?;
    eprintln!(
        "wrote {} ({} tensors, {:.1} MB, {}) in {:.1} s",
        a.out.display(),
        s.tensors,
        s.bytes as f64 / 1e6,
        ftype.name(),
        t0.elapsed().as_secs_f64()
    );
    drop(model);
    if let Some(text) = &a.ppl {
        let text = dejavu::fsio::read_text(text.as_ref(), dejavu::fsio::MAX_TEXT_BYTES, false)?;
        let src = ppl_of(&a.input, &text, a.ctx, a.threads)?;
        let out = ppl_of(&a.out, &text, a.ctx, a.threads)?;
        println!("ppl source: {src:.4}");
        println!(
            "ppl {}: {out:.4} ({:+.2}%)",
            ftype.name(),
            (out / src - 1.0) * 100.0
        );
        println!("ppl: {out:.4}");
    }
    Ok(())
}

/// The importance matrix of the source over the calibration text at `path`.
fn importance(a: &QuantizeArgs, path: &Path) -> Result<Imatrix> {
    let text = dejavu::fsio::read_text(path, dejavu::fsio::MAX_TEXT_BYTES, false)?;
    let opts = EngineOptions {
        n_ctx: Some(a.ctx),
        threads: a.threads,
        ..Default::default()
    };
    let engine =
        Engine::load(&a.input, &opts).with_context(|| format!("loading {}", a.input.display()))?;
    let tokens = engine.tokenizer.encode_document(&text)?;
    let m = Imatrix::collect(&engine, &tokens, a.ctx, a.chunks)?;
    eprintln!(
        "importance matrix: {} chunks of {} tokens ({} tokens) from {}",
        m.chunks,
        a.ctx,
        m.tokens,
        path.display()
    );
    Ok(m)
}

/// Perplexity of `text` under the model at `path` (batched, llama.cpp's method).
fn ppl_of(path: &Path, text: &str, ctx: usize, threads: Option<usize>) -> Result<f64> {
    let opts = EngineOptions {
        n_ctx: Some(ctx),
        threads,
        ..Default::default()
    };
    let engine =
        Engine::load(path, &opts).with_context(|| format!("loading {}", path.display()))?;
    let tokens = engine.tokenizer.encode_document(text)?;
    let mut dense = engine.decoder(&Policy::dense(&engine.model.config))?;
    let bar = dejavu::progress::bar(
        (tokens.len() / ctx) as u64,
        &format!("ppl {}", path.display()),
    );
    let r = perplexity(&engine, &mut dense, &tokens, ctx, Feed::Batch, |i, _, _| {
        bar.set_position(i as u64)
    })?;
    bar.finish_and_clear();
    Ok(r.ppl)
}
