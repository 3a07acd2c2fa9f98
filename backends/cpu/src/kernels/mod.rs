//! Per-ISA kernels: one operation per file, each with its scalar reference, its SIMD tiers and a
//! test comparing every tier this CPU supports with the reference. [`table`] picks one function
//! per (operation, weight type) for the selected [`crate::isa::Isa`].
pub mod axpy;
pub mod axpy_q;
pub mod dequantize;
pub mod dot_float;
pub mod dot_q4_0;
pub mod dot_q4_1;
pub mod dot_q4k;
pub mod dot_q5_0;
pub mod dot_q6k;
pub mod dot_q8_0;
pub mod dot_rows;
pub mod quantize_act;
pub mod table;
#[cfg(test)]
pub(crate) mod testutil;
#[cfg(target_arch = "x86_64")]
mod x86;
