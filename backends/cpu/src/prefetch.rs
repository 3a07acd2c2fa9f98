//! Software prefetch of the rows a sparse plan selects, issued by the row loops. The dense dot
//! kernels prefetch a fixed distance ahead in memory themselves (decode streams each matrix once,
//! and the hardware prefetcher alone leaves the loop waiting on DRAM); over a subset of rows that
//! would pull in the unselected rows in between and read the bytes sparsity means to skip, so
//! sparse loops use kernels without prefetch and prefetch the next selected rows here.

/// How far ahead of the row being read the loops prefetch, in bytes of rows.
pub const AHEAD_BYTES: usize = 4096;

/// Rows to run ahead for rows of `row_bytes` (at least one).
pub fn rows_ahead(row_bytes: usize) -> usize {
    AHEAD_BYTES.div_ceil(row_bytes.max(1)).max(1)
}

/// Hint the CPU to load every cache line of `bytes` (never faults; a no-op off x86-64).
#[inline(always)]
pub fn prefetch(bytes: &[u8]) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        let p = bytes.as_ptr() as *const i8;
        let mut off = 0;
        while off < bytes.len() {
            // SAFETY: prefetch is a hint that never faults; the address is inside `bytes`.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(p.add(off)) };
            off += 64;
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = bytes;
}
