//! The examples' timing: a verb's launches recorded in one graph and replayed.
use dejavu_backend_api::{BackendError, Device};
use dejavu_backend_cuda::CudaDevice;
use std::time::Instant;

/// Launches of `f` recorded in one graph.
pub const REPS: usize = 20;

/// Microseconds per run of `f`: `REPS` runs recorded in one graph, replayed 5 times after one
/// warm-up replay.
pub fn graph_us(dev: &CudaDevice, mut f: impl FnMut() -> Result<(), BackendError>) -> f64 {
    dev.begin_capture().unwrap();
    for _ in 0..REPS {
        f().unwrap();
    }
    let g = dev.end_capture().unwrap();
    dev.replay(&g).unwrap();
    dev.synchronize().unwrap();
    let t0 = Instant::now();
    for _ in 0..5 {
        dev.replay(&g).unwrap();
    }
    dev.synchronize().unwrap();
    t0.elapsed().as_secs_f64() * 1e6 / (5 * REPS) as f64
}
