//! One sequence on the device: its KV cache, activations and recorded step.
use super::model::DeviceModel;
use super::plan::{Computed, DevicePlan, Sel};
use crate::model::config::{ModelConfig, Positions};
use crate::{Error, Result};
use dejavu_backend_api::{Device, MAX_ROWS};

mod batch;
mod head;
mod inputs;
mod many;
mod rows;
mod step;

pub use rows::{Capture, Logits, StepStats};

/// The activations of one step: `x` to `up` and `part` hold `rows` rows (one for decode
/// steps; a prompt's batch grows them once to [`MAX_ROWS`], see [`Scratch::grow`]).
struct Scratch<D: Device> {
    rows: usize,
    x: D::Buf,
    h: D::Buf,
    e: D::Buf,
    q: D::Buf,
    k: D::Buf,
    v: D::Buf,
    att: D::Buf,
    gate: D::Buf,
    up: D::Buf,
    /// Per predictor run at one layer (at most 3): its hidden layer (`rank` wide) and its
    /// scores, for `predictor_rows` rows (one until a step of several sequences runs them).
    z: [D::Buf; 3],
    scores: [D::Buf; 3],
    rank: usize,
    predictor_rows: usize,
    /// The rules that select from a layer's own activations: a projection in full (or the
    /// kept values, compact) and the scores of the units.
    full: D::Buf,
    score: D::Buf,
    /// The contextual head's exact logits of its candidates (compact).
    exact: D::Buf,
    /// Input sparsity: a projection's kept inputs (zeros elsewhere), and per layer and input
    /// group the count of kept inputs (`layer * 4 + group`).
    sparse: D::Buf,
    kept: D::Buf,
    /// Per layer, the nonzero activations a step of a rule that skips zeros computed.
    nonzero: D::Buf,
    logits: D::Buf,
    /// Tensor parallelism (and Gemma's norms of block outputs): a row-parallel product's
    /// output before the all-reduce (or the norm), and the logits of this rank's vocabulary rows (before the all-gather into `logits`). One value
    /// each for a whole model without those norms.
    part: D::Buf,
    part_logits: D::Buf,
}

/// The predictors' buffers of [`Scratch`]: `z`, `scores`.
type PredBufs<D> = ([<D as Device>::Buf; 3], [<D as Device>::Buf; 3]);

/// The buffers of [`Scratch`] that hold a step's rows, for `rows` rows.
type RowBufs<D> = [<D as Device>::Buf; 10];

impl<D: Device> Scratch<D> {
    /// `x, h, e, q, k, v, att, gate, up, part` of `rows` rows of model `m`.
    fn row_bufs(dev: &D, m: &DeviceModel<D>, rows: usize) -> Result<RowBufs<D>> {
        let c = &m.local;
        let (wide, qd) = (c.d_model.max(c.d_embed), c.n_heads * c.head_dim);
        let z = |w: usize| dev.zeros(rows * w);
        let part = if m.partial_outputs() { rows * wide } else { 1 };
        Ok([
            z(wide)?,
            z(wide)?,
            z(wide)?,
            z(qd)?,
            z(c.kv_dim())?,
            z(c.kv_dim())?,
            z(qd)?,
            z(c.n_ff)?,
            z(c.n_ff)?,
            dev.zeros(part)?,
        ])
    }

    /// Room for `rows` rows: the row buffers made anew for [`MAX_ROWS`] rows (at most
    /// `n_ctx`) when they hold fewer. Returns whether they moved (a recorded step then names
    /// the old ones).
    fn grow(&mut self, dev: &D, m: &DeviceModel<D>, rows: usize, n_ctx: usize) -> Result<bool> {
        if rows <= self.rows {
            return Ok(false);
        }
        let cap = MAX_ROWS.min(n_ctx).max(rows);
        let [x, h, e, q, k, v, att, gate, up, part] = Self::row_bufs(dev, m, cap)?;
        (self.x, self.h, self.e, self.q, self.k, self.v) = (x, h, e, q, k, v);
        (self.att, self.gate, self.up, self.part, self.rows) = (att, gate, up, part, cap);
        Ok(true)
    }

    /// The predictors' `z` (`rank` wide) and `scores` (a unit of model config `c` each) for
    /// `rows` rows.
    fn predictor_bufs(dev: &D, c: &ModelConfig, rank: usize, rows: usize) -> Result<PredBufs<D>> {
        let (z, n) = (rows * rank, rows * c.n_ff.max(c.n_heads));
        Ok((
            [dev.zeros(z)?, dev.zeros(z)?, dev.zeros(z)?],
            [dev.zeros(n)?, dev.zeros(n)?, dev.zeros(n)?],
        ))
    }

    /// `z` and `scores` made anew for `rows` rows of model config `c`.
    fn grow_predictors(&mut self, dev: &D, c: &ModelConfig, rows: usize) -> Result<()> {
        (self.z, self.scores) = Self::predictor_bufs(dev, c, self.rank, rows)?;
        self.predictor_rows = rows;
        Ok(())
    }
}

impl<D: Device> crate::exec::Decoder for DeviceSession<'_, D> {
    fn decode(&mut self, tokens: &[u32]) -> Result<&mut [f32]> {
        self.forward(tokens)
    }
    fn prompt(&mut self, tokens: &[u32]) -> Result<&mut [f32]> {
        DeviceSession::prompt(self, tokens)
    }
    fn reuses_steps(&self) -> bool {
        DeviceSession::reuses_steps(self)
    }
    fn len(&self) -> usize {
        self.len
    }
    fn n_ctx(&self) -> usize {
        self.n_ctx
    }
    fn truncate(&mut self, len: usize) {
        DeviceSession::truncate(self, len)
    }
    fn last_step(&self) -> Result<Option<StepStats>> {
        DeviceSession::last_step(self).map(Some)
    }
    fn run(&mut self, tokens: &[u32], want: Logits) -> Result<&mut [f32]> {
        DeviceSession::run(self, tokens, want)
    }
    fn verify(&mut self, tokens: &[u32]) -> Result<&mut [f32]> {
        DeviceSession::verify(self, tokens)
    }
    fn capture(&mut self, on: bool) -> Result<()> {
        DeviceSession::capture(self, on);
        Ok(())
    }
    fn take_capture(&mut self) -> Capture {
        DeviceSession::take_capture(self)
    }
    fn mlp_activations(&mut self, l: usize, h: &[f32]) -> Result<Vec<f32>> {
        DeviceSession::mlp_activations(self, l, h)
    }
    fn mask_batches(&mut self, on: bool) -> Result<()> {
        DeviceSession::mask_batches(self, on)
    }
}

/// A session's plan and device, and what its decode steps and its prompt's batches read.
#[derive(Debug, Clone)]
pub struct SessionInfo {
    pub plan: String,
    pub device: String,
    /// What the last decode step read and computed (before any, the plan's counts).
    pub step: StepStats,
    /// What a prompt's batch reads and computes (every unit).
    pub batch: StepStats,
}

/// Where an eagerly run step's time goes, in seconds summed over the steps profiled (see
/// [`DeviceSession::profile`]).
#[derive(Debug, Clone, Copy, Default, serde::Serialize)]
pub struct BlockTimes {
    pub steps: usize,
    /// Embedding lookup.
    pub embed: f64,
    /// The low-rank predictors and their top-k.
    pub predict: f64,
    pub attention: f64,
    pub mlp: f64,
    /// The final norm and the output head.
    pub output: f64,
    /// Tensor parallelism: the collectives (the all-reduces after W_o and fc2 and of the
    /// embedding row, the all-gather of the logits).
    pub all_reduce: f64,
}

impl BlockTimes {
    /// Add `o`'s steps and times.
    pub fn add(&mut self, o: &BlockTimes) {
        self.steps += o.steps;
        let mut o = *o;
        for (a, b) in self.times_mut().into_iter().zip(o.times_mut()) {
            *a += *b;
        }
    }
    /// Each time through `f` (the steps kept).
    pub fn map(mut self, f: impl Fn(f64) -> f64) -> Self {
        self.times_mut().into_iter().for_each(|t| *t = f(*t));
        self
    }
    fn times_mut(&mut self) -> [&mut f64; 6] {
        [
            &mut self.embed,
            &mut self.predict,
            &mut self.attention,
            &mut self.mlp,
            &mut self.output,
            &mut self.all_reduce,
        ]
    }
}

/// Times the blocks of a step: the device is synchronized at every block's end.
struct Clock<'t> {
    times: &'t mut BlockTimes,
    at: std::time::Instant,
}

impl Clock<'_> {
    fn lap<D: Device>(&mut self, dev: &D, block: fn(&mut BlockTimes) -> &mut f64) -> Result<()> {
        dev.sync()?;
        let now = std::time::Instant::now();
        *block(self.times) += (now - self.at).as_secs_f64();
        self.at = now;
        Ok(())
    }
}

fn lap<D: Device>(
    clock: &mut Option<Clock>,
    dev: &D,
    block: fn(&mut BlockTimes) -> &mut f64,
) -> Result<()> {
    match clock {
        Some(c) => c.lap(dev, block),
        None => Ok(()),
    }
}

/// The collective `f`, timed on its own when the blocks are (under tensor parallelism): the
/// block `before` it is lapped first.
fn collective<D: Device>(
    clock: &mut Option<Clock>,
    dev: &D,
    before: fn(&mut BlockTimes) -> &mut f64,
    f: impl FnOnce() -> Result<()>,
) -> Result<()> {
    if clock.is_none() || dev.world().1 == 1 {
        return f();
    }
    lap(clock, dev, before)?;
    f()?;
    lap(clock, dev, |t| &mut t.all_reduce)
}

/// One layer's selected `(neurons, heads)`, each sorted (`None`: every unit).
pub type Selections = (Option<Vec<u32>>, Option<Vec<u32>>);

/// One sequence on the device: its KV cache, its activations and its recorded step.
pub struct DeviceSession<'a, D: Device> {
    dev: &'a D,
    model: &'a DeviceModel<D>,
    plan: DevicePlan<D>,
    k: Vec<D::Cache>,
    v: Vec<D::Cache>,
    n_ctx: usize,
    len: usize,
    s: Scratch<D>,
    /// Lazy K/V, per layer with a head selection under a `lazy-kv` plan: the layer's attention
    /// inputs per position (f16), and per head the positions below which its K/V are valid.
    lazy: Vec<Option<(D::Cache, D::Idx)>>,
    /// A truncation whose lazy K/V validity the next batch clamps first.
    truncated: bool,
    graph: Option<D::Graph>,
    /// Steps of several sequences this one led, recorded by their row count (under a plan
    /// that selects nothing per step: see [`Self::step_many`]).
    seq_graphs: Vec<(usize, D::Graph)>,
    /// Their logits on the device (`rows * vocab`), and how many rows it holds.
    seq_logits: Option<(D::Buf, usize)>,
    logits: Vec<f32>,
    /// Rows a caller asked [`DeviceSession::run`] for (logits or head inputs).
    rows_out: Vec<f32>,
    /// Calibration: each layer's block inputs and head output norms, when asked for.
    capture: Option<Capture>,
    /// Count the nonzero activations of rules that skip zeros ([`Self::measure`]).
    measure: bool,
    /// A prompt's batches zero the inputs below the plan's thresholds ([`Self::mask_batches`]).
    mask_batches: bool,
    /// Weight bytes one step reads under the plan.
    step_bytes: StepBytes,
    /// The last step's contextual head fell back to the dense head (its bound may not hold).
    head_fell_back: bool,
    /// During a step of several sequences this one leads: each row's sequence (see
    /// [`Self::step_many`]); empty otherwise.
    rows_seq: Vec<many::RowSeq<D>>,
    /// Rows of scratch kept for the next step of several sequences.
    spare: Vec<many::RowScratch<D>>,
    /// A step of several sequences under a sparse plan: the union of the rows' neurons at the
    /// layer, and the sizes of the unions (and of their layers) since they were last read.
    union_idx: Option<D::Idx>,
    union_counts: (usize, usize),
}

impl<'a, D: Device> DeviceSession<'a, D> {
    pub fn new(
        dev: &'a D,
        model: &'a DeviceModel<D>,
        plan: DevicePlan<D>,
        n_ctx: usize,
    ) -> Result<Self> {
        let c = &model.local;
        if plan.output.is_some() && !model.shard.is_whole() {
            return Err(Error::Invalid(
                "the contextual output head does not run under tensor parallelism".into(),
            ));
        }
        if plan.needs_inputs() && model.inputs.is_none() {
            return Err(Error::Invalid(
                "input sparsity on the device needs the model with its input-major layout".into(),
            ));
        }
        if plan.needs_layout() && model.sparse.is_none() {
            return Err(Error::Invalid(
                "a sparse plan on the device needs the model uploaded with its sparse layout"
                    .into(),
            ));
        }
        let (mut k, mut v) = (Vec::new(), Vec::new());
        for _ in 0..c.n_layers {
            k.push(dev.cache(n_ctx, c.kv_dim())?);
            v.push(dev.cache(n_ctx, c.kv_dim())?);
        }
        let rank = (plan.mlp_pred.iter().chain(&plan.head_pred))
            .flatten()
            .map(|p| p.rank)
            .chain(plan.output.as_ref().map(|o| o.rank))
            .max()
            .unwrap_or(1);
        let wide = c.d_model.max(c.d_embed);
        let inputs = plan.needs_inputs();
        let widest = wide.max(c.n_heads * c.head_dim).max(c.n_ff);
        let tp = !model.shard.is_whole();
        let per_rank = model.shard.vocab_per_rank(c.vocab_size);
        let [x, h, e, q, k_row, v_row, att, gate, up, part] = Scratch::row_bufs(dev, model, 1)?;
        let (z, scores) = Scratch::predictor_bufs(dev, c, rank, 1)?;
        let s = Scratch {
            rows: 1,
            x,
            h,
            e,
            q,
            k: k_row,
            v: v_row,
            att,
            gate,
            up,
            z,
            rank,
            predictor_rows: 1,
            scores,
            full: dev.zeros(c.n_ff.max(c.n_heads * c.head_dim))?,
            score: dev.zeros(c.n_ff.max(c.n_heads))?,
            exact: dev.zeros(plan.output.as_ref().map_or(1, |o| o.candidates))?,
            sparse: dev.zeros(if inputs { widest } else { 1 })?,
            kept: dev.zeros(8 * c.n_layers.max(1))?,
            nonzero: dev.zeros(c.n_layers.max(1))?,
            logits: dev.zeros(per_rank * model.shard.world)?,
            part,
            part_logits: dev.zeros(if tp { per_rank } else { 1 })?,
        };
        let mut plan = plan;
        if let (Some(ip), Some(im)) = (&mut plan.inputs, model.inputs.as_deref()) {
            ip.where_it_pays(|l, g| {
                let dense = rows::group_bytes(c, &model.unit_bytes[l], g);
                dev.input_break_even(&im[l].group(g), dense)
            });
        }
        let step_bytes = step_bytes(model, Some(&plan));
        let lazy = (plan.heads.iter())
            .map(|h| match plan.lazy_kv && !h.is_all() {
                true => Ok(Some((
                    dev.cache(n_ctx, c.d_model)?,
                    dev.upload_idx(&vec![0; c.n_heads])?,
                ))),
                false => Ok(None),
            })
            .collect::<Result<_>>()?;
        Ok(Self {
            dev,
            model,
            plan,
            k,
            v,
            n_ctx,
            len: 0,
            s,
            lazy,
            truncated: false,
            graph: None,
            seq_graphs: Vec::new(),
            seq_logits: None,
            logits: vec![0.0; c.vocab_size],
            rows_out: Vec::new(),
            capture: None,
            measure: true,
            mask_batches: false,
            step_bytes,
            head_fell_back: false,
            rows_seq: Vec::new(),
            spare: Vec::new(),
            union_idx: None,
            union_counts: (0, 0),
        })
    }

    /// Run the steps from now on under `plan`; the cache and its positions stay (a plan chosen
    /// per step: the tests replay a policy's selections one step at a time). Lazy K/V cannot
    /// be switched on or off mid-sequence.
    pub fn set_plan(&mut self, plan: DevicePlan<D>) -> Result<()> {
        if plan.lazy_kv || self.plan.lazy_kv {
            return Err(Error::Invalid(
                "a plan with lazy K/V is the session's for its whole sequence".into(),
            ));
        }
        // A session of one position makes the plan's own scratch (its caches are dropped).
        let fresh = Self::new(self.dev, self.model, plan, 1)?;
        self.plan = fresh.plan;
        self.s = fresh.s;
        self.step_bytes = fresh.step_bytes;
        self.forget_graphs();
        Ok(())
    }

    /// The last step's selections per layer, `(neurons, heads)`, each sorted, in the whole
    /// model's numbering (`None`: every unit held here); read back from the device (for tests
    /// and reports).
    pub fn selections(&self) -> Result<Vec<Selections>> {
        let (c, shard) = (&self.model.config, self.model.shard);
        let read = |sel: &Sel<D>, first: usize| -> Result<Option<Vec<u32>>> {
            let (idx, n) = match sel {
                Sel::All => return Ok(None),
                Sel::Fixed { idx, count } => (idx, *count),
                Sel::Predicted { idx, k } => (idx, *k),
            };
            let mut v = vec![0; n];
            if n > 0 {
                self.dev.download_idx(idx, &mut v)?;
            }
            v.iter_mut().for_each(|i| *i += first as u32);
            v.sort_unstable();
            Ok(Some(v))
        };
        let (n0, h0) = (shard.part(c.n_ff).start, shard.part(c.n_heads).start);
        (self.plan.mlp.iter().zip(&self.plan.heads))
            .map(|(m, h)| Ok((read(m, n0)?, read(h, h0)?)))
            .collect()
    }

    /// May a later prompt reuse the positions decode steps wrote (see
    /// `Decoder::reuses_steps`)? Not on a batch-invariant device under a plan whose steps skip
    /// units a prompt computes.
    pub fn reuses_steps(&self) -> bool {
        self.plan.layers_dense() || !self.dev.batch_invariant()
    }

    /// Tokens in the cache.
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Drop the recorded steps (they name buffers or settings about to change).
    fn forget_graphs(&mut self) {
        self.graph = None;
        self.seq_graphs.clear();
    }

    /// Whether steps count the nonzero activations of a rule that skips zeros (`relu-exact`,
    /// `oracle` of a ReLU model) for [`Self::last_step`] (on by default). Off, a step saves
    /// one reduction per layer and its statistics count every neuron (an upper bound).
    pub fn measure(&mut self, on: bool) {
        self.measure = on;
        self.forget_graphs();
    }

    /// Hold `src`'s first `len` positions (its keys and values, copied on the device) and
    /// nothing after: a sequence that starts from another's prompt (the choices of one
    /// request). Both are sequences of one model; a plan with lazy K/V forks nothing.
    pub fn copy_prefix(&mut self, src: &Self, len: usize) -> Result<()> {
        if len > src.len || src.n_ctx != self.n_ctx || self.k.len() != src.k.len() {
            return Err(Error::Invalid(format!(
                "a sequence of {} positions forked at {len}, or into another model's",
                src.len
            )));
        }
        if self.lazy.iter().chain(&src.lazy).any(Option::is_some) {
            return Err(Error::Invalid("forking a sequence under lazy K/V".into()));
        }
        let caches = self
            .k
            .iter_mut()
            .zip(&src.k)
            .chain(self.v.iter_mut().zip(&src.v));
        for (dst, from) in caches {
            self.dev.copy_cache(from, dst, len)?;
        }
        self.len = len;
        Ok(())
    }

    /// Forget positions from `len` on.
    pub fn truncate(&mut self, len: usize) {
        self.truncated |= len < self.len;
        self.len = self.len.min(len);
    }

    /// After a truncation, no head's lazy K/V reach past the cache's length: the validity lists
    /// are read back, clamped and written back in place.
    fn clamp_lazy(&mut self) -> Result<()> {
        if !std::mem::take(&mut self.truncated) || self.lazy.iter().all(Option::is_none) {
            return Ok(());
        }
        let mut v = vec![0u32; self.model.local.n_heads];
        for (_, valid) in self.lazy.iter_mut().flatten() {
            self.dev.download_idx(valid, &mut v)?;
            v.iter_mut().for_each(|x| *x = (*x).min(self.len as u32));
            self.dev.write_idx(valid, &v)?;
        }
        Ok(())
    }
    /// Weight bytes one step reads under the plan (predictors included).
    pub fn step_bytes(&self) -> usize {
        self.step_bytes.total()
    }
    /// The model's config (the whole model's, under tensor parallelism too).
    pub fn config(&self) -> &crate::model::config::ModelConfig {
        &self.model.config
    }
    pub fn plan_name(&self) -> &str {
        &self.plan.name
    }
    /// The plan, the device, and what a decode step and a prompt's batch read and compute.
    pub fn info(&self) -> Result<SessionInfo> {
        Ok(SessionInfo {
            plan: self.plan.name.clone(),
            device: self.dev.name(),
            step: self.last_step()?,
            batch: self.batch_step(),
        })
    }

    /// Run `tokens` at the next positions; returns the logits of the last. A prompt (more than
    /// one token) runs in batches where the plan allows (`batchable`), else one
    /// position at a time, as decode steps do.
    pub fn forward(&mut self, tokens: &[u32]) -> Result<&mut [f32]> {
        self.run(tokens, Logits::Last)
    }

    /// One token at the next position, its logits left on the device.
    fn step(&mut self, token: u32) -> Result<()> {
        self.dev.set_step(&[token], self.len)?;
        if self.graph.is_none() && self.capture.is_none() && self.dev.begin_capture()? {
            let recorded = self.encode();
            let graph = self.dev.end_capture();
            recorded?;
            self.graph = Some(graph?);
        }
        match (&self.graph, &self.capture) {
            (Some(g), None) => self.dev.replay(g)?,
            _ => self.encode()?,
        }
        self.len += 1;
        Ok(())
    }

    /// `tokens` (at least one) fit the context and the position table after what the cache
    /// holds, and are in the vocabulary: checked before any runs, so a bad batch changes nothing.
    fn check(&self, tokens: &[u32]) -> Result<()> {
        let c = &self.model.local;
        if tokens.is_empty() {
            return Err(Error::Invalid("forward called with no tokens".into()));
        }
        let end = self.len + tokens.len();
        if end > self.n_ctx {
            return Err(Error::ContextOverflow {
                n_tokens: end,
                n_ctx: self.n_ctx,
            });
        }
        if let Positions::Learned { offset } = c.positions {
            let rows = self.model.pos_rows;
            if end - 1 + offset >= rows {
                return Err(Error::ContextOverflow {
                    n_tokens: end,
                    n_ctx: rows.saturating_sub(offset),
                });
            }
        }
        match tokens.iter().find(|&&t| t as usize >= c.vocab_size) {
            Some(t) => Err(Error::Invalid(format!(
                "token id {t} out of range (vocab {})",
                c.vocab_size
            ))),
            None => Ok(()),
        }
    }

    /// Run `tokens` eagerly (not replayed), synchronizing the device at every block's end, and
    /// add each block's wall time to `times`. Slower than [`Self::forward`] by the waits; for
    /// where the time goes, not for speed.
    pub fn profile(&mut self, tokens: &[u32], times: &mut BlockTimes) -> Result<()> {
        self.check(tokens)?;
        self.clamp_lazy()?;
        for &t in tokens {
            self.dev.set_step(&[t], self.len)?;
            self.dev.sync()?;
            let mut clock = Some(Clock {
                times: &mut *times,
                at: std::time::Instant::now(),
            });
            self.run_step(&mut clock)?;
            self.len += 1;
            times.steps += 1;
        }
        Ok(())
    }

    /// The verbs of one decode step (run, or recorded).
    fn encode(&mut self) -> Result<()> {
        self.run_step(&mut None)
    }
}

/// Weight bytes one step reads under `plan`, by block: each layer's attention (less the skipped
/// heads' rows) and MLP (less the skipped neurons' rows; a rule that computes a projection in
/// full to select from it reads that one whole), the output head (dense, or the contextual
/// head's candidates' rows and its preview), the predictors, and the rest (embedding rows,
/// OPT's projections).
/// `plan = None`: a batch's (every unit, the dense head, no predictors).
fn step_bytes<D: Device>(m: &DeviceModel<D>, plan: Option<&DevicePlan<D>>) -> StepBytes {
    let c = &m.local;
    let layers: usize = (m.unit_bytes.iter())
        .map(|u| c.n_heads * (u.head + u.kv_head) + c.n_ff * u.neuron)
        .sum();
    let other = m.dense_bytes.saturating_sub(layers + m.head_bytes);
    let Some(p) = plan else {
        let attention = (m.unit_bytes.iter()).map(|u| c.n_heads * (u.head + u.kv_head));
        let attention = attention.sum();
        return StepBytes {
            attention,
            mlp: layers - attention,
            output: m.head_bytes,
            predictors: 0,
            other,
        };
    };
    let (mut attention, mut mlp) = (0, 0);
    for (l, u) in m.unit_bytes.iter().enumerate() {
        let (nm, nh) = (p.mlp[l].count(c.n_ff), p.heads[l].count(c.n_heads));
        let per_head = u.head + if p.lazy_kv { u.kv_head } else { 0 };
        let read_neuron = match p.mlp_rule[l] {
            Computed::Gate => u.gate,
            Computed::Up => u.up,
            Computed::Oracle => u.gate + u.up,
            _ => 0,
        };
        let read_head = match p.head_rule[l] {
            Computed::HeadNorm => u.q + if p.lazy_kv { u.kv_head } else { 0 },
            _ => 0,
        };
        attention += c.n_heads * (u.head + u.kv_head) - (c.n_heads - nh) * (per_head - read_head);
        mlp += c.n_ff * u.neuron - (c.n_ff - nm) * (u.neuron - read_neuron);
    }
    if let (Some(ip), Some(im)) = (&p.inputs, &m.inputs) {
        // Input sparsity: the rows of the kept inputs, at each group's target density; a group
        // kept whole reads the file's rows.
        let widths = [c.d_model, c.n_heads * c.head_dim, c.d_model, c.n_ff];
        let read = |l: usize, g: usize| match ip.thresholds[l][g] < 0.0 {
            true => rows::group_bytes(c, &m.unit_bytes[l], g),
            false => {
                let keep = 1.0 - ip.group_sparsity[g];
                (widths[g] as f64 * keep).round() as usize * im[l].row_bytes[g]
            }
        };
        attention = (0..im.len()).map(|l| read(l, 0) + read(l, 1)).sum();
        mlp = (0..im.len()).map(|l| read(l, 2) + read(l, 3)).sum();
    }
    let output = match &p.output {
        // A share of the head's rows (the candidates), plus the preview.
        Some(o) => m.head_bytes / c.vocab_size.max(1) * o.candidates + o.bytes,
        None => m.head_bytes,
    };
    StepBytes {
        attention,
        mlp,
        output,
        predictors: (p.mlp_pred.iter().chain(&p.head_pred))
            .flatten()
            .map(|p| p.bytes)
            .sum(),
        other,
    }
}

/// Weight bytes of one step, by block (see `step_bytes`).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StepBytes {
    pub attention: usize,
    pub mlp: usize,
    pub output: usize,
    pub predictors: usize,
    /// Embedding rows and OPT's projections.
    pub other: usize,
}

impl StepBytes {
    pub fn total(&self) -> usize {
        self.attention + self.mlp + self.output + self.predictors + self.other
    }
    fn add(&mut self, o: &StepBytes) {
        self.attention += o.attention;
        self.mlp += o.mlp;
        self.output += o.output;
        self.predictors += o.predictors;
        self.other += o.other;
    }
}

impl StepStats {
    /// The ranks' stats of one step summed: the step of a tensor-parallel world.
    pub fn sum(ranks: impl IntoIterator<Item = StepStats>) -> StepStats {
        ranks.into_iter().fold(StepStats::default(), |mut a, r| {
            a.weight_bytes += r.weight_bytes;
            a.mlp_kept += r.mlp_kept;
            a.mlp_total += r.mlp_total;
            a.heads_kept += r.heads_kept;
            a.heads_total += r.heads_total;
            a.exact_logits += r.exact_logits;
            a.bytes.add(&r.bytes);
            a.input_groups += r.input_groups;
            a.input_groups_whole += r.input_groups_whole;
            a
        })
    }
}
