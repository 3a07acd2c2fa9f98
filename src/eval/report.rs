//! `dejavu report`: the quality/speed frontier of a set of policies on one text, as a markdown
//! table, JSON and a PNG plot.
//!
//! Every policy is compared with dense decoding in one pass (`eval::perplexity::compare_many`): perplexity ratio,
//! KL divergence, top-1 agreement, weight bytes read per token, MLP density, and the decode
//! speedup measured on the same scored steps, dense and sparse interleaved token by token.
use crate::eval::perplexity::{compare_specs, Comparison};
use crate::exec::Engine;
use crate::sparsity::policy::Policy;
use crate::sparsity::predictors_file::Predictors;
use crate::{Error, Result};
use serde::Serialize;
use std::path::Path;

#[derive(Debug, Clone, Serialize, serde::Deserialize)]
pub struct FrontierRow {
    pub policy: String,
    /// The rule (`oracle`, `gate-first`, `up-first`, `dejavu`, `attn-norm`, `dejavu-attn`, `head`,
    /// `teal`, `wina`),
    /// `mixed` (several parts) or `recommended`.
    pub family: String,
    pub ppl_dense: f64,
    pub ppl: f64,
    pub ppl_ratio: f64,
    pub kl: f64,
    pub top1_agreement: f64,
    pub mb_per_token: f64,
    /// Dense bytes over this policy's bytes: the speedup if time followed bytes.
    pub byte_speedup: f64,
    /// Measured decode speedup over dense.
    pub speedup: f64,
    pub mlp_density: f64,
    #[serde(default = "one")]
    pub head_density: f64,
    pub exact_logits: f64,
}

fn one() -> f64 {
    1.0
}

/// Held-out recall per layer of one kind of learned predictor.
pub struct Recall {
    pub what: String,
    pub per_layer: Vec<f64>,
    /// The recall of a random choice at the same budget.
    pub chance: f64,
}

/// Families whose points are one rule at several budgets (joined by a line in the plot).
const SWEEPS: [&str; 8] = [
    "oracle",
    "gate-first",
    "up-first",
    "dejavu",
    "attn-norm",
    "dejavu-attn",
    "teal",
    "wina",
];

fn family(spec: &str) -> String {
    if spec.starts_with("recommended") {
        return "recommended".into();
    }
    // Lookahead changes timing, not the selection: same family as without it.
    let spec = spec.replace("+lookahead", "");
    if spec.contains('+') {
        return "mixed".into();
    }
    spec.split(':').next().unwrap_or(&spec).to_string()
}

/// Evaluate `specs` on `tokens` (chunks of `ctx`) against dense.
pub fn frontier(
    engine: &Engine,
    on: &dyn crate::exec::Sessions,
    tokens: &[u32],
    ctx: usize,
    specs: &[String],
    predictors: Option<&Predictors>,
) -> Result<Vec<FrontierRow>> {
    let evaluated = compare_specs(engine, on, tokens, ctx, specs, predictors, "scored tokens")?;
    let dense_bytes = engine.model.dense_bytes_per_token() as f64;
    Ok(evaluated
        .into_iter()
        .map(|(p, r): (Policy, Comparison)| FrontierRow {
            policy: p.name.clone(),
            family: family(&p.name),
            ppl_dense: r.dense.ppl,
            ppl: r.sparse.ppl,
            ppl_ratio: r.sparse.ppl / r.dense.ppl,
            kl: r.kl,
            top1_agreement: r.top1_agreement,
            mb_per_token: r.steps.mean_bytes() / 1e6,
            byte_speedup: dense_bytes / r.steps.mean_bytes().max(1.0),
            speedup: r.speedup(),
            mlp_density: r.steps.mlp_density(),
            head_density: r.steps.head_density(),
            exact_logits: r.steps.mean_exact_logits(),
        })
        .collect())
}

pub fn markdown(rows: &[FrontierRow]) -> String {
    let mut s = String::from(
        "| policy | PPL | PPL ratio | KL (nats) | top-1 agree | MB/token | bytes speedup | measured speedup | MLP density | head density | exact logits |\n\
         |---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    for r in rows {
        s += &format!(
            "| {} | {:.3} | {:.4} | {:.4} | {:.1}% | {:.1} | {:.2}x | {:.2}x | {:.2} | {:.2} | {:.0} |\n",
            r.policy,
            r.ppl,
            r.ppl_ratio,
            r.kl,
            r.top1_agreement * 100.0,
            r.mb_per_token,
            r.byte_speedup,
            r.speedup,
            r.mlp_density,
            r.head_density,
            r.exact_logits
        );
    }
    s
}

/// Register a system font as plotters' `sans-serif` (every plot's text).
pub(crate) fn register_font() -> Result<()> {
    let font = system_font().ok_or_else(|| {
        Error::Invalid("no TrueType font found for the plot (install fonts-dejavu-core)".into())
    })?;
    plotters::style::register_font("sans-serif", plotters::style::FontStyle::Normal, font)
        .map_err(|_| Error::Invalid("unreadable font".into()))
}

/// A sans-serif TrueType font from the usual system locations (plotters draws text with it).
fn system_font() -> Option<&'static [u8]> {
    const PATHS: [&str; 5] = [
        "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
        "/usr/share/fonts/dejavu/DejaVuSans.ttf",
        "/usr/share/fonts/TTF/DejaVuSans.ttf",
        "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
        "/usr/share/fonts/liberation-sans/LiberationSans-Regular.ttf",
    ];
    PATHS
        .iter()
        .find_map(|p| std::fs::read(p).ok())
        .map(|b| &*Box::leak(b.into_boxed_slice()))
}

/// Six panels in two rows. Top: PPL ratio and KL against the measured speedup, and the learned
/// predictors' held-out recall per layer (`recall`; without it, top-1 agreement against the
/// speedup). Bottom: PPL ratio, KL and top-1 agreement against model-wide sparsity (the fraction
/// of dense decoding's weight bytes a policy does not read), where rules of every kind (MLP
/// neurons, heads, projection inputs) compare at equal bytes. One colour per family; the points
/// of a sweep joined.
pub fn plot(rows: &[FrontierRow], recall: &[Recall], title: &str, path: &Path) -> Result<()> {
    register_font()?;
    crate::fsio::write_via_path(path, |tmp| draw(rows, recall, title, tmp))
}

impl FrontierRow {
    /// The fraction of dense decoding's weight bytes per token this policy does not read.
    pub fn model_sparsity(&self) -> f64 {
        1.0 - 1.0 / self.byte_speedup.max(1e-9)
    }
}

fn draw(rows: &[FrontierRow], recall: &[Recall], title: &str, path: &Path) -> Result<()> {
    use plotters::prelude::*;
    let err = |e: &dyn std::fmt::Display| Error::Invalid(format!("plot: {e}"));
    let root = BitMapBackend::new(path, (1500, 1000)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let root = root
        .titled(title, ("sans-serif", 22))
        .map_err(|e| err(&e))?;
    let panels = root.split_evenly((2, 3));
    let colour = |f: &str| match f {
        "oracle" => RGBColor(120, 120, 120),
        "gate-first" => RGBColor(31, 119, 180),
        "up-first" => RGBColor(44, 160, 44),
        "head" => RGBColor(214, 39, 40),
        "dejavu" => RGBColor(140, 86, 75),
        "attn-norm" => RGBColor(23, 190, 207),
        "dejavu-attn" => RGBColor(188, 189, 34),
        "teal" => RGBColor(255, 127, 14),
        "wina" => RGBColor(227, 119, 194),
        "recommended" => RGBColor(0, 0, 0),
        _ => RGBColor(148, 103, 189),
    };
    type Pick = fn(&FrontierRow) -> (f64, f64);
    const SPARSITY: &str = "model-wide sparsity (weight bytes not read)";
    // (caption, x label, y label, point)
    type Panel = (&'static str, &'static str, &'static str, Pick);
    let specs: [Panel; 6] = [
        (
            "PPL ratio vs measured speedup",
            "measured decode speedup",
            "PPL / dense PPL",
            |r| (r.speedup, r.ppl_ratio),
        ),
        (
            "KL vs measured speedup",
            "measured decode speedup",
            "KL(dense || sparse), nats",
            |r| (r.speedup, r.kl),
        ),
        // Replaced by the predictors' recall per layer when there is one.
        (
            "top-1 agreement vs measured speedup",
            "measured decode speedup",
            "top-1 agreement with dense",
            |r| (r.speedup, r.top1_agreement),
        ),
        (
            "PPL ratio vs model-wide sparsity",
            SPARSITY,
            "PPL / dense PPL",
            |r| (r.model_sparsity(), r.ppl_ratio),
        ),
        (
            "KL vs model-wide sparsity",
            SPARSITY,
            "KL(dense || sparse), nats",
            |r| (r.model_sparsity(), r.kl),
        ),
        (
            "top-1 agreement vs model-wide sparsity",
            SPARSITY,
            "top-1 agreement with dense",
            |r| (r.model_sparsity(), r.top1_agreement),
        ),
    ];
    for (i, (caption, xl, yl, pick)) in specs.into_iter().enumerate() {
        if i == 2 && !recall.is_empty() {
            continue;
        }
        let area = &panels[i];
        // Quality axes stop at +60% PPL / 0.6 nats: points beyond sit on the top edge.
        let (kl, top1) = (yl.starts_with("KL"), yl.starts_with("top-1"));
        let cap = if kl { 0.6 } else { 1.6 };
        let pick = move |r: &FrontierRow| {
            let (x, y) = pick(r);
            (x, if top1 { y } else { y.min(cap) })
        };
        let pts: Vec<(f64, f64)> = rows.iter().map(pick).collect();
        let sparsity_axis = xl == SPARSITY;
        let (x0, x1) = pts.iter().fold(
            if sparsity_axis {
                (0f64, 0f64)
            } else {
                (1f64, 1f64)
            },
            |(a, b), p| (a.min(p.0), b.max(p.0)),
        );
        let (y0, y1) = pts
            .iter()
            .fold((f64::MAX, f64::MIN), |(a, b), p| (a.min(p.1), b.max(p.1)));
        let (ypad, xpad) = ((y1 - y0).max(1e-3) * 0.08, (x1 - x0).max(0.05) * 0.08);
        let mut chart = ChartBuilder::on(area)
            .caption(caption, ("sans-serif", 16))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(60)
            .build_cartesian_2d((x0 - xpad)..(x1 + xpad), (y0 - ypad)..(y1 + ypad))
            .map_err(|e| err(&e))?;
        chart
            .configure_mesh()
            .x_desc(xl)
            .y_desc(yl)
            .label_style(("sans-serif", 12))
            .draw()
            .map_err(|e| err(&e))?;
        let mut fams: Vec<String> = rows.iter().map(|r| family(&r.policy)).collect();
        fams.sort();
        fams.dedup();
        for f in &fams {
            let c = colour(f);
            let mut fp: Vec<(f64, f64)> = rows
                .iter()
                .filter(|r| &family(&r.policy) == f)
                .map(pick)
                .collect();
            fp.sort_by(|a, b| a.0.total_cmp(&b.0));
            if SWEEPS.contains(&f.as_str()) {
                chart
                    .draw_series(LineSeries::new(fp.clone(), c.stroke_width(1)))
                    .map_err(|e| err(&e))?;
            }
            chart
                .draw_series(fp.iter().map(|&p| Circle::new(p, 4, c.filled())))
                .map_err(|e| err(&e))?
                .label(f.as_str())
                .legend(move |(x, y)| Circle::new((x + 6, y), 4, c.filled()));
        }
        chart
            .configure_series_labels()
            .position(if top1 {
                SeriesLabelPosition::LowerLeft
            } else {
                SeriesLabelPosition::UpperLeft
            })
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .label_font(("sans-serif", 12))
            .draw()
            .map_err(|e| err(&e))?;
    }
    if let (false, Some(area)) = (recall.is_empty(), panels.get(2)) {
        let n_layers = recall.iter().map(|r| r.per_layer.len()).max().unwrap_or(1);
        let mut chart = ChartBuilder::on(area)
            .caption("learned predictors: recall per layer", ("sans-serif", 16))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(60)
            .build_cartesian_2d(0f64..n_layers as f64, 0f64..1f64)
            .map_err(|e| err(&e))?;
        chart
            .configure_mesh()
            .x_desc("layer")
            .y_desc("held-out recall of the true top units")
            .label_style(("sans-serif", 12))
            .draw()
            .map_err(|e| err(&e))?;
        let colours = [RGBColor(255, 127, 14), RGBColor(23, 190, 207)];
        for (rec, c) in recall.iter().zip(colours) {
            let pts: Vec<(f64, f64)> = rec
                .per_layer
                .iter()
                .enumerate()
                .map(|(l, &r)| (l as f64 + 0.5, r))
                .collect();
            chart
                .draw_series(LineSeries::new(pts.clone(), c.stroke_width(2)))
                .map_err(|e| err(&e))?
                .label(format!("{} (chance {})", rec.what, rec.chance))
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 12, y)], c));
            chart
                .draw_series(pts.iter().map(|&p| Circle::new(p, 3, c.filled())))
                .map_err(|e| err(&e))?;
            chart
                .draw_series(LineSeries::new(
                    vec![(0.0, rec.chance), (n_layers as f64, rec.chance)],
                    c.mix(0.5),
                ))
                .map_err(|e| err(&e))?;
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::LowerRight)
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .label_font(("sans-serif", 12))
            .draw()
            .map_err(|e| err(&e))?;
    }
    root.present().map_err(|e| err(&e))?;
    Ok(())
}
