//! Input sparsity in a decode step (`teal`, `wina`; see [`crate::sparsity::input`]): each
//! projection's input keeps the entries whose score passes the layer's threshold for that input,
//! and the product is [`Device::axpys`] over the input-major matrix, which reads only the rows
//! of the kept entries (the products of one input in one launch). A session that measures
//! writes the kept entries first ([`Device::sparsify`], to count them); one that does not hands
//! the threshold to the product (one launch fewer a projection on the GPU). Outputs that are
//! not a residual start from zeros ([`Device::clear`]).
use super::step::{first_projections, row_parallel, Pass};
use super::{DeviceSession, Scratch};
use crate::exec::model::{DeviceModel, InputMats};
use crate::model::config::ModelConfig;
use crate::sparsity::input::Group;
use crate::Result;
use dejavu_backend_api::{Device, InputMask, Product, Rows};

impl<'a, D: Device> DeviceSession<'a, D> {
    /// Layer `l`'s input thresholds under the plan (`None`: its inputs are dense).
    pub(super) fn input_thresholds(&self, l: usize) -> Option<[f32; 4]> {
        self.plan.inputs.as_ref().map(|p| p.thresholds[l])
    }

    /// Layer `l`'s input group `g` at threshold `t`, of the input `which`: when the session
    /// measures, `s.sparse` = the kept entries (counted per layer and group) and `None`: the
    /// products read `s.sparse`; else the mask that the products apply to `which` themselves.
    fn keep_inputs(
        &mut self,
        l: usize,
        g: Group,
        t: f32,
        which: Input,
    ) -> Result<Option<InputMask<'a, D::Buf>>> {
        let (dev, m) = (self.dev, self.model);
        let im = inputs_of(m, l)?;
        let gi = Group::ALL.iter().position(|&x| x == g).unwrap_or(0);
        let wina = self.plan.inputs.as_ref().is_some_and(|p| p.wina);
        let mask = InputMask {
            threshold: t,
            scale: wina.then_some(&im.norms[gi]),
        };
        if !self.measure {
            return Ok(Some(mask));
        }
        let (p, n) = (Parts::of(&mut self.s, which), which.len(&m.local));
        dev.sparsify(p.input, n, mask, p.sparse)?;
        // The kept entries, and the input blocks that hold one (each reads its scale table).
        dev.count_nonzero(p.sparse, n, 1, p.kept, 4 * l + gi)?;
        if im.table_bytes[gi] > 0 {
            let slot = 4 * (m.local.n_layers + l) + gi;
            dev.count_nonzero(p.sparse, n, 32, p.kept, slot)?;
        }
        Ok(None)
    }

    /// Q (of the plan's heads, compact in `s.q`; of every head when `all_heads`), K and V of
    /// `s.h` at threshold `t`.
    pub(super) fn input_qkv(&mut self, l: usize, t: f32, all_heads: bool) -> Result<()> {
        let mask = self.keep_inputs(l, Group::Qkv, t, Input::H)?;
        let (dev, m) = (self.dev, self.model);
        let (c, lw, im) = (&m.local, &m.layers[l], inputs_of(m, l)?);
        let s = &mut self.s;
        let hd = c.head_dim;
        let heads = match all_heads {
            true => Rows::All,
            false => self.plan.heads[l].rows(hd),
        };
        // Every head's queries (a column of the input-major W_q holds them all); under a
        // selection into `s.full`, then the selected heads' gathered.
        let (nq, nkv) = (c.n_heads * hd, c.kv_dim());
        let Scratch {
            q,
            k,
            v,
            full,
            sparse,
            h,
            ..
        } = s;
        let qo = match heads {
            Rows::All => &mut *q,
            Rows::Sel { .. } => &mut *full,
        };
        dev.clear(&mut [(&mut *qo, nq), (&mut *k, nkv), (&mut *v, nkv)])?;
        dev.axpys(
            if mask.is_some() { h } else { sparse },
            mask,
            &mut [
                Product::new(&im.q, Rows::All, qo).bias(lw.bq.as_ref()),
                Product::new(&im.k, Rows::All, k).bias(lw.bk.as_ref()),
                Product::new(&im.v, Rows::All, v).bias(lw.bv.as_ref()),
            ],
        )?;
        if let Rows::Sel { idx, count, .. } = heads {
            dev.gather(full, idx, count, hd, q)?;
        }
        Ok(())
    }

    /// W_o of the attention output (`att`: `s.att`, or `s.full` for a rule that gathered the
    /// kept heads there; `n` values, the heads of `heads`) at threshold `t`, added to `y`.
    pub(super) fn input_wo(
        &mut self,
        l: usize,
        t: f32,
        gathered: bool,
        n: usize,
        out: bool,
    ) -> Result<()> {
        let which = match gathered {
            true => Input::Full { n },
            false => Input::Att { n },
        };
        let mask = self.keep_inputs(l, Group::O, t, which)?;
        let (dev, m) = (self.dev, self.model);
        let (c, lw) = (&m.local, &m.layers[l]);
        let wo_t = &inputs_of(m, l)?.wo;
        let heads = self.plan.heads[l].rows(c.head_dim);
        let (a, y) = Parts::of(&mut self.s, which).product(mask.is_some(), out);
        let p = Product::new(wo_t, heads, y).bias(lw.bo.as_ref());
        Ok(dev.axpys(a, mask, &mut [p])?)
    }

    /// The MLP of `s.h` at thresholds `t_in` (gate and up) and `t_down` (the down
    /// projection), added to `s.part` (`out`) or the residual; a group without a threshold
    /// (`None`: kept whole) through the dense products over the file's rows.
    pub(super) fn input_mlp(
        &mut self,
        l: usize,
        t_in: Option<f32>,
        t_down: Option<f32>,
        out: bool,
    ) -> Result<()> {
        let (dev, m) = (self.dev, self.model);
        let (c, lw, im) = (&m.local, &m.layers[l], inputs_of(m, l)?);
        let (ff, act) = (c.n_ff, c.mlp.activation());
        let gated = lw.w_gate.is_some();
        match t_in {
            None => {
                first_projections(dev, c, lw, Rows::All, ff, Pass::Step, &mut self.s)?;
            }
            Some(t_in) => {
                let mask = self.keep_inputs(l, Group::GateUp, t_in, Input::H)?;
                let Scratch {
                    gate: g,
                    up,
                    sparse,
                    h,
                    ..
                } = &mut self.s;
                let a = if mask.is_some() { &*h } else { &*sparse };
                match &im.gate {
                    Some(gate) => {
                        dev.clear(&mut [(&mut *g, ff), (&mut *up, ff)])?;
                        dev.axpys(
                            a,
                            mask,
                            &mut [
                                Product::new(gate, Rows::All, g),
                                Product::new(&im.up, Rows::All, up),
                            ],
                        )?;
                        dev.glu(act, g, up, ff)?;
                    }
                    None => {
                        dev.clear(&mut [(&mut *up, ff)])?;
                        let p = Product::new(&im.up, Rows::All, up).bias(lw.b_up.as_ref());
                        dev.axpys(a, mask, &mut [p])?;
                        dev.activate(act, up, ff)?;
                    }
                }
            }
        }
        let a = if gated { Input::Gate } else { Input::Up };
        let Some(t_down) = t_down else {
            let s = &mut self.s;
            let a = if gated { &s.gate } else { &s.up };
            let y = if out { &mut s.part } else { &mut s.x };
            return row_parallel(dev, &lw.w_down, lw.b_down.as_ref(), a, y, out, Pass::Step);
        };
        let mask = self.keep_inputs(l, Group::Down, t_down, a)?;
        let down_t = &inputs_of(m, l)?.down;
        let (a, y) = Parts::of(&mut self.s, a).product(mask.is_some(), out);
        let p = Product::new(down_t, Rows::All, y).bias(lw.b_down.as_ref());
        Ok(dev.axpys(a, mask, &mut [p])?)
    }
}

impl<D: Device> DeviceSession<'_, D> {
    /// See [`crate::exec::Decoder::mask_batches`]: a `teal` plan only (WINA scales each entry
    /// by its column's norm, which a batch's rows would need repeated).
    pub fn mask_batches(&mut self, on: bool) -> Result<()> {
        match &self.plan.inputs {
            Some(p) if on && p.wina => Err(crate::Error::Invalid(
                "masked batches: `teal` thresholds only, not `wina`".into(),
            )),
            None if on => Err(crate::Error::Invalid(
                "masked batches: the plan has no input thresholds (`teal:S`)".into(),
            )),
            _ => {
                self.mask_batches = on;
                Ok(())
            }
        }
    }

    /// Layer `l`'s thresholds for a batch of the pass (`None`: a decode step, or a batch that
    /// is not masked).
    pub(super) fn batch_thresholds(&self, l: usize, step: bool) -> Option<[f32; 4]> {
        match step || !self.mask_batches {
            true => None,
            false => self.input_thresholds(l),
        }
    }

    /// A masked batch's `rows` rows of `which` with every entry of magnitude at most `t`
    /// zeroed (through a free buffer of the same rows, then swapped in; the recorded step, if
    /// any, is dropped).
    pub(super) fn mask_rows(&mut self, t: f32, which: Masked, rows: usize) -> Result<()> {
        let (dev, c) = (self.dev, &self.model.local);
        let mask = InputMask {
            threshold: t,
            scale: None,
        };
        let s = &mut self.s;
        let (x, free, n) = match which {
            Masked::H => (&mut s.h, &mut s.e, c.d_model),
            Masked::Att => (&mut s.att, &mut s.q, c.n_heads * c.head_dim),
            Masked::Act { gated: true } => (&mut s.gate, &mut s.up, c.n_ff),
            Masked::Act { gated: false } => (&mut s.up, &mut s.gate, c.n_ff),
        };
        dev.sparsify(x, rows * n, mask, free)?;
        std::mem::swap(x, free);
        // A recorded decode step names the buffers as they were: record it again.
        self.forget_graphs();
        Ok(())
    }
}

/// What [`DeviceSession::mask_rows`] masks: the block's normed input `h` (its row buffer
/// `e` free during the layers), the attention output (`q` free after attention), or the MLP
/// activation (`gate` after the GLU, with `up` free; `up` for an ungated MLP).
#[derive(Clone, Copy)]
pub(super) enum Masked {
    H,
    Att,
    Act { gated: bool },
}

/// Which buffer [`DeviceSession::keep_inputs`] reads.
#[derive(Clone, Copy)]
enum Input {
    H,
    Att { n: usize },
    Full { n: usize },
    Gate,
    Up,
}

impl Input {
    /// Its entries in a step of model `c`.
    fn len(self, c: &ModelConfig) -> usize {
        match self {
            Input::H => c.d_model,
            Input::Att { n } | Input::Full { n } => n,
            Input::Gate | Input::Up => c.n_ff,
        }
    }
}

/// The buffers of one input-sparse product, borrowed apart from the scratch.
struct Parts<'s, B> {
    /// The input itself, `s.sparse`, the kept-entry counts, `s.part` and the residual.
    input: &'s B,
    sparse: &'s mut B,
    kept: &'s mut B,
    part: &'s mut B,
    x: &'s mut B,
}

impl<'s, B> Parts<'s, B> {
    fn of<D: Device<Buf = B>>(s: &'s mut Scratch<D>, which: Input) -> Self {
        let Scratch {
            h,
            att,
            full,
            gate,
            up,
            sparse,
            kept,
            part,
            x,
            ..
        } = s;
        let input = match which {
            Input::H => &*h,
            Input::Att { .. } => &*att,
            Input::Full { .. } => &*full,
            Input::Gate => &*gate,
            Input::Up => &*up,
        };
        Parts {
            input,
            sparse,
            kept,
            part,
            x,
        }
    }

    /// A row-parallel product's coefficients (the input under a mask, or `sparse`) and its
    /// output (`part`, or the residual).
    fn product(self, masked: bool, out: bool) -> (&'s B, &'s mut B) {
        let a = if masked { self.input } else { &*self.sparse };
        (a, if out { self.part } else { self.x })
    }
}

fn inputs_of<D: Device>(m: &DeviceModel<D>, l: usize) -> Result<&InputMats<D>> {
    (m.inputs.as_ref().and_then(|v| v.get(l)))
        .ok_or_else(|| crate::Error::Invalid("the model has no input-major layout".into()))
}
