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
    Q5_1,
    Q2K,
    Q3K,
    Q5K,
    IQ4NL,
    IQ4XS,
}

impl QuantType {
    pub const ALL: [QuantType; 15] = [
        QuantType::F32,
        QuantType::F16,
        QuantType::BF16,
        QuantType::Q8_0,
        QuantType::Q4_0,
        QuantType::Q4_1,
        QuantType::Q5_0,
        QuantType::Q4K,
        QuantType::Q6K,
        QuantType::Q5_1,
        QuantType::Q2K,
        QuantType::Q3K,
        QuantType::Q5K,
        QuantType::IQ4NL,
        QuantType::IQ4XS,
    ];

    /// Elements per block.
    pub const fn block_len(self) -> usize {
        match self {
            QuantType::F32 | QuantType::F16 | QuantType::BF16 => 1,
            QuantType::Q8_0
            | QuantType::Q4_0
            | QuantType::Q4_1
            | QuantType::Q5_0
            | QuantType::Q5_1
            | QuantType::IQ4NL => QK,
            QuantType::Q4K
            | QuantType::Q6K
            | QuantType::Q2K
            | QuantType::Q3K
            | QuantType::Q5K
            | QuantType::IQ4XS => QK_K,
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
            QuantType::Q5_1 => size_of::<BlockQ5_1>(),
            QuantType::Q2K => size_of::<BlockQ2K>(),
            QuantType::Q3K => size_of::<BlockQ3K>(),
            QuantType::Q5K => size_of::<BlockQ5K>(),
            QuantType::IQ4NL => size_of::<BlockIQ4NL>(),
            QuantType::IQ4XS => size_of::<BlockIQ4XS>(),
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
            QuantType::Q5_1 => align_of::<BlockQ5_1>(),
            QuantType::Q2K => align_of::<BlockQ2K>(),
            QuantType::Q3K => align_of::<BlockQ3K>(),
            QuantType::Q5K => align_of::<BlockQ5K>(),
            QuantType::IQ4NL => align_of::<BlockIQ4NL>(),
            QuantType::IQ4XS => align_of::<BlockIQ4XS>(),
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
            QuantType::Q5_1 => "Q5_1",
            QuantType::Q2K => "Q2_K",
            QuantType::Q3K => "Q3_K",
            QuantType::Q5K => "Q5_K",
            QuantType::IQ4NL => "IQ4_NL",
            QuantType::IQ4XS => "IQ4_XS",
        }
    }
    /// Byte offsets of the f16 scales (`d`, and `m`/`dmin` where the type has one) inside one
    /// block; empty for the float types (a block is one value).
    pub const fn scale_offsets(self) -> &'static [usize] {
        match self {
            QuantType::F32 | QuantType::F16 | QuantType::BF16 => &[],
            QuantType::Q4_0
            | QuantType::Q5_0
            | QuantType::Q8_0
            | QuantType::IQ4NL
            | QuantType::IQ4XS => &[0],
            QuantType::Q4_1 | QuantType::Q5_1 | QuantType::Q4K | QuantType::Q5K => &[0, 2],
            QuantType::Q6K => &[208],
            QuantType::Q2K => &[80, 82],
            QuantType::Q3K => &[108],
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

/// Q5_1: Q4_1 with Q5_0's fifth bits: `x = d * q5 + m`, q5 in 0..32.
#[repr(C)]
#[derive(Debug, Clone, Copy, Pod, Zeroable)]
pub struct BlockQ5_1 {
    pub d: f16,
    pub m: f16,
    pub qh: [u8; 4],
    pub qs: [u8; QK / 2],
}

/// Q2_K: 16 sub-blocks of 16; `scales[j]` holds a 4-bit scale (low) and a 4-bit min (high);
/// `x = d * (sc & 15) * q - dmin * (sc >> 4)`, q in 0..4. Element l (< 32) of the 32-element
/// group k = 4n + s (half n, shift s) is bits `2s..2s+2` of `qs[32n + l]`, sub-block `8n + 2s + l / 16`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Pod, Zeroable)]
pub struct BlockQ2K {
    pub scales: [u8; QK_K / 16],
    pub qs: [u8; QK_K / 4],
    pub d: f16,
    pub dmin: f16,
}

/// Q3_K: 16 sub-blocks of 16 with 6-bit scales (stored + 32, packed in 12 bytes, see
/// [`q3k_scales`]); `x = d * scale * q`, q in -4..4: two bits as Q2_K's plus a high bit from
/// `hmask` (bit k of `hmask[l]` for group k; clear means q - 4).
#[repr(C)]
#[derive(Debug, Clone, Copy, Pod, Zeroable)]
pub struct BlockQ3K {
    pub hmask: [u8; QK_K / 8],
    pub qs: [u8; QK_K / 4],
    pub scales: [u8; 12],
    pub d: f16,
}

/// Q5_K: Q4_K with a fifth bit per element: bit j of `qh[l]` for element l of sub-block j;
/// `x = d * sc[j] * q5 - dmin * m[j]`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Pod, Zeroable)]
pub struct BlockQ5K {
    pub d: f16,
    pub dmin: f16,
    pub scales: [u8; 12],
    pub qh: [u8; QK_K / 8],
    pub qs: [u8; QK_K / 2],
}

/// IQ4_NL: 4-bit indices into the non-linear [`KVALUES_IQ4NL`], nibbles as Q4_0:
/// `x = d * KVALUES_IQ4NL[q]`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Pod, Zeroable)]
pub struct BlockIQ4NL {
    pub d: f16,
    pub qs: [u8; QK / 2],
}

/// IQ4_XS: 8 IQ4_NL sub-blocks of 32 sharing one `d`, each with a 6-bit scale (see
/// [`iq4xs_scale`]): `x = d * scale * KVALUES_IQ4NL[q]`; sub-block j's nibbles are `qs[16j..16j+16]`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Pod, Zeroable)]
pub struct BlockIQ4XS {
    pub d: f16,
    pub scales_h: [u8; 2],
    pub scales_l: [u8; QK_K / 64],
    pub qs: [u8; QK_K / 2],
}

/// The 16 levels of IQ4_NL and IQ4_XS (ggml's `kvalues_iq4nl`).
pub const KVALUES_IQ4NL: [i8; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];

/// The 16 signed scales of a Q3_K block (ggml's unpacking of `scales`, minus 32).
#[inline]
pub fn q3k_scales(s: &[u8; 12]) -> [i8; 16] {
    std::array::from_fn(|j| {
        let low = if j < 8 { s[j] & 0xF } else { s[j - 8] >> 4 };
        let high = (s[8 + j % 4] >> (2 * (j / 4))) & 3;
        (low | (high << 4)) as i8 - 32
    })
}

/// The signed scale of sub-block `j` (0..8) of an IQ4_XS block.
#[inline]
pub fn iq4xs_scale(b: &BlockIQ4XS, j: usize) -> i32 {
    let low = (b.scales_l[j / 2] >> (4 * (j % 2))) & 0xF;
    let high = (u16::from_le_bytes(b.scales_h) >> (2 * j)) & 3;
    (low as i32 | (high as i32) << 4) - 32
}

const _: () = assert!(size_of::<BlockQ8_0>() == 34);
const _: () = assert!(size_of::<BlockQ5_1>() == 24);
const _: () = assert!(size_of::<BlockQ2K>() == 84);
const _: () = assert!(size_of::<BlockQ3K>() == 110);
const _: () = assert!(size_of::<BlockQ5K>() == 176);
const _: () = assert!(size_of::<BlockIQ4NL>() == 18);
const _: () = assert!(size_of::<BlockIQ4XS>() == 136);
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
