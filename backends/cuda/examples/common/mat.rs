//! The examples' weights: a matrix of deterministic small values.
use dejavu_backend_api::{Device, QuantType, Weight};
use dejavu_backend_cuda::{CudaDevice, Mat};

/// `rows x cols` of `q` on the GPU: bytes `i * 7 % 251` with their 0x44 bits cleared (for
/// f16/bf16, small finite values, so sums stay finite).
pub fn mat(dev: &CudaDevice, q: QuantType, rows: usize, cols: usize) -> Mat {
    let bytes: Vec<u8> = (0..rows * q.row_bytes(cols))
        .map(|i| (i * 7 % 251) as u8 & 0x3b)
        .collect();
    dev.upload_mat(&Weight::new(q, rows, cols, &bytes).unwrap())
        .unwrap()
}
