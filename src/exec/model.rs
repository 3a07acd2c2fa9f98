//! Every weight of a model on the device.
use crate::exec::parallel::Shard;
use crate::model::config::ModelConfig;
use crate::model::weights::{Model, NormWeights, WeightRef};
use crate::sparsity::input::{Group, InputNorms};
use crate::sparsity::layout::{Kind, Part, SparseLayout};
use crate::{Error, Result};
use dejavu_backend_api::{input_block_table_bytes, Device, Rotary, RowLayout, Weight};
use std::ops::Range;

/// A norm's gain and bias on the device.
pub(super) struct Norm<D: Device> {
    pub(super) w: D::Buf,
    pub(super) b: Option<D::Buf>,
}

pub(super) struct Layer<D: Device> {
    pub(super) attn_norm: Norm<D>,
    pub(super) wq: D::Mat,
    pub(super) wk: D::Mat,
    pub(super) wv: D::Mat,
    pub(super) bq: Option<D::Buf>,
    pub(super) bk: Option<D::Buf>,
    pub(super) bv: Option<D::Buf>,
    pub(super) wo: D::Mat,
    pub(super) bo: Option<D::Buf>,
    /// The per-head RMSNorm gains of Q and K (qwen3), every head's the same `head_dim`.
    pub(super) q_norm: Option<D::Buf>,
    pub(super) k_norm: Option<D::Buf>,
    pub(super) ffn_norm: Norm<D>,
    pub(super) w_gate: Option<D::Mat>,
    pub(super) w_up: D::Mat,
    pub(super) b_up: Option<D::Buf>,
    pub(super) w_down: D::Mat,
    pub(super) b_down: Option<D::Buf>,
    /// Norms of the attention block's and the MLP's outputs (Gemma), before the residual add.
    pub(super) post_attn_norm: Option<Norm<D>>,
    pub(super) post_ffn_norm: Option<Norm<D>>,
}

/// Input sparsity's matrices of one layer (`teal`, `wina`): every projection input-major, and
/// per input [`Group`] the norms of its weight rows (WINA's scales), the bytes of one input's
/// rows, and of the scale tables of one block of 32 inputs where the matrices are input blocks
/// (0 otherwise; an input's rows hold a 32nd of them).
pub(super) struct InputMats<D: Device> {
    pub(super) q: D::Mat,
    pub(super) k: D::Mat,
    pub(super) v: D::Mat,
    pub(super) wo: D::Mat,
    pub(super) gate: Option<D::Mat>,
    pub(super) up: D::Mat,
    pub(super) down: D::Mat,
    pub(super) norms: [D::Buf; 4],
    pub(super) row_bytes: [usize; 4],
    pub(super) table_bytes: [usize; 4],
}

impl<D: Device> InputMats<D> {
    /// The matrices of input group `g` (in `Group::ALL` order: Q, K and V; W_o; gate and up;
    /// down).
    pub(super) fn group(&self, g: usize) -> Vec<&D::Mat> {
        match g {
            0 => vec![&self.q, &self.k, &self.v],
            1 => vec![&self.wo],
            2 => self.gate.iter().chain([&self.up]).collect(),
            _ => vec![&self.down],
        }
    }
}

/// Every weight of a model on the device (plus, for sparse plans, the neuron-major down
/// projections and head-major W_o of the [`SparseLayout`]); under tensor parallelism, one
/// rank's [`Shard`] of them.
pub struct DeviceModel<D: Device> {
    /// The whole model's config.
    pub config: ModelConfig,
    /// The shapes of the layers held here: `config` for the whole model, a rank's share of the
    /// heads and neurons for a shard ([`Shard::local_config`]).
    pub(super) local: ModelConfig,
    pub(super) shard: Shard,
    pub(super) token_embd: D::Mat,
    pub(super) pos_embd: Option<D::Mat>,
    /// Rows of the learned position table (0 without one).
    pub(super) pos_rows: usize,
    pub(super) proj_in: Option<D::Mat>,
    pub(super) proj_out: Option<D::Mat>,
    pub(super) output_norm: Option<Norm<D>>,
    /// Llama 3's RoPE frequency divisors (`head_dim / 2`).
    pub(super) rope_factors: Option<D::Buf>,
    /// The output head; `None` when it is the token embedding (tied), uploaded once.
    pub(super) output: Option<D::Mat>,
    /// Bytes of the output head's matrix (what the contextual head reads a share of).
    pub(super) head_bytes: usize,
    pub(super) layers: Vec<Layer<D>>,
    /// Per layer `(down_t, wo_t)`.
    pub(super) sparse: Option<Vec<(D::Mat, D::Mat)>>,
    /// Per layer, input sparsity's matrices ([`DeviceModel::attach_inputs`]).
    pub(super) inputs: Option<Vec<InputMats<D>>>,
    /// Weight bytes of a dense step, and per layer those of one MLP neuron (its rows of the
    /// MLP's matrices) and of one head (its rows of W_q and W_o), for the step's byte count.
    pub(super) dense_bytes: usize,
    /// ... and of one head's rows of W_k and W_v (read only for the selected heads under lazy
    /// K/V).
    pub(super) unit_bytes: Vec<UnitBytes>,
}

/// Weight bytes of one unit of a layer: a neuron's rows of every MLP matrix (and of the gate
/// and up projections alone), a head's rows of W_q and W_o (and of W_q alone), and of W_k and
/// W_v.
#[derive(Debug, Clone, Copy)]
pub(super) struct UnitBytes {
    pub(super) neuron: usize,
    pub(super) gate: usize,
    pub(super) up: usize,
    pub(super) head: usize,
    pub(super) q: usize,
    pub(super) kv_head: usize,
}

impl<D: Device> DeviceModel<D> {
    /// Weight bytes a dense step reads (every matrix, one embedding row).
    pub fn dense_bytes(&self) -> usize {
        self.dense_bytes
    }

    /// Whether a block's output goes to a partial buffer before the residual: under tensor
    /// parallelism (to be summed over the ranks) or to be normed first (Gemma).
    pub(super) fn partial_outputs(&self) -> bool {
        !self.shard.is_whole() || self.local.post_norms
    }

    /// Layer `l`'s RoPE parameters on the device (`None`: learned positions): the model's base
    /// and scaling, or on a sliding-window layer of a model with a local base (Gemma 3) that
    /// base, unscaled.
    pub(super) fn rotary(&self, l: usize) -> Option<Rotary<'_, D::Buf>> {
        let (theta, style) = self.local.rope()?;
        let local = self.local.attn.local.get(l) == Some(&true);
        Some(match (local, self.local.local_rope_theta) {
            (true, Some(theta)) => Rotary {
                theta,
                style,
                factors: None,
            },
            _ => Rotary {
                theta,
                style,
                factors: self.rope_factors.as_ref(),
            },
        })
    }

    /// Attach input sparsity's input-major matrices (`layout`, of [`Kind::Inputs`]) and WINA's
    /// norms to a whole model.
    pub fn attach_inputs(
        &mut self,
        dev: &D,
        layout: &SparseLayout,
        norms: &InputNorms,
    ) -> Result<()> {
        if !self.shard.is_whole() || layout.kind() != Kind::Inputs {
            return Err(Error::Invalid(
                "input sparsity runs on a whole model (not under tensor parallelism)".into(),
            ));
        }
        let c = &self.local;
        if norms.layers.len() != c.n_layers {
            return Err(Error::Invalid("input norms of another model".into()));
        }
        let owner = layout.owner();
        let mut out = Vec::with_capacity(c.n_layers);
        for (l, nl) in norms.layers.iter().enumerate() {
            let get = |p: Part| -> Result<Weight<'_>> {
                (layout.get(l, p)).ok_or_else(|| Error::Invalid(format!("no {p:?} in the layout")))
            };
            let share = |p: Part| -> Result<D::Mat> { Ok(dev.share_mat(&get(p)?, &owner)?) };
            let bytes = |p: Part| get(p).map_or(0, |w| w.qtype.row_bytes(w.cols));
            let gate = match c.mlp.gated() {
                true => Some(share(Part::Gate)?),
                false => None,
            };
            let table = |p: Part| {
                get(p).map_or(0, |w| match w.layout {
                    RowLayout::InputBlocks => input_block_table_bytes(w.qtype, w.cols),
                    _ => 0,
                })
            };
            let sum = |f: &dyn Fn(Part) -> usize| {
                Group::ALL.map(|g| g.parts().iter().map(|&p| f(p)).sum())
            };
            let (row_bytes, table_bytes) = (sum(&bytes), sum(&table));
            let widths = [c.d_model, c.n_heads * c.head_dim, c.d_model, c.n_ff];
            for (g, (n, w)) in nl.iter().zip(widths).enumerate() {
                if n.len() != w {
                    return Err(Error::Invalid(format!(
                        "layer {l}: {} norms of input group {g}, width {w}",
                        n.len()
                    )));
                }
            }
            out.push(InputMats {
                q: share(Part::Q)?,
                k: share(Part::K)?,
                v: share(Part::V)?,
                wo: share(Part::Wo)?,
                gate,
                up: share(Part::Up)?,
                down: share(Part::Down)?,
                norms: [
                    dev.upload(&nl[0])?,
                    dev.upload(&nl[1])?,
                    dev.upload(&nl[2])?,
                    dev.upload(&nl[3])?,
                ],
                row_bytes,
                table_bytes,
            });
        }
        self.inputs = Some(out);
        Ok(())
    }

    /// The output head's matrix.
    pub(super) fn head(&self) -> &D::Mat {
        self.output.as_ref().unwrap_or(&self.token_embd)
    }

    /// Upload `model` (a GPU reads its file's row layout: load it without repacking; the CPU
    /// reads either) and, when given, the sparse layout that sparse plans read.
    pub fn upload(dev: &D, model: &Model, layout: Option<&SparseLayout>) -> Result<Self> {
        Self::upload_shard(dev, model, layout, Shard::WHOLE)
    }

    /// Upload rank `shard.rank`'s share of `model` (see [`crate::exec::parallel`]): its heads'
    /// rows of W_q, W_k and W_v and columns of W_o, its neurons' rows of fc1 and columns of fc2,
    /// its vocabulary rows of the embedding and the head; W_o's and fc2's biases on rank 0.
    pub fn upload_shard(
        dev: &D,
        model: &Model,
        layout: Option<&SparseLayout>,
        shard: Shard,
    ) -> Result<Self> {
        if let Some(w) = model
            .matrices()
            .into_iter()
            .find(|w| !dev.supports(w.qtype))
        {
            return Err(Error::UnsupportedType {
                tensor: w.name.clone(),
                qtype: format!("{} on {}", w.qtype.name(), dev.name()),
            });
        }
        if dev.world() != (shard.rank, shard.world) {
            return Err(Error::Invalid(format!(
                "rank {} of {} uploaded to a device of rank {:?}",
                shard.rank,
                shard.world,
                dev.world()
            )));
        }
        let c = &model.config;
        let local = shard.local_config(c)?;
        let hd = c.head_dim;
        let (heads, kv) = (shard.part(c.n_heads), shard.part(c.n_kv_heads));
        let (q_rows, kv_rows) = (heads.start * hd..heads.end * hd, kv.start * hd..kv.end * hd);
        let (neurons, vocab) = (shard.part(c.n_ff), shard.vocab(c.vocab_size));
        // Bytes of the matrices a dense step reads here (layers and head).
        let read = std::cell::Cell::new(0usize);
        // Whole matrices and row ranges are read in place where the device can (host memory).
        let share = |w: &WeightRef, part: &Weight| dev.share_mat(part, &model.owner(w));
        let mat = |w: &WeightRef| Ok::<_, Error>(share(w, &model.weight(w))?);
        let rows = |w: &WeightRef, r: &Range<usize>| {
            let part = model.weight(w).row_range(r.clone())?;
            read.set(read.get() + part.data.len());
            Ok::<_, Error>(share(w, &part)?)
        };
        let cols = |w: &WeightRef, r: &Range<usize>| {
            let whole = model.weight(w);
            read.set(read.get() + whole.qtype.row_bytes(r.len()) * whole.rows);
            if r.len() == whole.cols {
                return Ok::<_, Error>(share(w, &whole)?);
            }
            let bytes = whole.col_range(r.clone()).map_err(|e| {
                Error::Invalid(format!("{} split over {} ranks: {e}", w.name, shard.world))
            })?;
            let part = Weight::new(whole.qtype, whole.rows, r.len(), &bytes)?;
            Ok(dev.upload_mat(&part)?)
        };
        let vec = |v: &Option<Vec<f32>>| v.as_deref().map(|v| dev.upload(v)).transpose();
        let part = |v: &Option<Vec<f32>>, r: &Range<usize>| {
            (v.as_deref().map(|v| dev.upload(&v[r.clone()]))).transpose()
        };
        // Row-parallel outputs: the bias once, on rank 0.
        let once = |v: &Option<Vec<f32>>| match shard.rank {
            0 => vec(v),
            _ => Ok(None),
        };
        let norm = |n: &NormWeights| {
            Ok::<_, Error>(Norm {
                w: dev.upload(&n.weight)?,
                b: vec(&n.bias)?,
            })
        };
        let progress = crate::progress::bar(model.layers.len() as u64, "upload");
        let mut layers = Vec::with_capacity(model.layers.len());
        for lw in &model.layers {
            layers.push(Layer {
                attn_norm: norm(&lw.attn_norm)?,
                wq: rows(&lw.wq, &q_rows)?,
                wk: rows(&lw.wk, &kv_rows)?,
                wv: rows(&lw.wv, &kv_rows)?,
                bq: part(&lw.bq, &q_rows)?,
                bk: part(&lw.bk, &kv_rows)?,
                bv: part(&lw.bv, &kv_rows)?,
                wo: cols(&lw.wo, &q_rows)?,
                bo: once(&lw.bo)?,
                q_norm: vec(&lw.q_norm)?,
                k_norm: vec(&lw.k_norm)?,
                ffn_norm: norm(&lw.ffn_norm)?,
                w_gate: (lw.w_gate.as_ref().map(|w| rows(w, &neurons))).transpose()?,
                w_up: rows(&lw.w_up, &neurons)?,
                b_up: part(&lw.b_up, &neurons)?,
                w_down: cols(&lw.w_down, &neurons)?,
                b_down: once(&lw.b_down)?,
                post_attn_norm: lw.post_attn_norm.as_ref().map(norm).transpose()?,
                post_ffn_norm: lw.post_ffn_norm.as_ref().map(norm).transpose()?,
            });
            progress.inc(1);
        }
        let sparse = match layout {
            Some(lay) => Some(
                (0..model.layers.len())
                    .map(|l| {
                        let owner = lay.owner();
                        let down = lay.down_t(l).row_range(neurons.clone())?;
                        let wo = lay.wo_t(l).row_range(q_rows.clone())?;
                        Ok((dev.share_mat(&down, &owner)?, dev.share_mat(&wo, &owner)?))
                    })
                    .collect::<Result<Vec<_>>>()?,
            ),
            None => None,
        };
        progress.finish_and_clear();
        let tied = model.output.location() == model.token_embd.location();
        let layer_bytes = read.replace(0);
        let token_embd = rows(&model.token_embd, &vocab)?;
        let output = match tied {
            true => None,
            false => Some(rows(&model.output, &vocab)?),
        };
        let head_bytes = match tied {
            true => read.get(),
            false => read.get() - model.token_embd.qtype.row_bytes(c.d_embed) * vocab.len(),
        };
        let projections: usize = model.projections().map(|w| w.n_bytes()).sum();
        let row = |w: &WeightRef| w.qtype.row_bytes(w.cols);
        Ok(Self {
            config: c.clone(),
            local,
            shard,
            token_embd,
            pos_embd: model.pos_embd.as_ref().map(mat).transpose()?,
            pos_rows: model.pos_embd.as_ref().map_or(0, |p| p.rows),
            proj_in: model.proj_in.as_ref().map(mat).transpose()?,
            proj_out: model.proj_out.as_ref().map(mat).transpose()?,
            output_norm: model.output_norm.as_ref().map(norm).transpose()?,
            rope_factors: (model.rope_factors.as_deref())
                .map(|f| dev.upload(f))
                .transpose()?,
            head_bytes,
            output,
            layers,
            sparse,
            inputs: None,
            dense_bytes: layer_bytes
                + head_bytes
                + projections
                + row(&model.token_embd)
                + model.pos_embd.as_ref().map_or(0, row),
            unit_bytes: model
                .layers
                .iter()
                .map(|lw| {
                    let gate = lw.w_gate.as_ref().map_or(0, |w| w.n_bytes());
                    let mlp = gate + lw.w_up.n_bytes() + lw.w_down.n_bytes();
                    let c = &model.config;
                    UnitBytes {
                        neuron: mlp / c.n_ff,
                        gate: gate / c.n_ff,
                        up: lw.w_up.n_bytes() / c.n_ff,
                        head: (lw.wq.n_bytes() + lw.wo.n_bytes()) / c.n_heads,
                        q: lw.wq.n_bytes() / c.n_heads,
                        kv_head: (lw.wk.n_bytes() + lw.wv.n_bytes()) / c.n_heads,
                    }
                })
                .collect(),
        })
    }
}
