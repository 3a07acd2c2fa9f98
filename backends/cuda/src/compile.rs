//! The kernels' compilation: their sources, NVRTC (loaded at run time), and the tuning
//! constants of `DEJAVU_CUDA_DEFINES` that the kernels and the host's launch shapes share.
use dejavu_backend_api::BackendError;

/// The kernel sources, in the order NVRTC compiles them (the header first).
const SOURCES: [&str; 12] = [
    include_str!("kernels/common.cuh"),
    include_str!("kernels/matvec.cu"),
    include_str!("kernels/matvec_mma.cu"),
    include_str!("kernels/matmul.cu"),
    include_str!("kernels/axpy.cu"),
    include_str!("kernels/embed.cu"),
    include_str!("kernels/norm.cu"),
    include_str!("kernels/rope.cu"),
    include_str!("kernels/elementwise.cu"),
    include_str!("kernels/attention.cu"),
    include_str!("kernels/topk.cu"),
    include_str!("kernels/kvfill.cu"),
];

/// The `NAME=VALUE` pairs of `DEJAVU_CUDA_DEFINES` (kernel tuning constants).
fn defines() -> Vec<(String, String)> {
    let defs = std::env::var("DEJAVU_CUDA_DEFINES").unwrap_or_default();
    (defs.split(',').filter_map(|d| d.split_once('=')))
        .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
        .collect()
}

/// A tuning constant of `DEJAVU_CUDA_DEFINES` that the host's launch shapes depend on too
/// (`MV_ROWS`: rows per warp of matvec.cu; `MV_FILL`, `MV_FILL_SEL`: the blocks per SM under
/// which a product of every row, or a gather over a selection, splits its rows; `MV_AHEAD_F16`:
/// f16 products of every row load ahead as bf16's do (matvec.cu's `MV_UNROLL`); `AX_VEC`:
/// 256-column chunks per block of axpy.cu; `AX_FILL`: axpy blocks per SM; `AXB_ROWS`,
/// `AXB_FILL`: batch rows per pass and blocks per SM of `axpy_rows`; `ATTEND_ROWS`: a
/// step of several sequences' attention in one call, `MMA`: a few batch rows' products of
/// 16-bit weights on the tensor cores, `MMA_H`: their inputs split into 16-bit parts,
/// `HMMA_FILL`: the blocks per SM under which they split rows between blocks, `GRAPHS`: decode
/// steps recorded as CUDA graphs, `SEQ_GRAPHS`: steps of several sequences too, `ATT_SPAN`:
/// attention's spans of positions, `SPLIT_COLS`: the input split's columns a block; see
/// `CudaDevice`), or `default` when
/// unset or outside `range`. Defaults measured on the H200: a fill of 8 ran the gather of 10%
/// of OPT-30B's fc1 rows at 3.3 TB/s, against 2.5 for 2, but its dense step 2-3% slower than 2;
/// the axpy's (`AX_VEC` 1, `AX_FILL` 4) are in axpy.cu.
pub(crate) fn tuning(name: &str, default: usize, range: std::ops::RangeInclusive<usize>) -> usize {
    (defines().into_iter().find(|(k, _)| k == name))
        .and_then(|(_, v)| v.parse().ok())
        .filter(|r| range.contains(r))
        .unwrap_or(default)
}

/// Rows per warp of matvec.cu.
pub(crate) fn mv_rows() -> usize {
    tuning("MV_ROWS", 1, 1..=8)
}

/// 256-column chunks per block of axpy.cu.
pub(crate) fn ax_vec() -> usize {
    tuning("AX_VEC", 1, 1..=4)
}

/// Batch rows per pass of axpy.cu's `axpy_rows` (its accumulators: 8 floats a row a lane).
pub(crate) fn axb_rows() -> usize {
    tuning("AXB_ROWS", 8, 1..=16)
}

/// Can NVRTC be loaded?
pub fn nvrtc_present() -> bool {
    // SAFETY: only tries to open the library (dlopen), and closes it again.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

/// NVRTC can be loaded, or why not (cudarc panics on a missing library).
pub(crate) fn need_nvrtc() -> Result<(), BackendError> {
    match nvrtc_present() {
        true => Ok(()),
        false => Err(BackendError::Device(
            "NVRTC (libnvrtc.so) was not found: install the CUDA toolkit's NVRTC".into(),
        )),
    }
}

/// The kernels compiled by NVRTC for `arch` (`compute_90`). Needs NVRTC only, no GPU.
/// `DEJAVU_CUDA_DEFINES=MV_ROWS=2,AX_UNROLL=8` overrides the kernels' tuning constants.
pub fn compile(arch: &str) -> Result<cudarc::nvrtc::Ptx, BackendError> {
    let mut options = vec![format!("--gpu-architecture={arch}")];
    // The constants the host's launch shapes depend on go in as the host reads them.
    let host = ["MV_ROWS", "AX_VEC", "AXB_ROWS"];
    options.extend(
        (defines().into_iter())
            .filter(|(k, _)| !host.contains(&k.as_str()))
            .map(|(k, v)| format!("-D{k}={v}")),
    );
    options.push(format!("-DMV_ROWS={}", mv_rows()));
    options.push(format!("-DAX_VEC={}", ax_vec()));
    options.push(format!("-DAXB_ROWS={}", axb_rows()));
    let opts = cudarc::nvrtc::CompileOptions {
        options,
        ..Default::default()
    };
    need_nvrtc()?;
    cudarc::nvrtc::compile_ptx_with_opts(SOURCES.concat(), opts).map_err(|e| match e {
        cudarc::nvrtc::CompileError::CompileError { log, .. } => {
            BackendError::Device(format!("NVRTC: {}", log.to_string_lossy()))
        }
        e => BackendError::Device(format!("NVRTC: {e:?}")),
    })
}
