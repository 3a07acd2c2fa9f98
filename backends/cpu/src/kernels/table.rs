//! The kernel table: one function per (operation, weight type) for one ISA tier, built once.
use super::{
    axpy, axpy_blocks, axpy_blocks_i8, axpy_q, dequantize, dot_float, dot_iq4nl, dot_iq4xs,
    dot_q2k, dot_q3k, dot_q4_0, dot_q4_1, dot_q4k, dot_q5_0, dot_q5_1, dot_q5k, dot_q6k, dot_q8_0,
    dot_repacked, dot_rows, gemm_q8a, glu, quantize_act, repack, softmax, tail_mass,
};
use crate::isa::{self, Isa, IsaError};
use dejavu_backend_api::quant::{BlockQ8A, QuantType};
use dejavu_backend_api::{RowLayout, Weight};
use std::sync::OnceLock;

/// Dot of a quantized weight row with activations quantized to [`BlockQ8A`].
pub type DotQ8AFn = fn(&[u8], &[BlockQ8A]) -> f32;
/// Dots of a quantized weight row with 1..=`MAX_Q8A_TOKENS` tokens' activations (`out[t]`),
/// each bit for bit the type's [`DotQ8AFn`] on that token.
pub type DotQ8ATokensFn = fn(&[u8], &[&[BlockQ8A]], &mut [f32]);
/// Dot of a float weight row (F32/F16/BF16) with f32 activations.
pub type DotF32Fn = fn(&[u8], &[f32]) -> f32;

/// How a weight type wants its activations.
#[derive(Clone, Copy)]
pub enum RowDot {
    Q8A(DotQ8AFn),
    /// The same, with a multi-token kernel that unpacks each block once for several tokens
    /// (a prompt's rows, a batch of decode rows).
    Q8AN(DotQ8AFn, DotQ8ATokensFn),
    F32(DotF32Fn),
    /// Repacked rows: Q8A blocks and their transposed groups (`repack::ActGroup`); one token,
    /// and up to `dot_repacked::MAX_TOKENS` tokens per call with the same results.
    R8(dot_repacked::DotR8Fn, dot_repacked::DotR8TokensFn),
}

#[derive(Clone, Copy)]
pub struct Kernels {
    pub isa: Isa,
    pub quantize: quantize_act::QuantizeFn,
    /// Row dequantization for the prefill tiles.
    pub dequantize: dequantize::DequantFn,
    /// The integer prefill kernel, on tiers where it beats dequantized tiles and `gemm`.
    pub gemm_q8a: Option<gemm_q8a::Gemm>,
    /// Gated activation of the MLP.
    pub glu: glu::GluFn,
    /// f32 vector against rows (attention's scores) and weighted sum of rows (its value sum).
    pub dot_rows: dot_rows::DotRowsFn,
    pub axpy_rows: axpy::AxpyRowsFn,
    /// Attention's softmax over one head's scores.
    pub softmax: softmax::SoftmaxFn,
    /// The contextual output head's bound: a vocabulary's tail mass.
    pub tail_mass: tail_mass::TailFn,
    /// The same two over f16 rows (an f16 KV cache).
    pub dot_rows_f16: dot_rows::DotRowsFn<half::f16>,
    pub axpy_rows_f16: axpy::AxpyRowsFn<half::f16>,
    /// The four above for several query heads of one KV group at once (each head's result
    /// that of the one-head kernel; the x86 tiers read each key and value row once for 2 or 4).
    pub dot_rows_many: dot_rows::DotRowsManyFn,
    pub axpy_rows_many: axpy::AxpyRowsManyFn,
    pub dot_rows_many_f16: dot_rows::DotRowsManyFn<half::f16>,
    pub axpy_rows_many_f16: axpy::AxpyRowsManyFn<half::f16>,
    /// Weighted sum of a few quantized rows (the sparse down projection).
    pub axpy_q: axpy_q::AxpyQFn,
    /// The same over a block of 32 rows of an input-block matrix (input sparsity).
    pub axpy_blocks: axpy_blocks::AxpyBlocksFn,
    /// The same with each block's kept inputs quantized once by the caller
    /// (`axpy_blocks_i8::quantize`), on the tiers with an 8-bit kernel (else `None`).
    pub axpy_blocks_q8: Option<axpy_blocks_i8::AxpyBlocksQ8Fn>,
    /// Row dots per weight type: `dots` prefetch ahead of the row they read (dense products),
    /// `sparse_dots` do not (the sparse row loop prefetches the rows it selected).
    dots: [RowDot; QuantType::ALL.len()],
    sparse_dots: [RowDot; QuantType::ALL.len()],
    /// The same for repacked rows (types `repack::supports`; others `None`).
    repacked_dots: [Option<RowDot>; QuantType::ALL.len()],
    sparse_repacked_dots: [Option<RowDot>; QuantType::ALL.len()],
    /// Row conversions between the ggml and the repacked layout.
    pub repack: repack::ConvertFn,
    pub unpack: repack::ConvertFn,
    pub dequantize_repacked: repack::DequantFn,
}

/// A Q8A type's dot, with its multi-token kernel where the tier has one.
fn q8a(one: DotQ8AFn, tokens: Option<DotQ8ATokensFn>) -> RowDot {
    match tokens {
        Some(t) => RowDot::Q8AN(one, t),
        None => RowDot::Q8A(one),
    }
}

impl RowDot {
    /// The one-token dot of a type whose activations are Q8A blocks (not repacked rows).
    pub fn q8a(self) -> Option<DotQ8AFn> {
        match self {
            RowDot::Q8A(f) | RowDot::Q8AN(f, _) => Some(f),
            _ => None,
        }
    }
}

impl Kernels {
    /// The table of one tier; `None` if this CPU cannot run it.
    pub fn for_isa(isa: Isa) -> Option<Self> {
        if !isa.is_supported() {
            return None;
        }
        let dots_with = |pf: bool| {
            QuantType::ALL.map(|q| match q {
                QuantType::F32 => RowDot::F32(dot_float::select_f32(isa)),
                QuantType::F16 => RowDot::F32(dot_float::select_f16(isa)),
                QuantType::BF16 => RowDot::F32(dot_float::select_bf16(isa)),
                QuantType::Q8_0 => RowDot::Q8A(dot_q8_0::select(isa, pf)),
                QuantType::Q4_0 => RowDot::Q8A(dot_q4_0::select(isa, pf)),
                QuantType::Q4_1 => RowDot::Q8A(dot_q4_1::select(isa, pf)),
                QuantType::Q5_0 => RowDot::Q8A(dot_q5_0::select(isa, pf)),
                QuantType::Q4K => q8a(dot_q4k::select(isa, pf), dot_q4k::select_tokens(isa, pf)),
                QuantType::Q6K => q8a(dot_q6k::select(isa, pf), dot_q6k::select_tokens(isa, pf)),
                QuantType::Q5_1 => RowDot::Q8A(dot_q5_1::select(isa, pf)),
                QuantType::Q2K => RowDot::Q8A(dot_q2k::select(isa, pf)),
                QuantType::Q3K => RowDot::Q8A(dot_q3k::select(isa, pf)),
                QuantType::Q5K => RowDot::Q8A(dot_q5k::select(isa, pf)),
                QuantType::IQ4NL => RowDot::Q8A(dot_iq4nl::select(isa, pf)),
                QuantType::IQ4XS => RowDot::Q8A(dot_iq4xs::select(isa, pf)),
            })
        };
        let repacked_with = |pf: bool| {
            QuantType::ALL.map(|q| {
                repack::supports(q).then(|| {
                    RowDot::R8(
                        dot_repacked::select(q, isa, pf),
                        dot_repacked::select_tokens(q, isa, pf),
                    )
                })
            })
        };
        let (repack, unpack) = repack::select(isa);
        Some(Self {
            isa,
            repacked_dots: repacked_with(true),
            sparse_repacked_dots: repacked_with(false),
            repack,
            unpack,
            dequantize_repacked: repack::select_dequantize(isa),
            quantize: quantize_act::select(isa),
            dequantize: dequantize::select(isa),
            gemm_q8a: gemm_q8a::select(isa),
            glu: glu::select(isa),
            dot_rows: dot_rows::select(isa),
            axpy_rows: axpy::select(isa),
            softmax: softmax::select(isa),
            tail_mass: tail_mass::select(isa),
            dot_rows_f16: dot_rows::select_f16(isa),
            axpy_rows_f16: axpy::select_f16(isa),
            dot_rows_many: dot_rows::select_many(isa),
            axpy_rows_many: axpy::select_many(isa),
            dot_rows_many_f16: dot_rows::select_many_f16(isa),
            axpy_rows_many_f16: axpy::select_many_f16(isa),
            axpy_q: axpy_q::select(isa),
            axpy_blocks: axpy_blocks_i8::select(isa).unwrap_or(axpy_blocks::select(isa)),
            axpy_blocks_q8: axpy_blocks_i8::select_q8(isa),
            dots: dots_with(true),
            sparse_dots: dots_with(false),
        })
    }

    /// The f32 reference: scalar tier, and every weight type dotted in f32 against unquantized
    /// activations (dequantize, multiply, add). Slow; it is what the integer kernels approximate.
    pub fn f32_reference() -> Self {
        use crate::vec_dot::dot_row;
        let dots = QuantType::ALL.map(|q| {
            RowDot::F32(match q {
                QuantType::F32 => |r, x| dot_row(QuantType::F32, r, x),
                QuantType::F16 => |r, x| dot_row(QuantType::F16, r, x),
                QuantType::BF16 => |r, x| dot_row(QuantType::BF16, r, x),
                QuantType::Q8_0 => |r, x| dot_row(QuantType::Q8_0, r, x),
                QuantType::Q4_0 => |r, x| dot_row(QuantType::Q4_0, r, x),
                QuantType::Q4_1 => |r, x| dot_row(QuantType::Q4_1, r, x),
                QuantType::Q5_0 => |r, x| dot_row(QuantType::Q5_0, r, x),
                QuantType::Q4K => |r, x| dot_row(QuantType::Q4K, r, x),
                QuantType::Q6K => |r, x| dot_row(QuantType::Q6K, r, x),
                QuantType::Q5_1 => |r, x| dot_row(QuantType::Q5_1, r, x),
                QuantType::Q2K => |r, x| dot_row(QuantType::Q2K, r, x),
                QuantType::Q3K => |r, x| dot_row(QuantType::Q3K, r, x),
                QuantType::Q5K => |r, x| dot_row(QuantType::Q5K, r, x),
                QuantType::IQ4NL => |r, x| dot_row(QuantType::IQ4NL, r, x),
                QuantType::IQ4XS => |r, x| dot_row(QuantType::IQ4XS, r, x),
            })
        });
        // Repacked rows: unpacked to ggml blocks, then as above.
        fn unpacked(q: QuantType, row: &[u8], x: &[f32]) -> f32 {
            let mut ggml = vec![0u8; row.len()];
            repack::unpack_row(q, row, &mut ggml);
            dot_row(q, &ggml, x)
        }
        let repacked = QuantType::ALL.map(|q| {
            let f: DotF32Fn = match q {
                QuantType::Q8_0 => |r, x| unpacked(QuantType::Q8_0, r, x),
                QuantType::Q4_0 => |r, x| unpacked(QuantType::Q4_0, r, x),
                QuantType::Q4_1 => |r, x| unpacked(QuantType::Q4_1, r, x),
                QuantType::Q5_0 => |r, x| unpacked(QuantType::Q5_0, r, x),
                _ => return None,
            };
            Some(RowDot::F32(f))
        });
        Self {
            isa: Isa::Scalar,
            repacked_dots: repacked,
            sparse_repacked_dots: repacked,
            repack: repack::repack_row,
            unpack: repack::unpack_row,
            dequantize_repacked: repack::dequantize_row,
            quantize: quantize_act::scalar,
            dequantize: crate::dequant::dequantize_row,
            gemm_q8a: None,
            glu: glu::scalar,
            dot_rows: dot_rows::scalar,
            axpy_rows: axpy::scalar,
            softmax: softmax::scalar,
            tail_mass: tail_mass::scalar,
            dot_rows_f16: dot_rows::scalar,
            axpy_rows_f16: axpy::scalar,
            dot_rows_many: dot_rows::select_many(Isa::Scalar),
            axpy_rows_many: axpy::select_many(Isa::Scalar),
            dot_rows_many_f16: dot_rows::select_many_f16(Isa::Scalar),
            axpy_rows_many_f16: axpy::select_many_f16(Isa::Scalar),
            axpy_q: axpy_q::scalar,
            axpy_blocks: axpy_blocks::scalar,
            axpy_blocks_q8: None,
            dots,
            sparse_dots: dots,
        }
    }

    /// The row dot for weights of type `q`, for a dense product (`sparse == false`: it
    /// prefetches ahead) or a subset of rows (the caller prefetches).
    pub fn dot(&self, q: QuantType, sparse: bool) -> RowDot {
        let table = if sparse {
            &self.sparse_dots
        } else {
            &self.dots
        };
        table[slot(q)]
    }

    /// The row dot for `w` (its type and layout), dense or for a subset of rows (see [`Self::dot`]).
    pub fn dot_for(&self, w: &Weight, sparse: bool) -> RowDot {
        match w.layout {
            RowLayout::Ggml => self.dot(w.qtype, sparse),
            RowLayout::Repacked => {
                let table = if sparse {
                    &self.sparse_repacked_dots
                } else {
                    &self.repacked_dots
                };
                table[slot(w.qtype)]
                    .unwrap_or_else(|| panic!("{:?} rows are never repacked", w.qtype))
            }
            // The device refuses products of these before any kernel runs.
            RowLayout::InputBlocks => panic!("input-block matrices are read by axpy only"),
        }
    }
}

/// The index of `q` in the per-type tables.
fn slot(q: QuantType) -> usize {
    QuantType::ALL.iter().position(|&t| t == q).unwrap_or(0)
}

/// The table of the process's selected tier (see [`isa::selected`]).
pub fn kernels() -> Result<&'static Kernels, IsaError> {
    static K: OnceLock<Result<Kernels, IsaError>> = OnceLock::new();
    K.get_or_init(|| {
        isa::selected().map(|i| Kernels::for_isa(i).expect("selected tiers are supported"))
    })
    .as_ref()
    .map_err(Clone::clone)
}
