//! The CPU device's KV caches: `[n_ctx][width]` values in f16 (as on a GPU, and llama.cpp's
//! default) or f32 ([`CpuDevice::with_f32_cache`]).
//!
//! [`CpuDevice::with_f32_cache`]: super::CpuDevice::with_f32_cache
use dejavu_backend_api::{BackendError, KvSlice};
use half::f16;
use half::slice::HalfFloatSliceExt;

/// One layer's keys or values (or kept attention inputs), `[n_ctx][width]`, in an anonymous
/// memory map: the OS maps its pages as positions are written, so a long context holds only
/// what a sequence uses, and [`CpuCache::release`] gives them all back (a pool of KV memory
/// shared by a server's sequences, `serve --kv-pool`).
pub struct CpuCache {
    map: memmap2::MmapMut,
    f32: bool,
    pub(super) n_ctx: usize,
    pub(super) width: usize,
}

/// The values of a cache.
enum Data<'a> {
    F16(&'a [f16]),
    F32(&'a [f32]),
}

impl CpuCache {
    pub(super) fn new(f32: bool, n_ctx: usize, width: usize) -> Result<Self, BackendError> {
        Ok(Self {
            map: zeroed(f32, n_ctx * width)?,
            f32,
            n_ctx,
            width,
        })
    }

    /// Give the cache's pages back to the OS: every value reads 0 again.
    pub(super) fn release(&mut self) -> Result<(), BackendError> {
        self.map = zeroed(self.f32, self.n_ctx * self.width)?;
        Ok(())
    }

    /// Positions `0..n` of `src` (a cache of the same width and type) into this one.
    pub(super) fn copy_from(&mut self, src: &CpuCache, n: usize) -> Result<(), BackendError> {
        if src.width != self.width || src.f32 != self.f32 || n > src.n_ctx || n > self.n_ctx {
            return Err(BackendError::Shape(format!(
                "copying {n} positions of a cache of {}x{} into one of {}x{}",
                src.n_ctx, src.width, self.n_ctx, self.width
            )));
        }
        let bytes = n * self.width * if self.f32 { 4 } else { 2 };
        self.map[..bytes].copy_from_slice(&src.map[..bytes]);
        Ok(())
    }

    /// The values' bytes (the map holds at least one page, maybe more than they need).
    fn bytes(&self) -> usize {
        self.n_ctx * self.width * if self.f32 { 4 } else { 2 }
    }

    fn data(&self) -> Data<'_> {
        let bytes = &self.map[..self.bytes()];
        match self.f32 {
            true => Data::F32(bytemuck::cast_slice(bytes)),
            false => Data::F16(bytemuck::cast_slice(bytes)),
        }
    }

    /// Row `p`, from column `at` on: `src` (rounded to the cache's type). In bounds: the
    /// caller checked `p < n_ctx` and `at + src.len() <= width`.
    pub(super) fn put(&mut self, p: usize, at: usize, src: &[f32]) {
        let start = p * self.width + at;
        let n = self.bytes();
        let bytes = &mut self.map[..n];
        match self.f32 {
            // `half`'s slice conversion: F16C 8 values at a time, rounding as `f16::from_f32`.
            false => bytemuck::cast_slice_mut::<u8, f16>(bytes)[start..start + src.len()]
                .convert_from_f32_slice(src),
            true => bytemuck::cast_slice_mut::<u8, f32>(bytes)[start..start + src.len()]
                .copy_from_slice(src),
        }
    }
    /// Row `p` as f32 into `out` (`width` values).
    pub(super) fn read(&self, p: usize, out: &mut [f32]) {
        let row = p * self.width..(p + 1) * self.width;
        match self.data() {
            Data::F16(d) => (out.iter_mut().zip(&d[row])).for_each(|(o, v)| *o = v.to_f32()),
            Data::F32(d) => out.copy_from_slice(&d[row]),
        }
    }
    /// The first `n` values, as the attention kernel reads them.
    pub(super) fn slice(&self, n: usize) -> KvSlice<'_> {
        match self.data() {
            Data::F16(d) => KvSlice::F16(&d[..n]),
            Data::F32(d) => KvSlice::F32(&d[..n]),
        }
    }
}

/// An anonymous map of `n` zero values (f32 or f16; at least one page), its pages mapped as
/// they are written.
fn zeroed(f32: bool, n: usize) -> Result<memmap2::MmapMut, BackendError> {
    let bytes = n * if f32 { 4 } else { 2 };
    memmap2::MmapMut::map_anon(bytes.max(1))
        .map_err(|e| BackendError::Device(format!("a KV cache of {bytes} bytes: {e}")))
}
