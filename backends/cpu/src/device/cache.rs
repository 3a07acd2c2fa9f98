//! The CPU device's KV caches: `[n_ctx][width]` values in f16 (as on a GPU, and llama.cpp's
//! default) or f32 ([`CpuDevice::with_f32_cache`]).
//!
//! [`CpuDevice::with_f32_cache`]: super::CpuDevice::with_f32_cache
use dejavu_backend_api::KvSlice;
use half::f16;

/// One layer's keys or values (or kept attention inputs), `[n_ctx][width]`.
pub struct CpuCache {
    data: Data,
    pub(super) n_ctx: usize,
    pub(super) width: usize,
}

enum Data {
    F16(Vec<f16>),
    F32(Vec<f32>),
}

impl CpuCache {
    pub(super) fn new(f32: bool, n_ctx: usize, width: usize) -> Self {
        let n = n_ctx * width;
        // Zeroed allocations: the OS maps pages as positions are written, so a long context
        // holds only what a sequence uses.
        let data = match f32 {
            true => Data::F32(bytemuck::zeroed_vec(n)),
            false => Data::F16(bytemuck::zeroed_vec(n)),
        };
        Self { data, n_ctx, width }
    }
    /// Row `p`, from column `at` on: `src` (rounded to the cache's type). In bounds: the
    /// caller checked `p < n_ctx` and `at + src.len() <= width`.
    pub(super) fn put(&mut self, p: usize, at: usize, src: &[f32]) {
        let start = p * self.width + at;
        match &mut self.data {
            Data::F16(d) => (d[start..start + src.len()].iter_mut().zip(src))
                .for_each(|(d, &v)| *d = f16::from_f32(v)),
            Data::F32(d) => d[start..start + src.len()].copy_from_slice(src),
        }
    }
    /// Row `p` as f32 into `out` (`width` values).
    pub(super) fn read(&self, p: usize, out: &mut [f32]) {
        let row = p * self.width..(p + 1) * self.width;
        match &self.data {
            Data::F16(d) => (out.iter_mut().zip(&d[row])).for_each(|(o, v)| *o = v.to_f32()),
            Data::F32(d) => out.copy_from_slice(&d[row]),
        }
    }
    /// The first `n` values, as the attention kernel reads them.
    pub(super) fn slice(&self, n: usize) -> KvSlice<'_> {
        match &self.data {
            Data::F16(d) => KvSlice::F16(&d[..n]),
            Data::F32(d) => KvSlice::F32(&d[..n]),
        }
    }
}
