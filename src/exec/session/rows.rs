//! What a caller gets back from a run of tokens: the last row's logits (generation), the logits
//! of a range of rows (perplexity scores a window), or the output head's inputs of a range
//! (calibration); and, for calibration, each layer's block inputs and head output norms.
use super::step::{first_projections, norm, products, Pass};
use super::{Computed, DeviceSession, Scratch};
use crate::exec::model::{DeviceModel, UnitBytes};
use crate::model::config::ModelConfig;
use crate::{Error, Result};
use dejavu_backend_api::{Device, Product, Rows, MAX_ROWS};
use std::ops::Range;

/// Which rows of a run [`DeviceSession::run`] returns.
#[derive(Debug, Clone, Copy)]
pub enum Logits {
    /// The last token's logits (generation).
    Last,
    /// The logits of tokens `start..end` of the run (`[n][vocab]`).
    Range(usize, usize),
    /// No logits: the output head's input for tokens `start..end` (`[n][d_embed]`: the final
    /// hidden states, normed and projected as the head reads them).
    Hidden(usize, usize),
}

/// Per layer, what a run under [`DeviceSession::capture`] saw, row after row.
#[derive(Debug, Clone, Default)]
pub struct Capture {
    /// Attention inputs (normed, for pre-norm models), `[n][d_model]`.
    pub attn_in: Vec<Vec<f32>>,
    /// Norms of each query head's attention output, `[n][n_heads]`.
    pub head_norm: Vec<Vec<f32>>,
    /// MLP inputs (normed, for pre-norm models), `[n][d_model]`.
    pub mlp_in: Vec<Vec<f32>>,
    /// Per column of the attention output (W_o's input, `n_heads * head_dim`), the sum over the
    /// rows of its squares (importance matrices need no more).
    pub attn_out_sq: Vec<Vec<f32>>,
    /// The attention outputs themselves (W_o's inputs), `[n][n_heads * head_dim]`.
    pub attn_out: Vec<Vec<f32>>,
}

/// What one decode step reads and computes under the plan.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StepStats {
    /// Bytes of weights read (predictors included; a rule that computes a projection in full
    /// to select from it counts that projection whole).
    pub weight_bytes: usize,
    /// MLP neurons computed, summed over layers, and the dense count.
    pub mlp_kept: usize,
    pub mlp_total: usize,
    /// Query heads computed, summed over layers, and the dense count.
    pub heads_kept: usize,
    pub heads_total: usize,
    /// Output rows computed exactly (the vocabulary size when dense).
    pub exact_logits: usize,
    /// The weight bytes by block.
    pub bytes: super::StepBytes,
    /// Under input sparsity, each layer's four input groups (Q/K/V, W_o, gate/up, down), and
    /// those of them read whole: at sparsity 0, or where the device expects the sparse products
    /// to be slower (`InputPlan::where_it_pays`). 0 and 0 without input sparsity.
    pub input_groups: usize,
    pub input_groups_whole: usize,
}

/// What a batch hands back.
pub(super) enum Want {
    Nothing,
    /// The last row's logits, left on the device in `s.logits`.
    Last,
    /// Rows `rows` of the batch (logits, or the head's inputs), appended to `rows_out`.
    Rows {
        rows: Range<usize>,
        hidden: bool,
    },
}

/// A block input or output kept under capture.
#[derive(Clone, Copy)]
pub(super) enum Kept {
    AttnIn,
    HeadNorms,
    MlpIn,
}

impl<D: Device> DeviceSession<'_, D> {
    /// Run `tokens` at the next positions and return what `want` names, valid until the next
    /// run. A prompt runs in batches where the plan allows (`batchable`; always under
    /// capture, which needs it), else one position at a time, as decode steps do.
    pub fn run(&mut self, tokens: &[u32], want: Logits) -> Result<&mut [f32]> {
        self.run_as(tokens, want, false)
    }

    /// Run a prompt, or the rest of one after a cached prefix: its last token's logits. Under
    /// a plan whose steps select units per token, a prompt of one token runs as a batch of
    /// every unit too, as the same token does inside a longer prompt; a decode step
    /// ([`Self::forward`]) runs under the plan. So a prompt's keys, values and logits do not
    /// depend on where a cached prefix ends.
    pub fn prompt(&mut self, tokens: &[u32]) -> Result<&mut [f32]> {
        self.run_as(tokens, Logits::Last, true)
    }

    /// [`Self::run`]; `prompt`: the tokens are (the rest of) a prompt (see [`Self::prompt`]).
    pub(crate) fn run_as(
        &mut self,
        tokens: &[u32],
        want: Logits,
        prompt: bool,
    ) -> Result<&mut [f32]> {
        self.check(tokens)?;
        let n = tokens.len();
        let (rows, hidden) = match want {
            Logits::Last => (n - 1..n, false),
            Logits::Range(s, e) | Logits::Hidden(s, e) if s < e && e <= n => {
                (s..e, matches!(want, Logits::Hidden(..)))
            }
            Logits::Range(s, e) | Logits::Hidden(s, e) => {
                return Err(Error::Invalid(format!(
                    "logit range {s}..{e} outside a run of {n} tokens"
                )))
            }
        };
        let last = matches!(want, Logits::Last);
        if !last && !self.model.shard.is_whole() {
            return Err(Error::Invalid(
                "rows other than the last are not gathered under tensor parallelism".into(),
            ));
        }
        let capture = self.capture.is_some();
        if capture && !self.batchable() {
            return Err(Error::Invalid(
                "capturing activations needs a plan that runs in batches".into(),
            ));
        }
        self.clamp_lazy()?;
        self.rows_out.clear();
        let prompt = prompt && !self.plan.layers_dense();
        match (n > 1 || capture || prompt) && self.batchable() {
            true => self.prefill(tokens, (!last).then_some((rows, hidden)))?,
            false => {
                for (i, &t) in tokens.iter().enumerate() {
                    self.step(t)?;
                    if !last && rows.contains(&i) {
                        self.step_row(hidden)?;
                    }
                }
            }
        }
        if last {
            let mut out = std::mem::take(&mut self.logits);
            let got = self.head_logits(&mut out);
            self.logits = out;
            got?;
            return Ok(&mut self.logits);
        }
        Ok(&mut self.rows_out)
    }

    /// `tokens` in batches of up to `MAX_ROWS` rows: the rows `want` names of the run
    /// (`None`: the last one's logits, left on the device).
    fn prefill(&mut self, tokens: &[u32], want: Option<(Range<usize>, bool)>) -> Result<()> {
        let (size, n) = (MAX_ROWS.min(self.n_ctx).max(1), tokens.len());
        tokens.chunks(size).enumerate().try_for_each(|(i, chunk)| {
            let at = i * size..i * size + chunk.len();
            let want = match &want {
                None if at.end == n => Want::Last,
                None => Want::Nothing,
                Some((r, hidden)) => match r.start.max(at.start)..r.end.min(at.end) {
                    mine if mine.is_empty() => Want::Nothing,
                    mine => Want::Rows {
                        rows: mine.start - at.start..mine.end - at.start,
                        hidden: *hidden,
                    },
                },
            };
            self.run_batch(chunk, want, false)?;
            self.len += chunk.len();
            Ok(())
        })
    }

    /// The logits of the row [`Self::output`] last computed into `out` (`vocab` wide), under a
    /// contextual head checked against its bound (see [`Self::bound_head`]).
    fn head_logits(&mut self, out: &mut [f32]) -> Result<()> {
        self.dev.download(&self.s.logits, out)?;
        self.bound_head(out)
    }

    /// After a step: its logits, or its output head's input, appended to `rows_out`.
    fn step_row(&mut self, hidden: bool) -> Result<()> {
        let (m, s) = (self.model, &self.s);
        if !hidden {
            let (at, vocab) = (self.rows_out.len(), m.local.vocab_size);
            let mut out = std::mem::take(&mut self.rows_out);
            out.resize(at + vocab, 0.0);
            let got = self.head_logits(&mut out[at..]);
            self.rows_out = out;
            return got;
        }
        let (buf, width) = match (&m.proj_out, &m.output_norm) {
            (Some(_), _) => (&s.e, m.local.d_embed),
            (None, Some(_)) => (&s.h, m.local.d_model),
            (None, None) => (&s.x, m.local.d_model),
        };
        let at = self.rows_out.len();
        self.rows_out.resize(at + width, 0.0);
        Ok(self.dev.download(buf, &mut self.rows_out[at..])?)
    }

    /// The output head of batch rows `rows` (their final norm and projection, then the
    /// vocabulary's logits unless `hidden`), appended to `rows_out`.
    /// `steps`: each row as a decode step computes it (see [`Pass::Batch`]).
    pub(super) fn batch_rows(
        &mut self,
        rows: Range<usize>,
        hidden: bool,
        steps: bool,
    ) -> Result<()> {
        let (dev, c, k) = (self.dev, &self.model.local, rows.len());
        let at = self.rows_out.len();
        if hidden {
            self.rows_out.resize(at + k * c.d_embed, 0.0);
            let head_in = head_inputs(dev, self.model, &mut self.s, rows, steps)?;
            return Ok(dev.download(head_in, &mut self.rows_out[at..])?);
        }
        let mut logits = dev.zeros(k * c.vocab_size)?;
        self.head_rows(rows, steps, &mut logits)?;
        self.rows_out.resize(at + k * c.vocab_size, 0.0);
        Ok(dev.download(&logits, &mut self.rows_out[at..])?)
    }

    /// The vocabulary's logits of batch rows `rows` into `logits` (`rows.len()` rows; see
    /// [`Self::batch_rows`]).
    pub(super) fn head_rows(
        &mut self,
        rows: Range<usize>,
        steps: bool,
        logits: &mut D::Buf,
    ) -> Result<()> {
        let (dev, m, k) = (self.dev, self.model, rows.len());
        let c = &m.local;
        let head_in = head_inputs(dev, m, &mut self.s, rows, steps)?;
        let pass = Pass::Batch { rows: k, steps };
        products(
            dev,
            head_in,
            pass,
            &mut [Product::new(m.head(), Rows::All, logits)],
        )?;
        if let Some(cap) = c.final_softcap {
            dev.scale_cap(logits, k * c.vocab_size, 1.0, Some(cap))?;
        }
        Ok(())
    }

    /// Record each layer's block inputs and head output norms from now on ([`Capture`]), or
    /// stop (`false`). Runs under capture are eager (not replayed) and run in batches.
    pub fn capture(&mut self, on: bool) {
        self.capture = on.then(Capture::default);
    }

    /// What the runs since [`Self::capture`] recorded (and the recording goes on, empty).
    pub fn take_capture(&mut self) -> Capture {
        self.capture
            .as_mut()
            .map(std::mem::take)
            .unwrap_or_default()
    }

    /// `|a|`, every MLP activation of layer `l` for the rows `h` (`[n][d_model]`, its MLP
    /// inputs as [`Capture::mlp_in`] holds them), in batches: `[n][n_ff]`.
    pub fn mlp_activations(&mut self, l: usize, h: &[f32]) -> Result<Vec<f32>> {
        let (dev, m) = (self.dev, self.model);
        let (c, d) = (&m.local, m.local.d_model);
        if l >= c.n_layers || !h.len().is_multiple_of(d) || !m.shard.is_whole() {
            return Err(Error::Invalid(format!(
                "MLP activations of layer {l} for {} values: {} layers of width {d}, one device",
                h.len(),
                c.n_layers
            )));
        }
        let (size, ff) = (MAX_ROWS.min(self.n_ctx).max(1), c.n_ff);
        let mut out = vec![0.0; h.len() / d * ff];
        for (rows, out) in h.chunks(size * d).zip(out.chunks_mut(size * ff)) {
            let n = rows.len() / d;
            if self.s.grow(dev, m, n, self.n_ctx)? {
                self.forget_graphs();
            }
            dev.set_step(&vec![0; n], 0)?;
            let mut input = dev.upload(rows)?;
            std::mem::swap(&mut self.s.h, &mut input);
            let pass = Pass::Batch {
                rows: n,
                steps: false,
            };
            let gated = first_projections(dev, c, &m.layers[l], Rows::All, ff, pass, &mut self.s);
            std::mem::swap(&mut self.s.h, &mut input);
            let a = if gated? {
                &mut self.s.gate
            } else {
                &mut self.s.up
            };
            dev.abs(a, n * ff)?;
            dev.download(a, out)?;
        }
        Ok(out)
    }

    /// What a prompt's batch reads and computes: every unit, the dense head, once per batch.
    pub fn batch_step(&self) -> StepStats {
        let c = &self.model.local;
        let bytes = super::step_bytes(self.model, None);
        StepStats {
            weight_bytes: bytes.total(),
            mlp_kept: c.n_ff * c.n_layers,
            mlp_total: c.n_ff * c.n_layers,
            heads_kept: c.n_heads * c.n_layers,
            heads_total: c.n_heads * c.n_layers,
            exact_logits: c.vocab_size,
            bytes,
            input_groups: 0,
            input_groups_whole: 0,
        }
    }

    /// What the last decode step read and computed under the plan: the plan's counts, and
    /// under a rule that skips zero activations the nonzero ones the step counted (read back).
    pub fn last_step(&self) -> Result<StepStats> {
        let c = &self.model.local;
        let (mut mlp_kept, mut bytes) = (0, self.step_bytes);
        let mut counts = Vec::new();
        for (l, (sel, rule)) in self.plan.mlp.iter().zip(&self.plan.mlp_rule).enumerate() {
            let Computed::Nonzero { oracle } = *rule else {
                mlp_kept += sel.count(c.n_ff);
                continue;
            };
            if !self.measure {
                mlp_kept += c.n_ff;
                continue;
            }
            if counts.is_empty() {
                counts = vec![0.0; c.n_layers];
                self.dev.download(&self.s.nonzero, &mut counts)?;
            }
            let k = (counts[l] as usize).min(c.n_ff);
            let u = &self.model.unit_bytes[l];
            // The zero neurons' rows of the down projection go unread; under an oracle, their
            // rows of the first projections too.
            let skipped = if oracle {
                u.neuron
            } else {
                u.neuron - u.gate - u.up
            };
            bytes.mlp -= (c.n_ff - k) * skipped;
            mlp_kept += k;
        }
        let inputs = self.model.inputs.as_deref();
        if let (Some(p), Some(im), true) = (&self.plan.inputs, inputs, self.measure) {
            // Input sparsity: the rows of the inputs each layer kept at this step; a group kept
            // whole (threshold below 0) reads the file's rows of its matrices.
            // (input blocks: the kept inputs' quants, and the scale table of each block with a
            // kept input).
            let mut kept = vec![0.0; 8 * c.n_layers];
            self.dev.download(&self.s.kept, &mut kept)?;
            let read = |l: usize, g: usize| match p.thresholds[l][g] < 0.0 {
                true => group_bytes(c, &self.model.unit_bytes[l], g),
                false => {
                    let (n, blocks) = (kept[4 * l + g] as usize, kept[4 * (c.n_layers + l) + g]);
                    let (row, table) = (im[l].row_bytes[g], im[l].table_bytes[g]);
                    n * (row - table / 32) + blocks as usize * table
                }
            };
            bytes.attention = (0..c.n_layers).map(|l| read(l, 0) + read(l, 1)).sum();
            bytes.mlp = (0..c.n_layers).map(|l| read(l, 2) + read(l, 3)).sum();
        }
        // A contextual head that fell back read the dense head as well.
        let fell_back = self.head_fell_back && self.plan.output.is_some();
        if fell_back {
            bytes.output += self.model.head_bytes;
        }
        let exact = self.plan.output.as_ref().filter(|_| !fell_back);
        let th = self.plan.inputs.as_ref().map(|p| &p.thresholds[..]);
        let whole = th.map_or(0, |t| t.iter().flatten().filter(|t| **t < 0.0).count());
        Ok(StepStats {
            weight_bytes: bytes.total(),
            mlp_kept,
            mlp_total: c.n_ff * c.n_layers,
            heads_kept: self.plan.heads.iter().map(|s| s.count(c.n_heads)).sum(),
            heads_total: c.n_heads * c.n_layers,
            exact_logits: exact.map_or(c.vocab_size, |o| o.candidates),
            bytes,
            input_groups: th.map_or(0, |t| 4 * t.len()),
            input_groups_whole: whole,
        })
    }
}

/// The file's bytes of the matrices that read input group `g` (`Group::ALL` order: Q, K and
/// V; W_o; gate and up; down) of a layer with unit bytes `u`.
pub(super) fn group_bytes(c: &ModelConfig, u: &UnitBytes, g: usize) -> usize {
    match g {
        0 => c.n_heads * (u.q + u.kv_head),
        1 => c.n_heads * (u.head - u.q),
        2 => c.n_ff * (u.gate + u.up),
        _ => c.n_ff * (u.neuron - u.gate - u.up),
    }
}

/// Under capture: the pass's `rows` rows of `x` (a block input, or the attention output of every
/// head, kept as each head's norm) appended to layer `l`'s record.
pub(super) fn keep<D: Device>(
    dev: &D,
    m: &DeviceModel<D>,
    capture: &mut Option<Capture>,
    what: Kept,
    l: usize,
    x: &D::Buf,
    rows: usize,
) -> Result<()> {
    let Some(cap) = capture.as_mut() else {
        return Ok(());
    };
    let c = &m.local;
    let (list, width) = match what {
        Kept::AttnIn => (&mut cap.attn_in, c.d_model),
        Kept::MlpIn => (&mut cap.mlp_in, c.d_model),
        Kept::HeadNorms => (&mut cap.head_norm, c.n_heads * c.head_dim),
    };
    list.resize(c.n_layers, Vec::new());
    let mut v = vec![0.0; rows * width];
    dev.download(x, &mut v)?;
    match what {
        Kept::HeadNorms => {
            list[l].extend(
                v.chunks_exact(c.head_dim)
                    .map(|h| h.iter().map(|a| a * a).sum::<f32>().sqrt()),
            );
            cap.attn_out_sq.resize(c.n_layers, Vec::new());
            let sq = &mut cap.attn_out_sq[l];
            sq.resize(width, 0.0);
            for row in v.chunks_exact(width) {
                sq.iter_mut().zip(row).for_each(|(s, a)| *s += a * a);
            }
            cap.attn_out.resize(c.n_layers, Vec::new());
            cap.attn_out[l].extend_from_slice(&v);
        }
        _ => list[l].extend_from_slice(&v),
    }
    Ok(())
}

/// The inputs of the output head for batch rows `rows` of `b`: the residual's rows moved to the
/// front of `h` (it is done with), normed into `x`, and projected where the model projects its
/// output (`steps`: each row as a decode step computes it).
fn head_inputs<'s, D: Device>(
    dev: &D,
    m: &DeviceModel<D>,
    b: &'s mut Scratch<D>,
    rows: Range<usize>,
    steps: bool,
) -> Result<&'s D::Buf> {
    let (c, k) = (&m.local, rows.len());
    dev.take_rows(&b.x, rows.start, k, c.d_model, &mut b.h)?;
    let mut head_in = match &m.output_norm {
        Some(n) => {
            norm(dev, c, n, &b.h, &mut b.x, k)?;
            &b.x
        }
        None => &b.h,
    };
    if let Some(p) = &m.proj_out {
        let pass = Pass::Batch { rows: k, steps };
        products(
            dev,
            head_in,
            pass,
            &mut [Product::new(p, Rows::All, &mut b.e)],
        )?;
        head_in = &b.e;
    }
    Ok(head_in)
}
