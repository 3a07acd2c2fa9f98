//! The `calibrate` and `report` subcommands (sparsity tooling), kept apart from the inference
//! commands in `main.rs`.
use crate::backend_choice::with_sessions;
use crate::ModelArgs;
use anyhow::{Context, Result};
use clap::Args;

#[derive(Args)]
pub struct CalibrateArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Calibration text files (documents separated by lines holding only ASCII RS, 0x1e).
    /// Default: source code, package documentation and library reference text installed on this
    /// machine (tools/calibration_text.py), plus text sampled from the model.
    #[arg(long, num_args = 1..)]
    pub data: Vec<std::path::PathBuf>,
    /// Where to write the predictors (default: the cache directory, `$DEJAVU_HOME/predictors`,
    /// where `--sparsity recommended` looks).
    #[arg(long)]
    pub out: Option<std::path::PathBuf>,
    /// Tokens of text to sample from the model with varied prompts and add to the data.
    #[arg(long, default_value_t = 8192)]
    pub sample_tokens: usize,
    /// Characters of the default corpus.
    #[arg(long, default_value_t = 120_000)]
    pub corpus_chars: usize,
    /// Rank of the output preview (a multiple of 32).
    #[arg(long, default_value_t = 128)]
    pub rank: usize,
    /// Tokens held out to choose the recommended setting.
    #[arg(long, default_value_t = 2048)]
    pub validation_tokens: usize,
    /// Largest perplexity increase the recommended setting may cost on the held-out tokens.
    #[arg(long, default_value_t = 0.03)]
    pub max_ppl_increase: f64,
    /// Smallest top-1 agreement with dense the recommended setting must keep on them.
    #[arg(long, default_value_t = 0.9)]
    pub min_top1_agreement: f64,
    /// Share of --max-ppl-increase held back: the recommended setting stays within the rest on
    /// every validation text.
    #[arg(long, default_value_t = 0.25)]
    pub margin: f64,
    /// Texts of your own domain to validate the recommended setting on as well (never trained
    /// on). Without them, it is validated on the held-out tail of the calibration text and on
    /// one source of it held out of training whole (with several sources).
    #[arg(long, num_args = 1..)]
    pub validation_file: Vec<std::path::PathBuf>,
    /// Tokens per chunk.
    #[arg(long, default_value_t = 512)]
    pub ctx: usize,
    /// Fit the predictors only; no search for a recommended setting.
    #[arg(long)]
    pub no_search: bool,
    /// Tokens the Deja Vu MLP and head predictors train on (0: do not train them).
    #[arg(long, default_value_t = 3072)]
    pub mlp_tokens: usize,
    /// Rank of the MLP predictors (a multiple of 32).
    #[arg(long, default_value_t = 64)]
    pub mlp_rank: usize,
    /// Seed of the sampling and of the document order.
    #[arg(long, default_value_t = 7)]
    pub seed: u64,
}

#[derive(Args)]
pub struct ReportArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// The text to score (token by token, dense and every policy side by side).
    #[arg(long, short, required_unless_present_any = ["speed", "speed_map"])]
    pub file: Option<std::path::PathBuf>,
    /// Instead: decode speed against density (dense, and for each of `--densities` D
    /// `dejavu:D` on a ReLU model or `teal:1-D` on a gated one; real or synthetic models), as
    /// `<model>.speed.{md,json,png}`.
    #[arg(long)]
    pub speed: bool,
    /// Instead: one map of `--speed` JSONs (model sizes; CPU and GPU runs in two panels), as
    /// `speed-map.{md,png}` in `--out`.
    #[arg(long, num_args = 1.., conflicts_with = "speed")]
    pub speed_map: Vec<std::path::PathBuf>,
    /// Densities of `--speed`.
    #[arg(long, value_delimiter = ',', default_value = "0.5,0.25,0.1,0.05")]
    pub densities: Vec<f64>,
    /// Tokens decoded per repetition of `--speed` (3 repetitions after a warm-up).
    #[arg(long, default_value_t = 16)]
    pub n_gen: usize,
    /// Tokens per chunk.
    #[arg(long, default_value_t = 512)]
    pub ctx: usize,
    /// Score at most this many chunks.
    #[arg(long, default_value_t = 4)]
    pub chunks: usize,
    /// Policies, comma-separated (default: an oracle sweep, the cheap selectors, output heads,
    /// combinations, and `recommended` when the model is calibrated).
    #[arg(long, value_delimiter = ',')]
    pub sparsity: Vec<String>,
    /// Predictors file (default: the `dejavu calibrate` output next to the model).
    #[arg(long)]
    pub predictors: Option<std::path::PathBuf>,
    /// Directory for `<model>.frontier.{md,json,png}` (default: the current directory).
    #[arg(long, default_value = ".")]
    pub out: std::path::PathBuf,
    /// Only redraw the plot from the JSON a previous run wrote in `--out`.
    #[arg(long)]
    pub replot: bool,
}

pub fn cmd_calibrate(a: CalibrateArgs) -> Result<()> {
    use dejavu::tune::calibrate::{self, CalibrateOptions};
    if a.ctx < 4 {
        anyhow::bail!("--ctx {} is too small (at least 4)", a.ctx);
    }
    let engine = a.model.load(None)?;
    let out = a.out.clone().unwrap_or_else(|| {
        dejavu::sparsity::predictors_file::Predictors::default_path(&engine.model)
    });
    let mut inputs: Vec<&std::path::Path> = vec![&engine.model.path];
    inputs.extend(a.data.iter().chain(&a.validation_file).map(|p| p.as_path()));
    crate::refuse_overwrites(&[("--out", Some(&out))], &inputs)?;
    if !(0.0..1.0).contains(&a.margin) {
        anyhow::bail!("--margin {} must be in [0, 1)", a.margin);
    }
    // Documents by source: a --data file, or a kind of the default corpus.
    let mut docs: Vec<(String, String)> = Vec::new();
    let mut sources = Vec::new();
    for f in &a.data {
        let text = dejavu::fsio::read_text(f.as_ref(), dejavu::fsio::MAX_TEXT_BYTES, false)?;
        let name = f.display().to_string();
        docs.extend(
            calibrate::split_documents(&text)
                .into_iter()
                .map(|d| (name.clone(), d)),
        );
        sources.push(name);
    }
    if a.data.is_empty() {
        let corpus = calibrate::default_corpus(a.corpus_chars)?;
        eprintln!("default corpus: {} documents", corpus.len());
        let kind = |d: &str| {
            calibrate::source_kind(d)
                .unwrap_or("default corpus")
                .to_string()
        };
        docs.extend(corpus.into_iter().map(|d| (kind(&d), d)));
        sources.push("tools/calibration_text.py".into());
    }
    // One source held out of training whole, to validate on another domain.
    let held = match a.no_search {
        true => None,
        false => calibrate::held_out_source(&docs, a.validation_tokens),
    };
    let (held_docs, mut train_docs): (Vec<_>, Vec<_>) =
        (docs.into_iter()).partition(|(src, _)| Some(src) == held.as_ref());
    let mut validation = Vec::new();
    for f in &a.validation_file {
        let text = dejavu::fsio::read_text(f.as_ref(), dejavu::fsio::MAX_TEXT_BYTES, false)?;
        validation.push((f.display().to_string(), text));
    }
    let preds = with_sessions(&engine, a.model.placement(), true, |on| {
        eprintln!("calibrating on {}", on.name());
        if a.sample_tokens > 0 {
            let samples = calibrate::sample_texts(&engine, on, a.sample_tokens, a.seed)?;
            train_docs.extend(samples.into_iter().map(|d| (String::new(), d)));
            sources.push(format!("{} tokens sampled from the model", a.sample_tokens));
        }
        let train = train_docs.drain(..).map(|(_, d)| d).collect();
        let tokens = calibrate::tokens_of(&engine, train, a.seed)?;
        let mut held_out = Vec::new();
        if let Some(src) = &held {
            let docs = held_docs.iter().map(|(_, d)| d.clone()).collect();
            held_out.push(calibrate::HeldOut {
                name: format!("{src} (a source held out of training)"),
                tokens: calibrate::tokens_of(&engine, docs, a.seed)?,
            });
        }
        for (name, text) in &validation {
            held_out.push(calibrate::HeldOut {
                name: name.clone(),
                tokens: engine.tokenizer.encode_document(text)?,
            });
        }
        let opts = CalibrateOptions {
            ctx: a.ctx,
            rank: a.rank,
            validation_tokens: a.validation_tokens,
            max_ppl_increase: a.max_ppl_increase,
            min_top1_agreement: a.min_top1_agreement,
            margin: a.margin,
            no_search: a.no_search,
            mlp_tokens: a.mlp_tokens,
            mlp: dejavu::sparsity::predictor::TrainOptions {
                rank: a.mlp_rank,
                ..Default::default()
            },
            ..CalibrateOptions::default()
        };
        let (preds, _) = calibrate::calibrate(
            &engine,
            on,
            &tokens,
            &sources.join("; "),
            &held_out,
            &opts,
            |l| eprintln!("{l}"),
        )?;
        Ok(preds)
    })?;
    preds.save(&out, &engine.model)?;
    println!("{}", out.display());
    if let Some(r) = preds.recommended() {
        println!("recommended: {r}");
        let texts = preds
            .metadata
            .get("validated_on")
            .cloned()
            .unwrap_or_default();
        println!(
            "validated (perplexity within {:.2}% of dense, top-1 agreement {:.0}% or more) on: {texts}",
            a.max_ppl_increase * (1.0 - a.margin) * 100.0,
            a.min_top1_agreement * 100.0
        );
        if held.is_none() && a.validation_file.is_empty() {
            eprintln!(
                "note: the calibration text has one source, so the setting was validated on \
                 its held-out tail only; pass --validation-file with text of your own domain"
            );
        }
    }
    Ok(())
}

pub fn cmd_report(a: ReportArgs) -> Result<()> {
    if a.speed {
        return cmd_speed(&a);
    }
    if !a.speed_map.is_empty() {
        return cmd_speed_map(&a);
    }
    let path = a.file.clone().unwrap_or_default();
    let text = dejavu::fsio::read_text(path.as_ref(), dejavu::fsio::MAX_TEXT_BYTES, false)?;
    let engine = a.model.load(Some(a.ctx))?;
    let name = engine
        .model
        .path
        .file_stem()
        .map_or("model".into(), |s| s.to_string_lossy().into_owned());
    let file = |ext: &str| a.out.join(format!("{name}.frontier.{ext}"));
    let outputs = [file("md"), file("json"), file("png")];
    crate::refuse_overwrites(
        &outputs.each_ref().map(|p| ("--out", Some(p.as_path()))),
        &[&engine.model.path, &path],
    )?;
    let preds = engine.predictors(a.predictors.as_deref())?;
    // Held-out recall per layer of each kind of learned predictor, with its chance level (a
    // random choice of the same budget: the label fraction, or a ReLU layer's mean density).
    let relu = engine.model.config.mlp.activation() == dejavu_backend_api::Activation::Relu;
    let mlp_chance = match (relu, preds.as_ref().and_then(|p| p.mlp_density())) {
        (true, Some(d)) => d.iter().sum::<f64>() / d.len().max(1) as f64,
        _ => 0.3,
    };
    let recall: Vec<dejavu::eval::report::Recall> = [
        ("MLP", "mlp_recall", mlp_chance),
        ("heads", "head_recall", 0.5),
    ]
    .into_iter()
    .filter_map(|(what, key, chance)| {
        let r = preds.as_ref()?.metadata.get(key)?;
        Some(dejavu::eval::report::Recall {
            what: what.into(),
            per_layer: r.split(',').filter_map(|v| v.parse().ok()).collect(),
            chance: (chance * 1000.0).round() / 1000.0,
        })
    })
    .collect();
    if a.replot {
        let json = std::fs::read_to_string(file("json"))
            .with_context(|| format!("reading {}", file("json").display()))?;
        let rows: Vec<dejavu::eval::report::FrontierRow> = serde_json::from_str(&json)?;
        dejavu::eval::report::plot(&rows, &recall, &name, &file("png"))?;
        eprintln!("wrote {}", file("png").display());
        return Ok(());
    }
    let mut tokens = engine.tokenizer.encode_document(&text)?;
    tokens.truncate(a.chunks.saturating_mul(a.ctx));
    let mut specs = a.sparsity.clone();
    let trained = |p: &Option<dejavu::sparsity::predictors_file::Predictors>| {
        p.as_ref().is_some_and(|p| !p.mlp.is_empty())
    };
    if specs.is_empty() && relu {
        // The paper's regime: the exact rules, the predictors at per-layer budgets and fixed K,
        // heads, and the paper's plan.
        specs = ["oracle", "relu-exact"].map(String::from).to_vec();
        if trained(&preds) {
            specs.extend(
                [
                    "dejavu:auto:1",
                    "dejavu:auto:1.5",
                    "dejavu:auto:2",
                    "dejavu:auto:3",
                    "dejavu:0.1",
                    "dejavu:0.2",
                    "dejavu:0.3",
                    "dejavu-attn:0.5",
                    "dejavu-attn:0.8",
                    "dejavu:auto:2+dejavu-attn:0.8",
                    "paper",
                ]
                .map(String::from),
            );
        }
        if preds.as_ref().is_some_and(|p| p.recommended().is_some()) {
            specs.push("recommended".into());
        }
    }
    if specs.is_empty() {
        specs = [
            "oracle:0.8",
            "oracle:0.6",
            "oracle:0.5",
            "oracle:0.4",
            "gate-first:0.8",
            "gate-first:0.7",
            "gate-first:0.6",
            "gate-first:0.5",
            "up-first:0.8",
            "up-first:0.7",
            "up-first:0.6",
        ]
        .map(String::from)
        .to_vec();
        if preds.as_ref().is_some_and(|p| !p.mlp.is_empty()) {
            specs.extend(
                [
                    "dejavu:0.8",
                    "dejavu:0.8+lookahead",
                    "dejavu:0.7",
                    "dejavu:0.5",
                ]
                .map(String::from),
            );
        }
        if preds.as_ref().is_some_and(|p| p.inputs.is_some()) {
            // Input sparsity at model-wide budgets (issue 26): TEAL's and WINA's scores.
            for s in ["0.2", "0.3", "0.4", "0.5"] {
                specs.push(format!("teal:{s}"));
                specs.push(format!("wina:{s}"));
            }
        }
        specs.extend(["attn-norm:0.8", "attn-norm:0.6"].map(String::from));
        if preds.as_ref().is_some_and(|p| !p.heads.is_empty()) {
            specs.extend(["dejavu-attn:0.8", "dejavu-attn:0.8+lookahead"].map(String::from));
        }
        // Output heads the stored preview supports (rank up to its own).
        let rank = preds
            .as_ref()
            .and_then(|p| p.output.as_ref())
            .map_or(0, |o| o.rank);
        let vocab = engine.model.config.vocab_size;
        for (r, c) in [(64, 4096), (128, 4096), (128, 16384)] {
            let (r, c) = (r.min(rank), c.min(vocab / 4));
            if r > 0 && !specs.contains(&format!("head:{r}:{c}")) {
                specs.push(format!("head:{r}:{c}"));
            }
        }
        if rank > 0 {
            let (r, c) = (128.min(rank), 4096.min(vocab / 4));
            specs.push(format!("gate-first:0.8+head:{r}:{c}"));
            specs.push(format!("oracle:0.5+head:{r}:{c}"));
        }
        if preds.as_ref().is_some_and(|p| p.recommended().is_some()) {
            specs.push("recommended".into());
        }
    }
    eprintln!(
        "report: {} policies against dense on {} chunks of {} tokens; each of {} scored tokens is decoded {} times",
        specs.len(),
        tokens.len() / a.ctx.max(1),
        a.ctx,
        dejavu::eval::perplexity::scored_tokens(tokens.len(), a.ctx),
        specs.len() + 1
    );
    let (rows, device) = with_sessions(&engine, a.model.placement(), true, |on| {
        let rows =
            dejavu::eval::report::frontier(&engine, on, &tokens, a.ctx, &specs, preds.as_ref())?;
        Ok((rows, on.name()))
    })?;
    std::fs::create_dir_all(&a.out)?;
    let md = format!(
        "{} | {} | {} chunks of {} tokens of {} | {device} | commit {}\n\n{}",
        name,
        bench_cpu(),
        tokens.len() / a.ctx,
        a.ctx,
        path.display(),
        dejavu::eval::bench::COMMIT,
        dejavu::eval::report::markdown(&rows)
    );
    dejavu::fsio::write(&file("md"), &md)?;
    dejavu::fsio::write(&file("json"), serde_json::to_string_pretty(&rows)?)?;
    print!("{md}");
    let base = file("*");
    match dejavu::eval::report::plot(&rows, &recall, &name, &file("png")) {
        Ok(()) => eprintln!("wrote {} (md, json, png)", base.display()),
        Err(e) => eprintln!("wrote {} (md, json); no plot: {e}", base.display()),
    }
    Ok(())
}

/// `report --speed`: speed against MLP density (see `dejavu::eval::speed_frontier`).
fn cmd_speed(a: &ReportArgs) -> Result<()> {
    use dejavu::eval::speed_frontier;
    if a.densities.iter().any(|d| !(*d > 0.0 && *d < 1.0)) || a.n_gen == 0 {
        anyhow::bail!("--densities must lie in (0, 1) and --n-gen be positive");
    }
    let engine = a.model.load(Some(a.n_gen + 2))?;
    let label = engine.model.label();
    let stem = label
        .split(' ')
        .next()
        .unwrap_or("model")
        .replace([':', '/'], "-");
    let file = |ext: &str| a.out.join(format!("{stem}.speed.{ext}"));
    let outputs = [file("md"), file("json"), file("png")];
    crate::refuse_overwrites(
        &outputs.each_ref().map(|p| ("--out", Some(p.as_path()))),
        &[&engine.model.path],
    )?;
    let (densities, policies): (Vec<f64>, Vec<_>) =
        speed_frontier::policies(&engine, &a.densities)?
            .into_iter()
            .unzip();
    let spec = dejavu::eval::bench::BenchSpec {
        engine: &engine,
        policies: &policies,
        n_prompt: 0,
        n_gen: a.n_gen,
        reps: 3,
    };
    let bar = dejavu::progress::bar((3 * policies.len()) as u64, "speed against density");
    let results = crate::backend_choice::bench_on(a.model.placement(), &spec, &mut || bar.inc(1))?;
    bar.finish_and_clear();
    let report = speed_frontier::SpeedReport {
        model: label.clone(),
        backend: results.first().map_or(String::new(), |r| r.backend.clone()),
        cpu: bench_cpu(),
        commit: dejavu::eval::bench::COMMIT.into(),
        rule: speed_frontier::rule(&engine).into(),
        n_gen: a.n_gen,
        rows: speed_frontier::rows(&results, &densities)?,
    };
    std::fs::create_dir_all(&a.out)?;
    let md = format!(
        "{label} | {} | {} | tg{} x 3 | commit {}\n\n{}",
        report.cpu,
        report.backend,
        a.n_gen,
        report.commit,
        speed_frontier::markdown(&report.rows)
    );
    dejavu::fsio::write(&file("md"), &md)?;
    dejavu::fsio::write(&file("json"), serde_json::to_string_pretty(&report)?)?;
    print!("{md}");
    match speed_frontier::plot(
        &report.rows,
        speed_frontier::x_desc(&report.rule),
        &format!("{label}: speed against density ({})", report.rule),
        &file("png"),
    ) {
        Ok(()) => eprintln!("wrote {} (md, json, png)", file("*").display()),
        Err(e) => eprintln!("wrote {} (md, json); no plot: {e}", file("*").display()),
    }
    Ok(())
}

/// `report --speed-map`: the `--speed` JSONs given, on one map (see
/// `dejavu::eval::speed_frontier::map_plot`).
fn cmd_speed_map(a: &ReportArgs) -> Result<()> {
    use dejavu::eval::speed_frontier::{self, SpeedReport};
    let mut reports = Vec::new();
    for p in &a.speed_map {
        let text = dejavu::fsio::read_text(p, dejavu::fsio::MAX_TEXT_BYTES, false)?;
        let r: SpeedReport = serde_json::from_str(&text)
            .with_context(|| format!("{}: not a `report --speed` JSON", p.display()))?;
        reports.push(r);
    }
    let (md, png) = (a.out.join("speed-map.md"), a.out.join("speed-map.png"));
    let inputs: Vec<&std::path::Path> = a.speed_map.iter().map(|p| p.as_path()).collect();
    crate::refuse_overwrites(&[("--out", Some(&md)), ("--out", Some(&png))], &inputs)?;
    std::fs::create_dir_all(&a.out)?;
    let table = speed_frontier::map_markdown(&reports);
    dejavu::fsio::write(&md, &table)?;
    print!("{table}");
    match speed_frontier::map_plot(
        &reports,
        "decode speedup over dense against density, per model and device (synthetic weights where labelled)",
        &png,
    ) {
        Ok(()) => eprintln!("wrote {} and {}", md.display(), png.display()),
        Err(e) => eprintln!("wrote {}; no plot: {e}", md.display()),
    }
    Ok(())
}

fn bench_cpu() -> String {
    dejavu::eval::bench::cpu_model()
}
