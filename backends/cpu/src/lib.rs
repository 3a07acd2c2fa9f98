//! The CPU backend. Kernels live one operation per file, each with its scalar reference: the
//! f32 references (`dequant`, `vec_dot`, `ops`, `attention`) and the per-ISA integer kernels
//! (`kernels/`, chosen at run time by `isa`); `matmul` drives them.
pub mod attention;
mod attention_prompt;
pub mod axpy_matmul;
pub mod dequant;
pub mod device;
pub mod isa;
pub mod kernels;
pub mod matmul;
pub mod ops;
pub mod pool;
pub mod prefetch;
pub mod top_k;
pub mod vec_dot;
pub mod world;

use dejavu_backend_api::{
    Activation, AttnShape, Backend, BackendError, IndexSet, KvSlice, MatmulJob, QuantType,
    RopeStyle, RowLayout, Weight,
};
use isa::Isa;
use kernels::table::Kernels;

/// CPU backend: the kernel table of one ISA tier and a pool of `threads` threads for the decode
/// and prefill paths and attention.
pub struct CpuBackend {
    kernels: Kernels,
    pool: pool::SpinPool,
}

impl CpuBackend {
    /// The backend on the process's tier: `DEJAVU_ISA` if set, else the best this CPU has.
    pub fn new(threads: usize) -> Result<Self, BackendError> {
        let kernels = kernels::table::kernels().map_err(|e| BackendError::Unsupported {
            backend: "cpu".into(),
            what: e.to_string(),
        })?;
        Ok(Self {
            kernels: *kernels,
            pool: pool::SpinPool::new(threads),
        })
    }

    /// The backend on a given tier (tests compare tiers); an error if this CPU lacks it.
    pub fn with_isa(isa: Isa, threads: usize) -> Result<Self, BackendError> {
        let kernels = Kernels::for_isa(isa).ok_or_else(|| BackendError::Unsupported {
            backend: "cpu".into(),
            what: format!("ISA tier {isa} on this CPU"),
        })?;
        Ok(Self {
            kernels,
            pool: pool::SpinPool::new(threads),
        })
    }

    /// The f32 reference backend: every matmul on f32 activations and dequantized weights, in
    /// decode as in prefill (see `Kernels::f32_reference`). For tests and accuracy studies.
    pub fn f32_reference(threads: usize) -> Self {
        Self {
            kernels: Kernels::f32_reference(),
            pool: pool::SpinPool::new(threads),
        }
    }

    pub fn isa(&self) -> Isa {
        self.kernels.isa
    }
}

impl Backend for CpuBackend {
    fn name(&self) -> String {
        format!("cpu ({})", self.kernels.isa)
    }
    fn supports(&self, _qtype: QuantType) -> bool {
        true
    }
    fn matmul(&self, w: &Weight, rows: &IndexSet, x: &[f32], y: &mut [f32]) {
        matmul::matmul(&self.kernels, &self.pool, w, rows, x, y)
    }
    fn matmul_shared_input(&self, x: &[f32], jobs: &mut [MatmulJob<'_>]) {
        matmul::matmul_shared(&self.kernels, &self.pool, x, jobs)
    }
    fn axpy_rows(&self, w: &Weight, rows: &IndexSet, a: &[f32], y: &mut [f32]) {
        axpy_matmul::axpy_matmul(&self.kernels, &self.pool, w, rows, a, y)
    }
    fn repacks(&self, qtype: QuantType) -> bool {
        kernels::dot_repacked::repacks(self.kernels.isa, qtype)
    }
    fn repack(&self, w: &Weight, dst: &mut [u8]) -> RowLayout {
        assert!(self.repacks(w.qtype) && w.layout == RowLayout::Ggml);
        w.check();
        assert_eq!(dst.len(), w.data.len(), "repack: destination length");
        let rb = w.qtype.row_bytes(w.cols);
        // Rows split evenly over the pool's thread count (scoped threads: this runs once per
        // matrix at load; it is a permutation of bytes, bound by memory).
        let per = w.rows.div_ceil(self.pool.threads()).max(1) * rb;
        std::thread::scope(|scope| {
            for (src, dst) in w.data.chunks(per).zip(dst.chunks_mut(per)) {
                scope.spawn(move || {
                    for (s, d) in src.chunks_exact(rb).zip(dst.chunks_exact_mut(rb)) {
                        (self.kernels.repack)(w.qtype, s, d);
                    }
                });
            }
        });
        RowLayout::Repacked
    }
    fn dequantize_row(&self, w: &Weight, r: usize, out: &mut [f32]) {
        matmul::dequantize_row(&self.kernels, w, r, out)
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
        ops::rope(x, n_heads, head_dim, pos0, theta, style, None)
    }
    fn layernorm(&self, x: &[f32], w: &[f32], b: Option<&[f32]>, eps: f32, out: &mut [f32]) {
        check_len("layernorm", x.len(), out.len());
        ops::layernorm(x, w, b, eps, out)
    }
    fn glu(&self, act: Activation, gate: &mut [f32], up: &[f32]) {
        check_len("glu", gate.len(), up.len());
        ops::glu(act, gate, up)
    }
    fn activate(&self, act: Activation, x: &mut [f32]) {
        ops::activate(act, x)
    }
    fn attention(
        &self,
        q: &[f32],
        k: KvSlice<'_>,
        v: KvSlice<'_>,
        heads: &IndexSet,
        shape: AttnShape,
        out: &mut [f32],
    ) {
        attention::attention(&self.kernels, &self.pool, q, k, v, heads, shape, out)
    }
}

/// The element-wise ops index safely, so a length mismatch would silently truncate: refuse it.
fn check_len(op: &str, a: usize, b: usize) {
    assert_eq!(a, b, "{op}: operand lengths differ");
}
