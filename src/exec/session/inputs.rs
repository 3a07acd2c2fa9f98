//! Input sparsity in a decode step (`teal`, `wina`; see [`crate::sparsity::input`]): each
//! projection's input keeps the entries whose score passes the layer's threshold for that input
//! ([`Device::sparsify`], on the device), and the product is [`Device::axpy`] over the
//! input-major matrix, which reads only the rows of the kept entries ([`Device::axpys`]: the
//! products of one input in one launch). Outputs that are not a residual start from zeros
//! ([`Device::clear`]).
use super::step::{first_projections, row_parallel, Pass};
use super::{DeviceSession, Scratch};
use crate::exec::model::{DeviceModel, InputMats};
use crate::sparsity::input::Group;
use crate::Result;
use dejavu_backend_api::{Device, InputMask, Product, Rows};

impl<D: Device> DeviceSession<'_, D> {
    /// Layer `l`'s input thresholds under the plan (`None`: its inputs are dense).
    pub(super) fn input_thresholds(&self, l: usize) -> Option<[f32; 4]> {
        self.plan.inputs.as_ref().map(|p| p.thresholds[l])
    }

    /// `s.sparse` = the kept entries of `x` (`n` values) for layer `l`'s input group `g` at
    /// threshold `t`; counted per layer and group when the session measures.
    fn keep_inputs(&mut self, l: usize, g: Group, t: f32, which: Input) -> Result<()> {
        let (dev, m) = (self.dev, self.model);
        let im = inputs_of(m, l)?;
        let gi = Group::ALL.iter().position(|&x| x == g).unwrap_or(0);
        let wina = self.plan.inputs.as_ref().is_some_and(|p| p.wina);
        let mask = InputMask {
            threshold: t,
            scale: wina.then_some(&im.norms[gi]),
        };
        let s = &mut self.s;
        let (x, n) = match which {
            Input::H => (&s.h, m.local.d_model),
            Input::Att { n } => (&s.att, n),
            Input::Full { n } => (&s.full, n),
            Input::Gate => (&s.gate, m.local.n_ff),
            Input::Up => (&s.up, m.local.n_ff),
        };
        dev.sparsify(x, n, mask, &mut s.sparse)?;
        if self.measure {
            // The kept entries, and the input blocks that hold one (each reads its scale table).
            dev.count_nonzero(&s.sparse, n, 1, &mut s.kept, 4 * l + gi)?;
            if im.table_bytes[gi] > 0 {
                let slot = 4 * (m.local.n_layers + l) + gi;
                dev.count_nonzero(&s.sparse, n, 32, &mut s.kept, slot)?;
            }
        }
        Ok(())
    }

    /// Q (of the plan's heads, compact in `s.q`; of every head when `all_heads`), K and V of
    /// `s.h` at threshold `t`.
    pub(super) fn input_qkv(&mut self, l: usize, t: f32, all_heads: bool) -> Result<()> {
        self.keep_inputs(l, Group::Qkv, t, Input::H)?;
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
            ..
        } = s;
        let qo = match heads {
            Rows::All => &mut *q,
            Rows::Sel { .. } => &mut *full,
        };
        dev.clear(&mut [(&mut *qo, nq), (&mut *k, nkv), (&mut *v, nkv)])?;
        dev.axpys(
            sparse,
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
        self.keep_inputs(l, Group::O, t, which)?;
        let (dev, m) = (self.dev, self.model);
        let (c, lw) = (&m.local, &m.layers[l]);
        let wo_t = &inputs_of(m, l)?.wo;
        let heads = self.plan.heads[l].rows(c.head_dim);
        let s = &mut self.s;
        let y = if out { &mut s.part } else { &mut s.x };
        Ok(dev.axpy(wo_t, heads, &s.sparse, lw.bo.as_ref(), y)?)
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
                self.keep_inputs(l, Group::GateUp, t_in, Input::H)?;
                let s = &mut self.s;
                match &im.gate {
                    Some(gate) => {
                        let Scratch {
                            gate: g,
                            up,
                            sparse,
                            ..
                        } = s;
                        dev.clear(&mut [(&mut *g, ff), (&mut *up, ff)])?;
                        dev.axpys(
                            sparse,
                            &mut [
                                Product::new(gate, Rows::All, g),
                                Product::new(&im.up, Rows::All, up),
                            ],
                        )?;
                        dev.glu(act, &mut s.gate, &s.up, ff)?;
                    }
                    None => {
                        dev.clear(&mut [(&mut s.up, ff)])?;
                        dev.axpy(&im.up, Rows::All, &s.sparse, lw.b_up.as_ref(), &mut s.up)?;
                        dev.activate(act, &mut s.up, ff)?;
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
        self.keep_inputs(l, Group::Down, t_down, a)?;
        let down_t = &inputs_of(m, l)?.down;
        let s = &mut self.s;
        let y = if out { &mut s.part } else { &mut s.x };
        Ok(dev.axpy(down_t, Rows::All, &s.sparse, lw.b_down.as_ref(), y)?)
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

fn inputs_of<D: Device>(m: &DeviceModel<D>, l: usize) -> Result<&InputMats<D>> {
    (m.inputs.as_ref().and_then(|v| v.get(l)))
        .ok_or_else(|| crate::Error::Invalid("the model has no input-major layout".into()))
}
