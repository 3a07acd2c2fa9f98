//! The CPU backend. Kernels live one operation per file, each with its scalar reference
//! (`dequant`, `vec_dot`, `matmul`, `ops`, `attention`); per-ISA tiers dispatched at run time
//! plug in beside the references.
pub mod attention;
pub mod dequant;
pub mod matmul;
pub mod ops;
pub mod vec_dot;

use dejavu_backend_api::{AttnShape, Backend, IndexSet, QuantType, RopeStyle, Weight};

/// CPU backend; threads come from the rayon pool the caller installs.
#[derive(Debug, Default, Clone)]
pub struct CpuBackend;

impl Backend for CpuBackend {
    fn name(&self) -> String {
        "cpu (scalar reference)".into()
    }
    fn supports(&self, _qtype: QuantType) -> bool {
        true
    }
    fn matmul(&self, w: &Weight, rows: &IndexSet, x: &[f32], y: &mut [f32]) {
        matmul::matmul(w, rows, x, y)
    }
    fn dequantize_row(&self, w: &Weight, r: usize, out: &mut [f32]) {
        dequant::dequantize_row(w.qtype, w.row(r), out)
    }
    fn rmsnorm(&self, x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
        ops::rmsnorm(x, weight, eps, out)
    }
    fn rope(
        &self,
        x: &mut [f32],
        n_heads: usize,
        head_dim: usize,
        pos0: usize,
        theta: f32,
        style: RopeStyle,
    ) {
        ops::rope(x, n_heads, head_dim, pos0, theta, style)
    }
    fn silu_mul(&self, gate: &mut [f32], up: &[f32]) {
        ops::silu_mul(gate, up)
    }
    fn attention(
        &self,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        heads: &IndexSet,
        shape: AttnShape,
        out: &mut [f32],
    ) {
        attention::attention(q, k, v, heads, shape, out)
    }
}
