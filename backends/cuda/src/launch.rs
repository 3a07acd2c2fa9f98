//! Launch helpers: grid shapes and the one `unsafe` launch every verb goes through.
use crate::dev_err;
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, LaunchArgs, LaunchConfig};
use dejavu_backend_api::BackendError;

/// Launch `b` as `cfg`.
pub(crate) fn run(mut b: LaunchArgs<'_>, cfg: LaunchConfig) -> Result<(), BackendError> {
    // SAFETY: every caller pushes the arguments of its kernel's C signature in order, with the
    // same types (u64 device addresses for pointers, i32 for int, f32 for float), and checked
    // beforehand that each buffer holds what the kernel reads or writes for these sizes; the
    // kernels bound every other index (rows, positions) themselves.
    unsafe { b.launch(cfg) }.map(|_| ()).map_err(dev_err)
}

/// `n` threads in blocks of `block` (at least one block).
pub(crate) fn grid(n: usize, block: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: ((n.max(1) as u32).div_ceil(block), 1, 1),
        block_dim: (block, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// `cfg` once for each of `rows` batch rows (`blockIdx.y`).
pub(crate) fn rows(cfg: LaunchConfig, rows: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (cfg.grid_dim.0, rows.max(1) as u32, 1),
        ..cfg
    }
}

/// `cfg`'s one block once for each of `rows` batch rows (`blockIdx.x`).
pub(crate) fn blocks(cfg: LaunchConfig, rows: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (rows.max(1) as u32, 1, 1),
        ..cfg
    }
}

/// One block for a reduction over `n` elements: up to 1024 threads, a multiple of 32.
pub(crate) fn one_block(n: usize) -> LaunchConfig {
    let t = (n.div_ceil(32) * 32).clamp(32, 1024) as u32;
    LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: (t, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// `dst[..src.len()] = src`, ordered on `stream`.
pub(crate) fn htod<T: cudarc::driver::DeviceRepr>(
    stream: &CudaStream,
    dst: &CudaSlice<T>,
    src: &[T],
) -> Result<(), BackendError> {
    htod_at(stream, dst, 0, src)
}

/// `dst[at..at + src.len()] = src`, ordered on `stream`.
pub(crate) fn htod_at<T: cudarc::driver::DeviceRepr>(
    stream: &CudaStream,
    dst: &CudaSlice<T>,
    at: usize,
    src: &[T],
) -> Result<(), BackendError> {
    assert!(
        at.checked_add(src.len())
            .is_some_and(|end| end <= dst.len()),
        "htod: {} values at {at} into {}",
        src.len(),
        dst.len()
    );
    let p = dst.device_ptr(stream).0 + (at * std::mem::size_of::<T>()) as u64;
    // SAFETY: `dst` holds at least `at + src.len()` values (asserted); a copy from pageable
    // host memory returns once `src` has been staged, so `src` may go out of scope after the
    // call.
    unsafe { cudarc::driver::result::memcpy_htod_async(p, src, stream.cu_stream()) }
        .map_err(dev_err)
}
