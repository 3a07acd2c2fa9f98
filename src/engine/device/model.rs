//! Every weight of a model on the device.
use crate::engine::config::ModelConfig;
use crate::engine::weights::{Model, NormWeights, WeightRef};
use crate::sparsity::layout::SparseLayout;
use crate::{Error, Result};
use dejavu_backend_api::Device;

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
    pub(super) ffn_norm: Norm<D>,
    pub(super) w_gate: Option<D::Mat>,
    pub(super) w_up: D::Mat,
    pub(super) b_up: Option<D::Buf>,
    pub(super) w_down: D::Mat,
    pub(super) b_down: Option<D::Buf>,
}

/// Every weight of a model on the device (plus, for sparse plans, the neuron-major down
/// projections and head-major W_o of the [`SparseLayout`]).
pub struct DeviceModel<D: Device> {
    pub config: ModelConfig,
    pub(super) token_embd: D::Mat,
    pub(super) pos_embd: Option<D::Mat>,
    /// Rows of the learned position table (0 without one).
    pub(super) pos_rows: usize,
    pub(super) proj_in: Option<D::Mat>,
    pub(super) proj_out: Option<D::Mat>,
    pub(super) output_norm: Option<Norm<D>>,
    /// The output head; `None` when it is the token embedding (tied), uploaded once.
    pub(super) output: Option<D::Mat>,
    /// Bytes of the output head's matrix (what the contextual head reads a share of).
    pub(super) head_bytes: usize,
    pub(super) layers: Vec<Layer<D>>,
    /// Per layer `(down_t, wo_t)`.
    pub(super) sparse: Option<Vec<(D::Mat, D::Mat)>>,
    /// Weight bytes of a dense step, and per layer those of one MLP neuron (its rows of the
    /// MLP's matrices) and of one head (its rows of W_q and W_o), for the step's byte count.
    pub(super) dense_bytes: usize,
    /// ... and of one head's rows of W_k and W_v (read only for the selected heads under lazy
    /// K/V).
    pub(super) unit_bytes: Vec<(usize, usize, usize)>,
}

impl<D: Device> DeviceModel<D> {
    /// Weight bytes a dense step reads (every matrix, one embedding row).
    pub fn dense_bytes(&self) -> usize {
        self.dense_bytes
    }

    /// The output head's matrix.
    pub(super) fn head(&self) -> &D::Mat {
        self.output.as_ref().unwrap_or(&self.token_embd)
    }

    /// Upload `model` (in its file's row layout: load it without repacking) and, when given,
    /// the sparse layout that sparse plans read.
    pub fn upload(dev: &D, model: &Model, layout: Option<&SparseLayout>) -> Result<Self> {
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
        let mat = |w: &WeightRef| Ok::<_, Error>(dev.upload_mat(&model.weight(w))?);
        let vec = |v: &Option<Vec<f32>>| v.as_deref().map(|v| dev.upload(v)).transpose();
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
                wq: mat(&lw.wq)?,
                wk: mat(&lw.wk)?,
                wv: mat(&lw.wv)?,
                bq: vec(&lw.bq)?,
                bk: vec(&lw.bk)?,
                bv: vec(&lw.bv)?,
                wo: mat(&lw.wo)?,
                bo: vec(&lw.bo)?,
                ffn_norm: norm(&lw.ffn_norm)?,
                w_gate: lw.w_gate.as_ref().map(mat).transpose()?,
                w_up: mat(&lw.w_up)?,
                b_up: vec(&lw.b_up)?,
                w_down: mat(&lw.w_down)?,
                b_down: vec(&lw.b_down)?,
            });
            progress.inc(1);
        }
        let sparse = match layout {
            Some(lay) => Some(
                (0..model.layers.len())
                    .map(|l| {
                        Ok((
                            dev.upload_mat(&lay.down_t(l))?,
                            dev.upload_mat(&lay.wo_t(l))?,
                        ))
                    })
                    .collect::<Result<Vec<_>>>()?,
            ),
            None => None,
        };
        progress.finish_and_clear();
        Ok(Self {
            config: model.config.clone(),
            token_embd: mat(&model.token_embd)?,
            pos_embd: model.pos_embd.as_ref().map(mat).transpose()?,
            pos_rows: model.pos_embd.as_ref().map_or(0, |p| p.rows),
            proj_in: model.proj_in.as_ref().map(mat).transpose()?,
            proj_out: model.proj_out.as_ref().map(mat).transpose()?,
            output_norm: model.output_norm.as_ref().map(norm).transpose()?,
            head_bytes: model.output.n_bytes(),
            output: match model.output.location() == model.token_embd.location() {
                true => None,
                false => Some(mat(&model.output)?),
            },
            layers,
            sparse,
            dense_bytes: model.dense_bytes_per_token(),
            unit_bytes: model
                .layers
                .iter()
                .map(|lw| {
                    let mlp = lw.w_gate.as_ref().map_or(0, |w| w.n_bytes())
                        + lw.w_up.n_bytes()
                        + lw.w_down.n_bytes();
                    let c = &model.config;
                    (
                        mlp / c.n_ff,
                        (lw.wq.n_bytes() + lw.wo.n_bytes()) / c.n_heads,
                        (lw.wk.n_bytes() + lw.wv.n_bytes()) / c.n_heads,
                    )
                })
                .collect(),
        })
    }
}
