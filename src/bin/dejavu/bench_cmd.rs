//! `dejavu bench`: prefill and decode speed per policy on each backend asked for (the CPU at each
//! thread count, the GPU or a world of GPUs), one bench (`dejavu::eval::bench`), and the
//! CPU-against-GPU gain plot.
use crate::backend_choice::{bench_on, BackendKind, Placement};
use crate::{load_engine, parse_kv_type, policy_for, SyntheticArgs};
use anyhow::{bail, Context, Result};
use clap::Args;
use dejavu::exec::EngineOptions;
use dejavu::exec::KvType;
use dejavu::fetch;

#[derive(Args)]
pub struct BenchArgs {
    /// GGUF file, checkpoint directory or known model name (default: smollm2-135m-instruct).
    #[arg(long, short)]
    pub model: Option<std::ffi::OsString>,
    /// KV cache element type: f16 (the default) or f32.
    #[arg(long, default_value = "f16", value_parser = parse_kv_type)]
    pub kv_type: KvType,
    #[command(flatten)]
    pub synthetic: SyntheticArgs,
    /// Keep the file's row layout (skip repacking Q8_0/Q4_0/Q4_1/Q5_0 rows at load).
    #[arg(long)]
    pub no_repack: bool,
    /// Backends to measure, comma-separated: cpu, cuda (a build with `--features cuda`; the
    /// model then keeps its file's row layout on the CPU too).
    #[arg(long, value_delimiter = ',', default_value = "cpu")]
    pub backend: Vec<String>,
    /// Tensor parallelism of the `cuda` runs: the model split over this many GPUs (`-tp N`).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=64))]
    pub tensor_parallel: u16,
    /// `false`: the CPU's prompt batches through faster tiles, not batch-invariant (see
    /// `generate --help`); `true` (the CPU's default) as every other command runs them. On the
    /// GPU `true` runs its batch-invariant kernels (off by default there), and `false,true`
    /// measures both, one after the other on one copy of the model.
    #[arg(long, value_name = "BOOL", num_args = 0..=1, default_missing_value = "true",
          value_delimiter = ',')]
    pub deterministic: Vec<bool>,
    /// Thread counts to test, comma-separated.
    #[arg(long, short, value_delimiter = ',', default_value = "1,2")]
    pub threads: Vec<usize>,
    /// How long idle worker threads poll for work before sleeping, 0-100 (llama.cpp's `--poll`).
    #[arg(long, default_value_t = dejavu_backend_cpu::pool::DEFAULT_POLL,
          value_parser = clap::value_parser!(u32).range(0..=100))]
    pub poll: u32,
    /// Prompt length of the prefill test pp<P> (0 = skip).
    #[arg(short = 'p', long = "n-prompt", default_value_t = 128)]
    pub n_prompt: usize,
    /// Tokens of the decode test tg<N> (0 = skip).
    #[arg(short = 'n', long = "n-gen", default_value_t = 64)]
    pub n_gen: usize,
    /// Timed repetitions per test (after one warm-up).
    #[arg(long, short, default_value_t = 5)]
    pub repetitions: usize,
    /// Sparsity policies to compare, comma-separated (see `generate --help`); repetitions
    /// alternate between them so they see the same machine conditions.
    #[arg(long, value_delimiter = ',', default_value = "dense")]
    pub sparsity: Vec<String>,
    /// Predictors file (default: the `dejavu calibrate` output next to the model, if present).
    #[arg(long)]
    pub predictors: Option<std::path::PathBuf>,
    /// Also write the results as a JSON array to this file.
    #[arg(long)]
    pub json: Option<std::path::PathBuf>,
    /// Also write the results as CSV to this file.
    #[arg(long)]
    pub csv: Option<std::path::PathBuf>,
    /// With `--backend cpu,cuda`: plot each backend's decode speedup over its own dense
    /// against MLP density to this PNG, the points to the same path with `.json` (and print
    /// the table).
    #[arg(long)]
    pub plot: Option<std::path::PathBuf>,
    /// Decode steps of several sequences at once (continuous batching): the sequence counts
    /// to measure, comma-separated (`1,2,4,8`), each sequence holding a `-p`-token prompt,
    /// `-n` steps timed; under each `--sparsity` policy in turn (the first, dense as a rule, the
    /// others' baseline), with the density of a sparse policy's MLP union. With `--plot`, the
    /// aggregate speed over batch 1's as a PNG, its points beside it (`.json`).
    #[arg(long, value_delimiter = ',')]
    pub batch: Vec<usize>,
    /// Only redraw `--plot` from the points a previous `--plot` saved, or from a `--batch`
    /// run's `--json` (no measuring).
    #[arg(long, requires = "plot")]
    pub replot: Option<std::path::PathBuf>,
}

/// The title of a `--batch` plot (after the model's label).
const BATCH_TITLE: &str = "steps of several sequences";

pub fn cmd_bench(a: BenchArgs) -> Result<()> {
    use dejavu::eval::bench::{self, gains, gains_markdown, plot_gains, BenchSpec, GainRow};
    if let (Some(from), Some(png)) = (&a.replot, &a.plot) {
        crate::refuse_overwrites(&[("--plot", Some(png))], &[from])?;
        let text = dejavu::fsio::read_text(from.as_ref(), dejavu::fsio::MAX_TEXT_BYTES, false)?;
        // The points of `--plot` (with `--batch` or without), or a `--batch` run's `--json`.
        use dejavu::eval::bench::batched::{self, BatchRow};
        if let Ok((title, rows)) = serde_json::from_str::<(String, Vec<GainRow>)>(&text) {
            print!("{}", gains_markdown(&rows));
            plot_gains(&rows, &title, png)?;
        } else if let Ok((title, rows)) = serde_json::from_str::<(String, Vec<BatchRow>)>(&text) {
            print!("{}", batched::markdown(&rows));
            batched::plot(&rows, &title, png)?;
        } else {
            let rows: Vec<BatchRow> = serde_json::from_str(&text).with_context(|| {
                format!(
                    "{}: not the points of `bench --plot` nor a `bench --batch` run's --json",
                    from.display()
                )
            })?;
            print!("{}", batched::markdown(&rows));
            batched::plot(&rows, BATCH_TITLE, png)?;
        }
        eprintln!("wrote {}", png.display());
        return Ok(());
    }
    if a.repetitions == 0 || a.threads.is_empty() || (a.n_prompt == 0 && a.n_gen == 0) {
        bail!(
            "nothing to run: need --repetitions >= 1, at least one thread count, and -p or -n > 0"
        );
    }
    dejavu_backend_cpu::pool::set_poll(a.poll);
    let path = fetch::resolve_model(a.model.as_deref())?;
    let points = a.plot.as_ref().map(|p| p.with_extension("json"));
    crate::refuse_overwrites(
        &[
            ("--json", a.json.as_deref()),
            ("--csv", a.csv.as_deref()),
            ("--plot", a.plot.as_deref()),
            ("--plot", points.as_deref()),
        ],
        &[&path],
    )?;
    if let Some(b) = a
        .backend
        .iter()
        .find(|b| !["cpu", "cuda"].contains(&b.as_str()))
    {
        bail!("unknown backend `{b}` (cpu, cuda)");
    }
    let cuda = a.backend.iter().any(|b| b == "cuda");
    let cpu = a.backend.iter().any(|b| b == "cpu");
    if a.tensor_parallel > 1 && !cuda {
        bail!("tensor parallelism splits a model over GPUs: add --backend cuda");
    }
    // Where to run: the GPU (or a world of them), then the CPU at each thread count.
    let mut places: Vec<(Placement, Option<usize>)> = Vec::new();
    let both = a.deterministic.contains(&true) && a.deterministic.contains(&false);
    if both && cpu {
        bail!("--deterministic false,true compares the GPU's kernels: the CPU takes one value");
    }
    if cuda {
        let tensor_parallel = a.tensor_parallel as usize;
        let modes = match a.deterministic.is_empty() {
            true => vec![false],
            false => a.deterministic.clone(),
        };
        places.extend(modes.into_iter().map(|deterministic| {
            let at = Placement {
                backend: BackendKind::Cuda,
                tensor_parallel,
                deterministic,
            };
            (at, None)
        }));
    }
    if cpu {
        let at = Placement {
            backend: BackendKind::Cpu,
            tensor_parallel: 1,
            deterministic: false,
        };
        places.extend(a.threads.iter().map(|&t| (at, Some(t))));
    }
    let ctx = match a.batch.is_empty() {
        true => a.n_prompt.max(a.n_gen + 1).max(16),
        false => (a.n_prompt.max(1) + a.n_gen + 1).max(16),
    };
    // Loaded once (a synthetic model is built once); each thread count gets its own pool.
    let mut engine = load_engine(
        &path,
        EngineOptions {
            threads: Some(a.threads[0]),
            n_ctx: Some(ctx),
            kv_type: a.kv_type,
            synthetic: a.synthetic.options(),
            keep_file_layout: a.no_repack || cuda,
            prompt_tiles: a.deterministic == [false],
        },
    )?;
    let policies = (a.sparsity.iter())
        .map(|spec| policy_for(&engine, spec, a.predictors.as_deref()))
        .collect::<Result<Vec<_>>>()?;
    if !a.batch.is_empty() {
        return bench_batches(&a, &mut engine, &places, &policies);
    }
    let tests = [a.n_prompt, a.n_gen].iter().filter(|&&n| n > 0).count();
    let runs = places.len() * tests * a.repetitions * policies.len();
    let bar = indicatif::ProgressBar::new(runs as u64);
    bar.set_style(
        indicatif::ProgressStyle::with_template("{bar:40} {pos}/{len} runs {msg}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut results = Vec::new();
    for (at, threads) in places {
        match threads {
            Some(t) => {
                if t > cores {
                    bar.println(format!("warning: {t} threads on {cores} cores: the spinning pool oversubscribes, expect decoding far slower"));
                }
                engine.set_threads(t)?;
                bar.set_message(format!("cpu, {t} threads"));
            }
            None => bar.set_message("cuda"),
        }
        let spec = BenchSpec {
            engine: &engine,
            policies: &policies,
            n_prompt: a.n_prompt,
            n_gen: a.n_gen,
            reps: a.repetitions,
        };
        results.extend(bench_on(at, &spec, &mut || bar.inc(1))?);
    }
    bar.finish_and_clear();
    print!("{}", bench::markdown(&results));
    if let Some(p) = &a.plot {
        let g = gains(&results);
        print!("\n{}", gains_markdown(&g));
        let title = format!("{}: sparsity gains, CPU and GPU", engine.model.label());
        plot_with_points(p, &title, &g, plot_gains)?;
    }
    if let Some(p) = &a.json {
        dejavu::fsio::write(p, serde_json::to_string_pretty(&results)?)
            .with_context(|| format!("writing {}", p.display()))?;
    }
    if let Some(p) = &a.csv {
        dejavu::fsio::write(p, bench::csv(&results))
            .with_context(|| format!("writing {}", p.display()))?;
    }
    Ok(())
}

/// `--batch`: steps of several sequences on each place under each policy (alternating), a
/// table (and `--plot`'s PNG).
fn bench_batches(
    a: &BenchArgs,
    engine: &mut dejavu::exec::Engine,
    places: &[(Placement, Option<usize>)],
    policies: &[dejavu::sparsity::policy::Policy],
) -> Result<()> {
    use dejavu::eval::bench::batched;
    if a.batch.contains(&0) || a.n_gen == 0 {
        bail!("--batch takes sequence counts of 1 or more, and -n steps of 1 or more");
    }
    let most = a.batch.iter().copied().max().unwrap_or(1);
    let runs = places.len() * a.batch.len() * policies.len() * (a.repetitions + 1);
    let bar = indicatif::ProgressBar::new(runs as u64);
    let names: Vec<String> = policies.iter().map(|p| p.name.clone()).collect();
    let refs: Vec<&dejavu::sparsity::policy::Policy> = policies.iter().collect();
    let mut rows = Vec::new();
    for &(at, threads) in places {
        let name = match threads {
            Some(t) => {
                engine.set_threads(t)?;
                format!("cpu, {t} threads")
            }
            None if at.deterministic => "cuda, deterministic".into(),
            None => "cuda".into(),
        };
        bar.set_message(name.clone());
        let sizes = (a.n_prompt, a.n_gen, a.repetitions);
        rows.extend(crate::backend_choice::with_sequences_each(
            engine,
            at,
            &refs,
            most,
            |sets| {
                let tick = &mut || bar.inc(1);
                Ok(batched::batched(
                    sets, &name, &names, &a.batch, sizes, tick,
                )?)
            },
        )?);
    }
    bar.finish_and_clear();
    print!("{}", batched::markdown(&rows));
    if let Some(p) = &a.json {
        dejavu::fsio::write(p, serde_json::to_string_pretty(&rows)?)
            .with_context(|| format!("writing {}", p.display()))?;
    }
    if let Some(p) = &a.plot {
        let title = format!("{}: {BATCH_TITLE}", engine.model.label());
        plot_with_points(p, &title, &rows, batched::plot)?;
    }
    Ok(())
}

/// `--plot`: the points `(title, rows)` to `png`'s path with `.json`, then `draw` them to
/// `png`. A machine without fonts still keeps the points (a warning): `--replot` draws them
/// elsewhere.
fn plot_with_points<R: serde::Serialize>(
    png: &std::path::Path,
    title: &str,
    rows: &[R],
    draw: impl FnOnce(&[R], &str, &std::path::Path) -> dejavu::Result<()>,
) -> Result<()> {
    let points = png.with_extension("json");
    dejavu::fsio::write(&points, serde_json::to_string_pretty(&(title, rows))?)
        .with_context(|| format!("writing {}", points.display()))?;
    match draw(rows, title, png) {
        Ok(()) => eprintln!("wrote {} and {}", png.display(), points.display()),
        Err(e) => eprintln!(
            "warning: {e}; the points are in {} (draw them with `bench --replot {} --plot {}`)",
            points.display(),
            points.display(),
            png.display()
        ),
    }
    Ok(())
}
