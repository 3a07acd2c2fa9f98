//! `dejavu quantize`: any loadable model to a GGUF of one weight type, with an optional
//! perplexity check of the result against its source.
use anyhow::{Context, Result};
use clap::Args;
use dejavu::eval::perplexity::{perplexity, Feed};
use dejavu::exec::{Engine, EngineOptions};
use dejavu::model::tokenizer::Tokenizer;
use dejavu::model::weights::Model;
use dejavu::sparsity::policy::Policy;
use dejavu_backend_api::QuantType;
use std::path::{Path, PathBuf};

#[derive(Args)]
pub struct QuantizeArgs {
    /// A Hugging Face checkpoint directory or a GGUF file.
    input: PathBuf,
    /// Weight type: q8_0, q4_0, q4_1, q5_0, f16 (or f32). (`-t` is the thread count, as in
    /// every other command.)
    #[arg(long = "type")]
    qtype: String,
    /// Threads of the `--ppl` check (default: all cores).
    #[arg(long, short)]
    threads: Option<usize>,
    /// Output GGUF file.
    #[arg(long, short)]
    out: PathBuf,
    /// After writing, compare the perplexity of the source and the output on this text.
    #[arg(long)]
    ppl: Option<PathBuf>,
    /// Context (chunk size) of the perplexity check.
    #[arg(long, default_value_t = 512)]
    ctx: usize,
}

pub fn cmd_quantize(a: QuantizeArgs) -> Result<()> {
    let qtype = QuantType::from_name(&a.qtype.to_uppercase())
        .filter(|q| dejavu::quantize::TARGETS.contains(q))
        .with_context(|| {
            format!(
                "--type {}: expected q8_0, q4_0, q4_1, q5_0, f16 or f32",
                a.qtype
            )
        })?;
    // Before any work (the library refuses it again for its other callers).
    crate::refuse_overwrites(&[("--out", Some(&a.out))], &[&a.input])?;
    let load = || -> Result<(Model, Tokenizer)> {
        let m = Model::load(&a.input)?;
        let t = Tokenizer::from_model(&m)?;
        Ok((m, t))
    };
    let (model, tokenizer) = load().with_context(|| format!("loading {}", a.input.display()))?;
    let backend = dejavu_backend_cpu::CpuBackend::new(1)?;
    let t0 = std::time::Instant::now();
    let s = dejavu::quantize::quantize(&model, &tokenizer, &backend, qtype, &a.out)?;
    eprintln!(
        "wrote {} ({} tensors, {:.1} MB, {}) in {:.1} s",
        a.out.display(),
        s.tensors,
        s.bytes as f64 / 1e6,
        qtype.name(),
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
            qtype.name(),
            (out / src - 1.0) * 100.0
        );
        println!("ppl: {out:.4}");
    }
    Ok(())
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
