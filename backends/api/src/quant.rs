//! Weight types the engine computes with, and their block layouts, defined once for every backend.
//!
//! Layouts follow ggml (`ggml-common.h`); each struct is `#[repr(C)]`, `Pod`, and its size is
//! asserted at compile time. A row of `n` elements is `n / block_len` consecutive blocks.
use bytemuck::{Pod, Zeroable};
use half::{bf16, f16};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum QuantType {
    F32,
    F16,
    BF16,
    Q8_0,
    Q4_0,
    Q4_1,
    Q5_0,
    Q4K,
    Q6K,
}

impl QuantType {
    pub const ALL: [QuantType; 9] = [
        QuantType::F32,
        QuantType::F16,
        QuantType::BF16,
        QuantType::Q8_0,
        QuantType::Q4_0,
        QuantType::Q4_1,
        QuantType::Q5_0,
        QuantType::Q4K,
        QuantType::Q6K,
    ];

    /// Elements per block.
    pub const fn block_len(self) -> usize {
        match self {
            QuantType::F32 | QuantType::F16 | QuantType::BF16 => 1,
            QuantType::Q8_0 | QuantType::Q4_0 | QuantType::Q4_1 | QuantType::Q5_0 => QK,
            QuantType::Q4K | QuantType::Q6K => QK_K,
        }
    }
    /// Bytes per block.
    pub const fn block_bytes(self) -> usize {
        match self {
            QuantType::F32 => 4,
            QuantType::F16 | QuantType::BF16 => 2,
            QuantType::Q8_0 => size_of::<BlockQ8_0>(),
            QuantType::Q4_0 => size_of::<BlockQ4_0>(),
            QuantType::Q4_1 => size_of::<BlockQ4_1>(),
            QuantType::Q5_0 => size_of::<BlockQ5_0>(),
            QuantType::Q4K => size_of::<BlockQ4K>(),
            QuantType::Q6K => size_of::<BlockQ6K>(),
        }
    }
    /// The alignment in bytes a row's data must have: the kernels read the blocks as typed
    /// slices, and weights are mapped from files, so a tensor at a misaligned file offset is
    /// refused at load.
    pub const fn align(self) -> usize {
        match self {
            QuantType::F32 => align_of::<f32>(),
            QuantType::F16 | QuantType::BF16 => align_of::<half::f16>(),
            QuantType::Q8_0 => align_of::<BlockQ8_0>(),
            QuantType::Q4_0 => align_of::<BlockQ4_0>(),
            QuantType::Q4_1 => align_of::<BlockQ4_1>(),
            QuantType::Q5_0 => align_of::<BlockQ5_0>(),
            QuantType::Q4K => align_of::<BlockQ4K>(),
            QuantType::Q6K => align_of::<BlockQ6K>(),
        }
    }
    /// Bytes of a row of `n` elements (`n` a multiple of `block_len`).
    #[inline]
    pub const fn row_bytes(self, n: usize) -> usize {
        n / self.block_len() * self.block_bytes()
    }
    pub fn name(self) -> &'static str {
        match self {
            QuantType::F32 => "F32",
            QuantType::F16 => "F16",
            QuantType::BF16 => "BF16",
            QuantType::Q8_0 => "Q8_0",
            QuantType::Q4_0 => "Q4_0",
            QuantType::Q4_1 => "Q4_1",
            QuantType::Q5_0 => "Q5_0",
            QuantType::Q4K => "Q4_K",
            QuantType::Q6K => "Q6_K",
        }
    }
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|t| t.name() == name)
    }
}

/// Elements per block of the 32-wide formats.
pub const QK: usize = 32;
/// Elements per super-block of the K-quants.
pub const QK_K: usize = 256;

/// Q8_0: `x[i] = d * qs[i]`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Pod, Zeroable)]
pub struct BlockQ8_0 {
    pub d: f16,
    pub qs: [i8; QK],
}

/// Q4_0: `x[j] = d * ((qs[j] & 15) - 8)`, `x[j + 16] = d * ((qs[j] >> 4) - 8)`, j < 16.
#[repr(C)]
#[derive(Debug, Clone, Copy, Pod, Zeroable)]
pub struct BlockQ4_0 {
    pub d: f16,
    pub qs: [u8; QK / 2],
}

/// Q4_1: like Q4_0 with unsigned nibbles and an offset: `x = d * q + m`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Pod, Zeroable)]
pub struct BlockQ4_1 {
    pub d: f16,
    pub m: f16,
    pub qs: [u8; QK / 2],
}

/// Q5_0: Q4_0's nibbles plus a fifth bit per element from `qh` (little-endian u32, bit j for
/// element j): `x = d * (q5 - 16)`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Pod, Zeroable)]
pub struct BlockQ5_0 {
    pub d: f16,
    pub qh: [u8; 4],
    pub qs: [u8; QK / 2],
}

/// Q4_K: 8 sub-blocks of 32 with 6-bit scales and mins packed in `scales`;
/// `x = d * sc[j] * q - dmin * m[j]`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Pod, Zeroable)]
pub struct BlockQ4K {
    pub d: f16,
    pub dmin: f16,
    pub scales: [u8; 12],
    pub qs: [u8; QK_K / 2],
}

/// Q6_K: 16 sub-blocks of 16 with i8 scales; 6-bit values from 4 low bits (`ql`) and 2 high bits
/// (`qh`): `x = d * scales[j] * (q - 32)`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Pod, Zeroable)]
pub struct BlockQ6K {
    pub ql: [u8; QK_K / 2],
    pub qh: [u8; QK_K / 4],
    pub scales: [i8; QK_K / 16],
    pub d: f16,
}

const _: () = assert!(size_of::<BlockQ8_0>() == 34);
const _: () = assert!(size_of::<BlockQ4_0>() == 18);
const _: () = assert!(size_of::<BlockQ4_1>() == 20);
const _: () = assert!(size_of::<BlockQ5_0>() == 22);
const _: () = assert!(size_of::<BlockQ4K>() == 144);
const _: () = assert!(size_of::<BlockQ6K>() == 210);
const _: () = assert!(size_of::<bf16>() == 2);

/// Unpack the 6-bit scale and min of sub-block `j` (0..8) of a Q4_K block (ggml's `get_scale_min_k4`).
#[inline]
pub fn q4k_scale_min(j: usize, s: &[u8; 12]) -> (u8, u8) {
    if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        (
            (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4),
            (s[j + 4] >> 4) | ((s[j] >> 6) << 4),
        )
    }
}

/// Activations quantized for integer dot products: 32 values `x[i] ~= d * qs[i]` with
/// `d = max|x| / 127`, plus `s = d * sum(qs)` (lets offset formats such as Q4_0 and Q4_1 fold
/// their offset into one multiply; `d` and `s` are adjacent so kernels load both at once). One
/// format serves every weight type; K-quants use 8 per super-block.
#[repr(C)]
#[derive(Debug, Clone, Copy, Pod, Zeroable)]
pub struct BlockQ8A {
    pub d: f32,
    pub s: f32,
    pub qs: [i8; QK],
}

const _: () = assert!(size_of::<BlockQ8A>() == 40);
