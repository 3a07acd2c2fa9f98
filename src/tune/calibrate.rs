//! `dejavu calibrate`: fit the predictors on text with the engine itself (no PyTorch), then search
//! for the recommended setting.
//!
//! 1. The calibration tokens are split: the last `validation_tokens` are held out. Validation
//!    also scores texts training never saw ([`HeldOut`]): the CLI holds one source of a
//!    calibration text of several out of training whole ([`held_out_source`]; of the default
//!    corpus, its smallest kind) and adds the user's `--validation-file`s.
//! 2. Statistics: the second moment Sigma of the final normed hidden states (the output head's
//!    input) over the training part, from dense batched forward passes.
//! 3. The output preview (see [`crate::sparsity::predictors_file`]): with Sigma = L L (L its symmetric square
//!    root, small eigenvalues floored), the top `rank` eigenvectors V of `L E^T E L` (the right
//!    singular vectors of E L) give `proj = V^T L^-1` and `table = E L V`.
//! 4. The search: candidate policies (output head alone, then MLP rules with the chosen head, then
//!    query-head rules on top of the best so far) are
//!    scored on the held-out tokens against dense decoding, token by token with dense and sparse
//!    steps interleaved (so both see the same machine conditions); the recommended setting is
//!    the fastest (measured decode speedup) whose perplexity stays within `max_ppl_increase`
//!    less its `margin` of dense, either way (a lower perplexity from a perturbation is not
//!    quality), that agrees with dense on the next token at least `min_top1_agreement` of the
//!    time, both on every validation text, and is measured 1.05x dense or faster; if none is, it is
//!    `dense` ([`Candidate::fits`]). Input sparsity (`teal`, `wina` at 10-50%)
//!    is searched with the MLP rules when the thresholds were calibrated (always, from now).
use crate::exec::Logits;
use crate::exec::{Engine, Sessions};
use crate::sparsity::policy::Policy;
use crate::sparsity::predictor::{HeadPredictor, Labels, MlpPredictor, TrainOptions};
use crate::sparsity::predictors_file::{OutputPreview, Predictors};
use crate::{Error, Result};
use nalgebra::{DMatrix, SymmetricEigen};
use std::collections::HashMap;

pub use super::corpus::*;
pub use super::search::{Candidate, MIN_SPEEDUP};

#[derive(Debug, Clone)]
pub struct CalibrateOptions {
    /// Tokens per forward pass when collecting statistics, and per validation chunk.
    pub ctx: usize,
    /// Rank of the stored output preview (a multiple of 32; smaller ranks are its prefixes).
    pub rank: usize,
    /// Held-out tokens for the search (whole chunks of `ctx`).
    pub validation_tokens: usize,
    /// Largest perplexity increase over dense the recommended setting may cost (0.03 = 3%).
    pub max_ppl_increase: f64,
    /// Smallest top-1 agreement with dense the recommended setting must keep (0.9 = 90%).
    pub min_top1_agreement: f64,
    /// The share of `max_ppl_increase` held back: the recommended setting stays within the rest
    /// on every validation text (0.25: +2.25% of a 3% budget).
    pub margin: f64,
    /// Skip the search (predictors only).
    pub no_search: bool,
    /// Tokens to train the Deja Vu MLP and head predictors on (0: none).
    pub mlp_tokens: usize,
    /// Their settings.
    pub mlp: TrainOptions,
    pub heads: TrainOptions,
}

impl Default for CalibrateOptions {
    fn default() -> Self {
        Self {
            ctx: 512,
            rank: 128,
            validation_tokens: 2048,
            max_ppl_increase: 0.03,
            min_top1_agreement: 0.9,
            margin: 0.25,
            no_search: false,
            mlp_tokens: 3072,
            mlp: TrainOptions::default(),
            heads: TrainOptions {
                rank: 32,
                label_keep: 0.5,
                epochs: 16,
                ..TrainOptions::default()
            },
        }
    }
}

/// Calibrate on `tokens`, validating on their held-out tail and on each of `held_out` (up to
/// `validation_tokens` of each); `log` receives one line per step.
pub fn calibrate(
    engine: &Engine,
    on: &dyn Sessions,
    tokens: &[u32],
    sources: &str,
    held_out: &[HeldOut],
    opts: &CalibrateOptions,
    mut log: impl FnMut(&str),
) -> Result<(Predictors, Vec<Candidate>)> {
    engine.require_real_weights("calibration")?;
    let c = &engine.model.config;
    if opts.ctx < 4 {
        return Err(Error::Invalid(format!(
            "--ctx {} is too small (at least 4)",
            opts.ctx
        )));
    }
    let ctx = opts.ctx.min(on.n_ctx());
    let n_val = if opts.no_search {
        0
    } else {
        (opts.validation_tokens / ctx).max(1) * ctx
    };
    if tokens.len() < n_val + ctx {
        return Err(Error::Invalid(format!(
            "calibration text has {} tokens; need at least {} ({} held out + one chunk of {ctx})",
            tokens.len(),
            n_val + ctx,
            n_val
        )));
    }
    let (train, val) = tokens.split_at(tokens.len() - n_val);
    log(&format!(
        "{} tokens: {} for statistics, {} held out for the search",
        tokens.len(),
        train.len(),
        val.len()
    ));
    let sigma = hidden_moment(engine, on, train, ctx)?;
    let rank = opts.rank.min(c.d_embed / 32 * 32);
    let preview = output_preview(engine, &sigma, rank)?;
    log(&format!(
        "output preview: rank {rank}, {:.1} MB ({:.1}% of the output head)",
        preview.bytes() as f64 / 1e6,
        preview.bytes() as f64 / engine.model.output.n_bytes() as f64 * 100.0
    ));
    let mut metadata = HashMap::from([
        ("calibration_tokens".to_string(), train.len().to_string()),
        ("validation_tokens".to_string(), val.len().to_string()),
        ("sources".to_string(), sources.to_string()),
    ]);
    let (mut mlp, mut heads) = (Vec::new(), Vec::new());
    if opts.mlp_tokens > 0 {
        let t = train_predictors(
            engine,
            on,
            &train[..opts.mlp_tokens.min(train.len())],
            ctx,
            &opts.mlp,
            &opts.heads,
        )?;
        let relu = c.mlp.activation() == dejavu_backend_api::Activation::Relu;
        let list = |v: &mut dyn Iterator<Item = String>| v.collect::<Vec<_>>().join(" ");
        let mlp_ranks = list(&mut t.mlp.iter().map(|p| p.rank.to_string()));
        // The ranks the predictors were trained at (an option may ask for more than fits).
        let head_ranks = list(&mut t.heads.iter().map(|p| p.rank.to_string()));
        let densities = list(&mut t.mlp_density.iter().map(|x| format!("{x:.3}")));
        log(&format!(
            "MLP density per layer (nonzero activations): {densities}"
        ));
        for (what, labels, ranks, recall, key) in [
            (
                "MLP",
                match relu {
                    true => "the nonzero neurons".to_string(),
                    false => format!("the top {:.0}%", opts.mlp.label_keep * 100.0),
                },
                mlp_ranks,
                &t.mlp_recall,
                "mlp_recall",
            ),
            (
                "head",
                format!("the top {:.0}%", opts.heads.label_keep * 100.0),
                head_ranks,
                &t.head_recall,
                "head_recall",
            ),
        ] {
            let mean = recall.iter().sum::<f64>() / recall.len().max(1) as f64;
            let per_layer: Vec<String> = recall.iter().map(|r| format!("{r:.2}")).collect();
            log(&format!(
                "{what} predictors: rank {ranks}; held-out recall of {labels}: mean {mean:.3}, per layer {}",
                per_layer.join(" ")
            ));
            let stored: Vec<String> = recall.iter().map(|r| format!("{r:.4}")).collect();
            metadata.insert(key.into(), stored.join(","));
        }
        let stored: Vec<String> = t.mlp_density.iter().map(|r| format!("{r:.4}")).collect();
        metadata.insert("mlp_density".into(), stored.join(","));
        (mlp, heads) = (t.mlp, t.heads);
    }
    // Input sparsity's thresholds (teal, wina): quantiles of every layer's inputs.
    let mut inputs = crate::tune::thresholds::input_stats(engine, on, train, ctx)?;
    log(&format!(
        "input thresholds (teal, wina): {} layers x 4 inputs, on {} tokens",
        inputs.n_layers,
        train.len().min(crate::tune::thresholds::MAX_TOKENS)
    ));
    let t0 = std::time::Instant::now();
    inputs.alloc = crate::tune::allocation::greedy(on, &inputs, train, ctx)?;
    if let Some(last) = inputs.alloc.last() {
        log(&format!(
            "teal allocation ({:.0} s): at {:.0}% model-wide, Q/K/V {:.0}%, W_o {:.0}%, gate/up {:.0}%, down {:.0}%",
            t0.elapsed().as_secs_f64(),
            last[0] * 100.0,
            last[1] * 100.0,
            last[2] * 100.0,
            last[3] * 100.0,
            last[4] * 100.0
        ));
    }
    let mut preds = Predictors {
        path: None,
        metadata: metadata.clone(),
        output: Some(std::sync::Arc::new(preview)),
        mlp: mlp.into(),
        heads: heads.into(),
        inputs: Some(std::sync::Arc::new(inputs)),
    };
    let mut tried = Vec::new();
    if !opts.no_search {
        let rec;
        let mut texts = vec![(
            format!(
                "the held-out tail of the calibration text ({} tokens)",
                val.len()
            ),
            val,
        )];
        for h in held_out {
            let n = (n_val.min(h.tokens.len()) / ctx) * ctx;
            match n {
                0 => log(&format!(
                    "{}: {} tokens, less than one chunk of {ctx}: not validated on",
                    h.name,
                    h.tokens.len()
                )),
                n => texts.push((format!("{} ({n} tokens)", h.name), &h.tokens[..n])),
            }
        }
        (rec, tried) = super::search::search(engine, on, &preds, &texts, ctx, opts, &mut log)?;
        let names: Vec<&str> = texts.iter().map(|t| t.0.as_str()).collect();
        metadata.insert("validated_on".into(), names.join("; "));
        metadata.insert("recommended".into(), rec);
        metadata.insert(
            "max_ppl_increase".into(),
            format!("{}", opts.max_ppl_increase),
        );
        preds.metadata = metadata;
    }
    Ok((preds, tried))
}

/// The ranks a ReLU model's MLP predictors are tried at: half, once and twice `rank`, multiples
/// of 32 below `d`.
fn relu_ranks(rank: usize, d: usize) -> Vec<usize> {
    let mut v: Vec<usize> = [rank / 2, rank, 2 * rank]
        .into_iter()
        .map(|r| r / 32 * 32)
        .filter(|&r| r >= 32 && r < d)
        .collect();
    v.dedup();
    if v.is_empty() {
        v.push(rank);
    }
    v
}

/// Trained predictors with their held-out recalls, per layer.
pub struct Trained {
    pub mlp: Vec<MlpPredictor>,
    pub mlp_recall: Vec<f64>,
    /// Fraction of MLP activations that are nonzero (ReLU models: the layer's true density).
    pub mlp_density: Vec<f64>,
    pub heads: Vec<HeadPredictor>,
    pub head_recall: Vec<f64>,
}

/// Train one [`MlpPredictor`] and one [`HeadPredictor`] per layer on `tokens` (dense forward
/// passes in chunks of `ctx`, capturing each layer's inputs). Inputs are the lookahead ones:
/// MLP predictor `l` reads layer `l`'s attention input; head predictor `l` reads layer `l - 1`'s
/// (layer 0: its own) and is labelled by the norms of layer `l`'s head outputs.
pub fn train_predictors(
    engine: &Engine,
    on: &dyn Sessions,
    tokens: &[u32],
    ctx: usize,
    mlp_opts: &TrainOptions,
    head_opts: &TrainOptions,
) -> Result<Trained> {
    let m = &engine.model;
    let c = &m.config;
    let (d, ff) = (c.d_model, c.n_ff);
    let (mut session, cap) = captured(on, c, tokens, ctx, "activations for the predictors")?;
    let bar = crate::progress::bar(c.n_layers as u64, "MLP and head predictors");
    let mut t = Trained {
        mlp: Vec::new(),
        mlp_recall: Vec::new(),
        mlp_density: Vec::new(),
        heads: Vec::new(),
        head_recall: Vec::new(),
    };
    // ReLU models: the paper's labels (the nonzero neurons), and the rank chosen by measurement.
    let relu = c.mlp.activation() == dejavu_backend_api::Activation::Relu;
    let ranks = match relu {
        true => relu_ranks(mlp_opts.rank, d),
        false => vec![mlp_opts.rank],
    };
    for l in 0..c.n_layers {
        let (x, h) = (&cap.attn_in[l], &cap.mlp_in[l]);
        let act = session.mlp_activations(l, h)?;
        let nonzero = act.iter().filter(|&&a| a > 0.0).count();
        t.mlp_density.push(nonzero as f64 / act.len().max(1) as f64);
        let mut o = mlp_opts.clone();
        if relu {
            o.labels = Labels::Positive;
        }
        // The smallest rank within 0.01 of the best held-out recall (rank costs bandwidth).
        let mut fits = Vec::new();
        for &rank in &ranks {
            o.rank = rank;
            fits.push(MlpPredictor::train(x, &act, d, ff, &o)?);
        }
        let best = fits.iter().map(|f| f.1).fold(0f64, f64::max);
        let (p, r) = (fits.into_iter())
            .find(|f| f.1 >= best - 0.01)
            .expect("at least one rank");
        t.mlp.push(p);
        t.mlp_recall.push(r);
        let prev = &cap.attn_in[l.saturating_sub(1)];
        let (p, r) = HeadPredictor::train(prev, &cap.head_norm[l], d, c.n_heads, head_opts)?;
        t.heads.push(p);
        t.head_recall.push(r);
        bar.inc(1);
    }
    bar.finish_and_clear();
    Ok(t)
}

/// A dense session of `on` that ran `tokens` in passes of `ctx` (chunks of at least 2 tokens)
/// under capture, and what it captured (every layer's block inputs and attention outputs).
pub(crate) fn captured<'a>(
    on: &'a dyn Sessions,
    c: &crate::model::config::ModelConfig,
    tokens: &[u32],
    ctx: usize,
    what: &str,
) -> Result<(Box<dyn crate::exec::Decoder + 'a>, crate::exec::Capture)> {
    let mut session = on.open(&Policy::dense(c))?;
    session.capture(true)?;
    let chunks: Vec<&[u32]> = tokens
        .chunks(ctx.max(2))
        .filter(|ch| ch.len() >= 2)
        .collect();
    let bar = crate::progress::bar(chunks.len() as u64, what);
    for chunk in chunks {
        session.truncate(0);
        let n = chunk.len();
        session.run(chunk, Logits::Hidden(n - 1, n))?;
        bar.inc(1);
    }
    bar.finish_and_clear();
    let cap = session.take_capture();
    Ok((session, cap))
}

/// Sigma = mean over tokens of h h^T, h the final normed hidden state (f64, d x d).
fn hidden_moment(
    engine: &Engine,
    on: &dyn Sessions,
    tokens: &[u32],
    ctx: usize,
) -> Result<DMatrix<f64>> {
    // The output head's input: d_embed wide (d_model unless OPT projects it).
    let d = engine.model.config.d_embed;
    let mut session = on.open(&Policy::dense(&engine.model.config))?;
    let mut sigma = DMatrix::<f64>::zeros(d, d);
    let chunks: Vec<&[u32]> = tokens.chunks(ctx).filter(|c| c.len() >= 2).collect();
    let bar = crate::progress::bar(chunks.len() as u64, "hidden-state statistics");
    let mut n = 0usize;
    for chunk in &chunks {
        session.truncate(0);
        let h = session.run(chunk, Logits::Hidden(0, chunk.len()))?;
        let hm = DMatrix::<f32>::from_row_slice(chunk.len(), d, h);
        let m = hm.transpose() * &hm;
        sigma += m.map(|v| v as f64);
        n += chunk.len();
        bar.inc(1);
    }
    bar.finish_and_clear();
    Ok(sigma / n.max(1) as f64)
}

/// The activation-weighted rank-`rank` preview of the output matrix (see the module docs).
pub fn output_preview(engine: &Engine, sigma: &DMatrix<f64>, rank: usize) -> Result<OutputPreview> {
    let m = &engine.model;
    let (d, vocab) = (m.config.d_embed, m.config.vocab_size);
    let e = m.weight(&m.output);
    let b = engine.backend();
    const ROWS: usize = 4096;
    let bar = crate::progress::bar(2 * vocab.div_ceil(ROWS) as u64, "output preview");
    // Rows r0..r1 of E, dequantized.
    let rows = |r0: usize, r1: usize| {
        let mut buf = vec![0f32; (r1 - r0) * d];
        for (i, out) in buf.chunks_exact_mut(d).enumerate() {
            b.dequantize_row(&e, r0 + i, out);
        }
        DMatrix::<f32>::from_row_slice(r1 - r0, d, &buf)
    };
    let mut g = DMatrix::<f64>::zeros(d, d);
    for r0 in (0..vocab).step_by(ROWS) {
        let chunk = rows(r0, (r0 + ROWS).min(vocab));
        g += (chunk.transpose() * &chunk).map(|v| v as f64);
        bar.inc(1);
    }
    let eig = SymmetricEigen::new(sigma.clone());
    let floor = eig.eigenvalues.max() * 1e-6;
    let q = &eig.eigenvectors;
    let sqrt = |p: f64| {
        let diag = eig.eigenvalues.map(|l| l.max(floor).powf(p));
        q * DMatrix::from_diagonal(&diag) * q.transpose()
    };
    let (l, l_inv) = (sqrt(0.5), sqrt(-0.5));
    let inner = SymmetricEigen::new(&l * &g * &l);
    let mut order: Vec<usize> = (0..d).collect();
    order.sort_by(|&i, &j| inner.eigenvalues[j].total_cmp(&inner.eigenvalues[i]));
    let v = DMatrix::from_fn(d, rank, |r, k| inner.eigenvectors[(r, order[k])]);
    let proj = (v.transpose() * &l_inv).map(|x| x as f32);
    let w = (&l * &v).map(|x| x as f32);
    let mut table = Vec::with_capacity(vocab * rank);
    for r0 in (0..vocab).step_by(ROWS) {
        let t = rows(r0, (r0 + ROWS).min(vocab)) * &w;
        for i in 0..t.nrows() {
            table.extend(t.row(i).iter());
        }
        bar.inc(1);
    }
    bar.finish_and_clear();
    // Row-major r x d.
    let proj_rows: Vec<f32> = (0..rank)
        .flat_map(|k| proj.row(k).iter().copied().collect::<Vec<_>>())
        .collect();
    OutputPreview::new(rank, d, proj_rows, &table)
}
