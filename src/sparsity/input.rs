//! Input sparsity (TEAL, Liu et al. ICLR 2025; WINA, 2025): a decode step drops the entries of
//! each projection's input whose score is below a calibrated threshold, and reads only the
//! weight rows of the inputs it keeps (the input-major layouts of [`crate::sparsity::layout`]).
//!
//! Four inputs per layer ([`Group`]): the attention block's (read by Q, K and V, one mask), the
//! attention output (W_o's), the MLP block's (gate and up, one mask) and the MLP activation
//! (the down projection's). TEAL scores an entry by `|x_i|`; WINA by `|x_i| * c_i`, `c_i` the
//! norm of the weight column that `x_i` multiplies ([`InputNorms`]; for a shared input, the
//! column norm of the stacked matrices, e.g. `[W_q; W_k; W_v]`).
//!
//! Thresholds come from calibration ([`InputStats`]): per layer and group, quantiles of the
//! scores over calibration tokens; `wina:S` keeps each group's threshold at its quantile `S`
//! (a uniform allocation: every group of every layer at sparsity `S`). `teal:S` does too
//! unless calibration stored TEAL's greedy allocation across the groups
//! ([`InputStats::alloc`], `crate::tune::allocation`): then each group's sparsity is the
//! allocation's at model-wide sparsity `S` (the same for every layer).
use crate::sparsity::layout::{Part, SparseLayout};
use crate::{Error, Result};
use dejavu_backend_api::{Backend, Weight};

/// The inputs a layer sparsifies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Group {
    /// The attention block's input (Q, K, V).
    Qkv,
    /// The attention output (W_o).
    O,
    /// The MLP block's input (gate and up, or fc1).
    GateUp,
    /// The MLP activation (the down projection, fc2).
    Down,
}

impl Group {
    pub const ALL: [Group; 4] = [Group::Qkv, Group::O, Group::GateUp, Group::Down];

    /// The transposed matrices that read this input.
    pub fn parts(self) -> &'static [Part] {
        match self {
            Group::Qkv => &[Part::Q, Part::K, Part::V],
            Group::O => &[Part::Wo],
            Group::GateUp => &[Part::Gate, Part::Up],
            Group::Down => &[Part::Down],
        }
    }
}

/// Per layer, for each [`Group`], the norm of each input's weight row (its column of the
/// source matrices, stacked over the matrices that share the input): WINA's `c_i`. Computed
/// from the transposed layouts the step reads.
pub struct InputNorms {
    pub layers: Vec<[Vec<f32>; 4]>,
}

impl InputNorms {
    /// From the inputs' layout of a model of `n_layers` layers, on the backend's
    /// dequantization (rows of every layer in parallel over the cores).
    pub fn compute(backend: &dyn Backend, inputs: &SparseLayout, n_layers: usize) -> Self {
        let norms = |l: usize| -> [Vec<f32>; 4] {
            Group::ALL.map(|g| {
                let mats: Vec<Weight> = (g.parts().iter())
                    .filter_map(|&p| inputs.get(l, p))
                    .collect();
                let n = mats.first().map_or(0, |w| w.rows);
                let mut sq = vec![0f64; n];
                for w in &mats {
                    let mut row = vec![0f32; w.cols];
                    for (i, s) in sq.iter_mut().enumerate() {
                        backend.dequantize_row(w, i, &mut row);
                        *s += row.iter().map(|&v| (v as f64) * (v as f64)).sum::<f64>();
                    }
                }
                sq.into_iter().map(|s| s.sqrt() as f32).collect()
            })
        };
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        let per = n_layers.div_ceil(threads).max(1);
        let layers = std::thread::scope(|s| {
            let handles: Vec<_> = (0..n_layers)
                .step_by(per)
                .map(|lo| {
                    let norms = &norms;
                    s.spawn(move || {
                        (lo..(lo + per).min(n_layers))
                            .map(norms)
                            .collect::<Vec<_>>()
                    })
                })
                .collect();
            handles
                .into_iter()
                .flat_map(|h| h.join().expect("norm threads do not panic"))
                .collect()
        });
        Self { layers }
    }
}

/// Quantiles per layer and group of calibration scores, at `POINTS` evenly spaced levels
/// (0, 1/(POINTS-1), ..., 1), for TEAL's scores and for WINA's.
#[derive(Debug, Clone, PartialEq)]
pub struct InputStats {
    /// `[layer][group][point]`, flattened.
    pub teal: Vec<f32>,
    pub wina: Vec<f32>,
    pub n_layers: usize,
    /// TEAL's allocation across the input groups: rows of the model-wide sparsity (the groups'
    /// sparsities weighted by the weights that read them) and then each group's sparsity (in
    /// `Group::ALL` order), the model-wide sparsity increasing. Empty: uniform.
    pub alloc: Vec<[f32; 5]>,
}

/// Quantile levels stored per layer and group.
pub const POINTS: usize = 201;

/// How a rule scores inputs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Score {
    Teal,
    Wina,
}

impl Default for InputStats {
    fn default() -> Self {
        Self::new()
    }
}

impl InputStats {
    /// No layers yet ([`InputStats::push_layer`] adds them in order).
    pub fn new() -> Self {
        Self {
            teal: Vec::new(),
            wina: Vec::new(),
            n_layers: 0,
            alloc: Vec::new(),
        }
    }

    /// Add the next layer's quantiles from its calibration rows of the four inputs
    /// (`rows[g]`: rows of group `g`'s width, one after another) and its weight-row norms.
    pub fn push_layer(&mut self, rows: [&[f32]; 4], norms: &[Vec<f32>; 4]) -> Result<()> {
        let l = self.n_layers;
        for (g, (rows, c)) in rows.iter().zip(norms).enumerate() {
            if c.is_empty() || rows.is_empty() || !rows.len().is_multiple_of(c.len()) {
                return Err(Error::Invalid(format!(
                    "input statistics: layer {l} group {g}: {} values for width {}",
                    rows.len(),
                    c.len()
                )));
            }
            let t: Vec<f32> = rows.iter().map(|v| v.abs()).collect();
            let w: Vec<f32> = (rows.iter().enumerate())
                .map(|(i, v)| v.abs() * c[i % c.len()])
                .collect();
            self.teal.extend(quantiles(t));
            self.wina.extend(quantiles(w));
        }
        self.n_layers += 1;
        Ok(())
    }

    /// The threshold that drops the fraction `sparsity` of layer `l`'s group `g` scores on the
    /// calibration tokens (linear between the stored quantiles); `sparsity` 0 keeps every input
    /// (a negative threshold).
    pub fn threshold(&self, score: Score, l: usize, g: Group, sparsity: f64) -> f32 {
        if sparsity <= 0.0 {
            return -1.0;
        }
        let q = match score {
            Score::Teal => &self.teal,
            Score::Wina => &self.wina,
        };
        let gi = Group::ALL.iter().position(|&x| x == g).unwrap_or(0);
        let at = (l * 4 + gi) * POINTS;
        let q = &q[at..at + POINTS];
        let x = sparsity.min(1.0) * (POINTS - 1) as f64;
        let (i, f) = (x.floor() as usize, x.fract() as f32);
        match q.get(i + 1) {
            Some(&hi) => q[i] + f * (hi - q[i]),
            None => q[POINTS - 1],
        }
    }
}

impl InputStats {
    /// Each group's sparsity (in `Group::ALL` order) at model-wide `sparsity` under `score`:
    /// for TEAL with an allocation, linear between its rows (from every group dense at 0);
    /// else, and past the allocation's last row, `sparsity` for every group.
    pub fn group_sparsity(&self, score: Score, sparsity: f64) -> [f64; 4] {
        let uniform = [sparsity; 4];
        if score != Score::Teal {
            return uniform;
        }
        let mut lo = [0f64; 5];
        for row in &self.alloc {
            let hi = row.map(f64::from);
            if sparsity <= hi[0] {
                let f = match hi[0] - lo[0] {
                    w if w > 0.0 => (sparsity - lo[0]) / w,
                    _ => 1.0,
                };
                return std::array::from_fn(|g| lo[g + 1] + f * (hi[g + 1] - lo[g + 1]));
            }
            lo = hi;
        }
        uniform
    }
}

/// `POINTS` quantiles of `v` (sorted in place; NaN sorts last).
fn quantiles(mut v: Vec<f32>) -> Vec<f32> {
    v.sort_unstable_by(|a, b| a.total_cmp(b));
    let n = v.len();
    (0..POINTS)
        .map(|p| v[(p * (n - 1)) / (POINTS - 1)])
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn thresholds_drop_the_requested_fraction() {
        // One layer; each group's rows are 0..1000 (scaled per group), norms 2 for WINA.
        let widths = [10, 10, 20, 40];
        let rows: Vec<Vec<f32>> = (widths.iter().enumerate())
            .map(|(g, &w)| {
                (0..1000 * w / 10)
                    .map(|i| (i % 1000) as f32 * (g + 1) as f32)
                    .collect()
            })
            .collect();
        let norms = InputNorms {
            layers: vec![widths.map(|w| vec![2.0; w])],
        };
        let mut st = InputStats::new();
        let layer = [&rows[0][..], &rows[1][..], &rows[2][..], &rows[3][..]];
        st.push_layer(layer, &norms.layers[0]).unwrap();
        for (gi, g) in Group::ALL.into_iter().enumerate() {
            for s in [0.1, 0.4, 0.5, 0.9] {
                let t = st.threshold(Score::Teal, 0, g, s);
                let dropped = rows[gi].iter().filter(|v| v.abs() <= t).count();
                let frac = dropped as f64 / rows[gi].len() as f64;
                assert!((frac - s).abs() < 0.01, "{g:?} {s}: dropped {frac}");
                let tw = st.threshold(Score::Wina, 0, g, s);
                assert!(
                    (tw - 2.0 * t).abs() <= 1e-3 * tw.max(1.0),
                    "{g:?} {s}: {tw} vs {t}"
                );
            }
            assert!(st.threshold(Score::Teal, 0, g, 0.0) < 0.0);
        }
        // No allocation: every group at the model-wide sparsity.
        assert_eq!(st.group_sparsity(Score::Teal, 0.3), [0.3; 4]);
        assert!(InputStats::new()
            .push_layer([&[1.0][..]; 4], &norms.layers[0])
            .is_err());
    }

    #[test]
    fn an_allocation_is_read_between_its_rows() {
        let mut st = InputStats::new();
        st.alloc = vec![[0.1, 0.0, 0.0, 0.2, 0.1], [0.3, 0.2, 0.0, 0.4, 0.5]];
        let close = |a: [f64; 4], b: [f64; 4]| a.iter().zip(b).all(|(x, y)| (x - y).abs() < 1e-6);
        let at = |s| st.group_sparsity(Score::Teal, s);
        assert!(close(at(0.05), [0.0, 0.0, 0.1, 0.05]), "{:?}", at(0.05));
        assert!(close(at(0.1), [0.0, 0.0, 0.2, 0.1]));
        assert!(close(at(0.2), [0.1, 0.0, 0.3, 0.3]), "{:?}", at(0.2));
        assert!(close(at(0.3), [0.2, 0.0, 0.4, 0.5]));
        assert_eq!(at(0.0), [0.0; 4]);
        // Past the last row, and for WINA: uniform.
        assert_eq!(at(0.5), [0.5; 4]);
        assert_eq!(st.group_sparsity(Score::Wina, 0.2), [0.2; 4]);
    }
}
