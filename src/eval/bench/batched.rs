//! `dejavu bench --batch 1,2,4,...`: decode steps of several sequences at once (continuous
//! batching's step, `DeviceSession::step_many`), their aggregate tokens per second at each
//! batch size against one sequence's, on one device.
use crate::eval::plot::{line_chart, Axes, Series};
use crate::exec::{Logits, SeqBatch};
use crate::{Error, Result};
use plotters::style::RGBColor;
use std::path::Path;
use std::time::Instant;

/// One batch size's median over the repetitions.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct BatchRow {
    pub backend: String,
    pub batch: usize,
    /// Context each sequence holds when its steps start.
    pub n_prompt: usize,
    pub step_ms: f64,
    /// Generated tokens per second, summed over the batch's sequences.
    pub tok_per_s: f64,
    /// `tok_per_s` over batch 1's (when batch 1 is measured).
    pub vs_one: Option<f64>,
}

/// On `seqs` (at least the largest batch of them): each sequence holds an `n_prompt`-token
/// prompt; then for each repetition and each batch size `b` in turn (alternating, so a slow
/// phase of a shared machine hits every size), `n_gen` steps of sequences `0..b`, timed. `tick`
/// after each timed run.
pub fn batched(
    seqs: &mut dyn SeqBatch,
    backend: &str,
    batches: &[usize],
    (n_prompt, n_gen, reps): (usize, usize, usize),
    tick: &mut dyn FnMut(),
) -> Result<Vec<BatchRow>> {
    let most = batches.iter().copied().max().unwrap_or(0);
    if most == 0 || most > seqs.count() || n_gen == 0 || reps == 0 {
        return Err(Error::Invalid(format!(
            "batches {batches:?} of {} sequences, {n_gen} steps, {reps} repetitions",
            seqs.count()
        )));
    }
    let prompt: Vec<u32> = (0..n_prompt.max(1) as u32)
        .map(|i| (i * 7 + 1) % 1000)
        .collect();
    for s in 0..most {
        seqs.truncate(s, 0);
        seqs.run(s, &prompt, Logits::Last)?;
    }
    let mut samples = vec![Vec::new(); batches.len()];
    for _ in 0..=reps {
        for (i, &b) in batches.iter().enumerate() {
            let ids: Vec<usize> = (0..b).collect();
            (0..b).for_each(|s| seqs.truncate(s, prompt.len()));
            let t0 = Instant::now();
            for step in 0..n_gen {
                let tokens: Vec<u32> = (0..b)
                    .map(|s| ((step * 31 + s * 17) % 997) as u32)
                    .collect();
                seqs.step(&ids, &tokens)?;
            }
            samples[i].push(t0.elapsed().as_secs_f64() / n_gen as f64);
            tick();
        }
    }
    let mut rows: Vec<BatchRow> = (batches.iter().zip(&mut samples))
        .map(|(&b, s)| {
            // The first run of each size warms up.
            let s = &mut s[1..];
            s.sort_by(f64::total_cmp);
            let step = s[s.len() / 2];
            BatchRow {
                backend: backend.into(),
                batch: b,
                n_prompt: prompt.len(),
                step_ms: step * 1e3,
                tok_per_s: b as f64 / step,
                vs_one: None,
            }
        })
        .collect();
    if let Some(one) = rows.iter().find(|r| r.batch == 1).map(|r| r.tok_per_s) {
        rows.iter_mut()
            .for_each(|r| r.vs_one = Some(r.tok_per_s / one));
    }
    Ok(rows)
}

/// The rows as a markdown table.
pub fn markdown(rows: &[BatchRow]) -> String {
    let mut out = String::from(
        "| backend | batch | context | step ms | tok/s (all sequences) | vs batch 1 |\n\
         |---|---:|---:|---:|---:|---:|\n",
    );
    for r in rows {
        let vs = r.vs_one.map_or("-".into(), |v| format!("{v:.2}x"));
        out += &format!(
            "| {} | {} | {} | {:.2} | {:.1} | {vs} |\n",
            r.backend, r.batch, r.n_prompt, r.step_ms, r.tok_per_s
        );
    }
    out
}

/// Aggregate tok/s over batch 1's against the batch size, one line per backend, with the ideal
/// (a step of `b` rows as fast as one) for reference.
pub fn plot(rows: &[BatchRow], title: &str, path: &Path) -> Result<()> {
    let colors = [RGBColor(31, 119, 180), RGBColor(214, 39, 40)];
    let mut backends: Vec<&str> = rows.iter().map(|r| r.backend.as_str()).collect();
    backends.dedup();
    let x_max = rows.iter().map(|r| r.batch).max().unwrap_or(1) as f64;
    let mut series: Vec<Series> = (backends.iter().enumerate())
        .map(|(i, b)| Series {
            label: b.to_string(),
            color: colors[i % colors.len()],
            width: 2,
            dots: true,
            points: (rows.iter())
                .filter(|r| r.backend == *b)
                .filter_map(|r| Some((r.batch as f64, r.vs_one?)))
                .collect(),
        })
        .collect();
    let y_max = series
        .iter()
        .flat_map(|s| s.points.iter().map(|p| p.1))
        .fold(1.0, f64::max);
    series.push(Series {
        label: "ideal (a step of b rows costs one)".into(),
        color: RGBColor(160, 160, 160),
        width: 1,
        dots: false,
        points: vec![(1.0, 1.0), (x_max.min(y_max * 1.2), x_max.min(y_max * 1.2))],
    });
    let axes = Axes {
        x_desc: "sequences per step (batch)",
        x_max: x_max * 1.05,
        y_desc: "aggregate tok/s over one sequence's",
        y_max: y_max * 1.2,
    };
    line_chart(path, title, axes, &series)
}
