//! Per-ISA kernels: one operation per file, each with its scalar reference, its SIMD tiers and a
//! test comparing every tier this CPU supports with the reference. [`table`] picks one function
//! per (operation, weight type) for the selected [`crate::isa::Isa`].
/// The `select(isa, prefetch)` of a quantized dot kernel file: the file's `avx512::<PF>` and
/// `avx2::<PF>` (x86-64; `PF`: the kernel prefetches the weight bytes ahead of the row it reads,
/// for dense products; sparse row loops prefetch the selected rows themselves), with `neon` the
/// file's `neon::<DOT>` (aarch64, [`arm_q8a_tiers`]), `portable` and `scalar` functions, chosen by
/// tier. A file without NEON kernels runs its portable one on the NEON tiers.
macro_rules! select_q8a_kernel {
    ($($neon:ident)?) => {
        pub fn select(isa: Isa, prefetch: bool) -> super::table::DotQ8AFn {
            match (isa, prefetch) {
                #[cfg(target_arch = "x86_64")]
                (Isa::Avx512, true) => avx512::<true>,
                #[cfg(target_arch = "x86_64")]
                (Isa::Avx512, false) => avx512::<false>,
                #[cfg(target_arch = "x86_64")]
                (Isa::Avx2, true) => avx2::<true>,
                #[cfg(target_arch = "x86_64")]
                (Isa::Avx2, false) => avx2::<false>,
                (Isa::Neon | Isa::Dotprod, _) => select_q8a_kernel!(@neon isa $($neon)?),
                (Isa::Portable, _) => portable,
                _ => scalar,
            }
        }
    };
    (@neon $isa:ident) => {
        portable
    };
    (@neon $isa:ident neon) => {{
        #[cfg(target_arch = "aarch64")]
        let f: super::table::DotQ8AFn = match $isa {
            Isa::Dotprod => neon::<true>,
            _ => neon::<false>,
        };
        // The NEON tiers are never supported off aarch64: unreachable, but total.
        #[cfg(not(target_arch = "aarch64"))]
        let f: super::table::DotQ8AFn = portable;
        f
    }};
}

/// The NEON tiers of a Q8A dot kernel file: `neon::<DOT>` checks the row's length (in release
/// builds) and hands its blocks of type `$block` to the file's kernel compiled with `neon` (and
/// `dotprod` when `DOT`): `$body::<DOT>`, or with `blocks`, [`arm::block_loop`] over the file's
/// [`arm::Block32`] blocks.
macro_rules! arm_q8a_tiers {
    ($block:ty, blocks) => {
        #[cfg(target_arch = "aarch64")]
        #[inline(always)]
        unsafe fn arm_blocks<const DOT: bool>(
            w: &[$block],
            act: &[dejavu_backend_api::quant::BlockQ8A],
        ) -> f32 {
            super::arm::block_loop::<$block, DOT>(w, act)
        }
        arm_q8a_tiers!($block, arm_blocks);
    };
    ($block:ty, $body:ident) => {
        #[cfg(target_arch = "aarch64")]
        fn neon<const DOT: bool>(row: &[u8], act: &[dejavu_backend_api::quant::BlockQ8A]) -> f32 {
            super::check_q8a(QTYPE, row, act);
            let w = super::as_blocks::<$block>(row);
            // SAFETY: handed out by `select` only for tiers whose features this CPU has.
            unsafe {
                if DOT {
                    arm_dotprod_impl(&w, act)
                } else {
                    arm_neon_impl(&w, act)
                }
            }
        }
        #[cfg(target_arch = "aarch64")]
        #[target_feature(enable = "neon")]
        unsafe fn arm_neon_impl(w: &[$block], act: &[dejavu_backend_api::quant::BlockQ8A]) -> f32 {
            $body::<false>(w, act)
        }
        #[cfg(target_arch = "aarch64")]
        #[target_feature(enable = "neon,dotprod")]
        unsafe fn arm_dotprod_impl(
            w: &[$block],
            act: &[dejavu_backend_api::quant::BlockQ8A],
        ) -> f32 {
            $body::<true>(w, act)
        }
    };
}

/// The x86 tiers of a Q8A dot kernel file: `avx2::<PF>` and `avx512::<PF>` check the row's
/// length (in release builds) and hand its blocks of type `$block` to the file's kernel compiled
/// for the tier's features: `$body::<VNNI, PF>`, or with `pairs`, the 32-wide
/// `x86::pair_loop` over the file's [`x86::Step32`] blocks.
macro_rules! x86_q8a_tiers {
    ($block:ty, pairs) => {
        #[cfg(target_arch = "x86_64")]
        #[inline(always)]
        unsafe fn x86_pairs<const VNNI: bool, const PF: bool>(
            w: &[$block],
            act: &[dejavu_backend_api::quant::BlockQ8A],
        ) -> f32 {
            super::x86::pair_loop::<$block, VNNI, PF>(w, act)
        }
        x86_q8a_tiers!($block, x86_pairs);
    };
    ($block:ty, $body:ident) => {
        #[cfg(target_arch = "x86_64")]
        fn avx2<const PF: bool>(row: &[u8], act: &[dejavu_backend_api::quant::BlockQ8A]) -> f32 {
            super::check_q8a(QTYPE, row, act);
            // SAFETY: handed out by `select` only for tiers whose features this CPU has.
            unsafe { avx2_impl::<PF>(&super::as_blocks::<$block>(row), act) }
        }
        #[cfg(target_arch = "x86_64")]
        fn avx512<const PF: bool>(row: &[u8], act: &[dejavu_backend_api::quant::BlockQ8A]) -> f32 {
            super::check_q8a(QTYPE, row, act);
            // SAFETY: handed out by `select` only for tiers whose features this CPU has.
            unsafe { avx512_impl::<PF>(&super::as_blocks::<$block>(row), act) }
        }
        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn avx2_impl<const PF: bool>(
            w: &[$block],
            act: &[dejavu_backend_api::quant::BlockQ8A],
        ) -> f32 {
            $body::<false, PF>(w, act)
        }
        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
        unsafe fn avx512_impl<const PF: bool>(
            w: &[$block],
            act: &[dejavu_backend_api::quant::BlockQ8A],
        ) -> f32 {
            $body::<true, PF>(w, act)
        }
    };
}

/// The length contract of a row dot against [`BlockQ8A`] activations, checked by every tier in
/// release builds (the SIMD tiers read through raw pointers): `row` holds exactly the
/// `act.len() * 32` elements of type `q`.
#[inline(always)]
pub(crate) fn check_q8a(
    q: dejavu_backend_api::quant::QuantType,
    row: &[u8],
    act: &[dejavu_backend_api::quant::BlockQ8A],
) {
    let n = act.len() * dejavu_backend_api::quant::QK;
    assert!(
        n.is_multiple_of(q.block_len()) && row.len() == q.row_bytes(n),
        "{} row dot: a row of {} bytes against {} activation blocks ({} bytes expected)",
        q.name(),
        row.len(),
        act.len(),
        q.row_bytes(n)
    );
}

/// Most tokens one call of a multi-token Q8A dot takes ([`table::DotQ8ATokensFn`]).
pub const MAX_Q8A_TOKENS: usize = 8;

/// The length contract of a multi-token Q8A dot: 1..=[`MAX_Q8A_TOKENS`] tokens, each as
/// [`check_q8a`] states, and one output each.
#[inline(always)]
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub(crate) fn check_q8a_tokens(
    q: dejavu_backend_api::quant::QuantType,
    row: &[u8],
    acts: &[&[dejavu_backend_api::quant::BlockQ8A]],
    out: &[f32],
) {
    assert!(
        (1..=MAX_Q8A_TOKENS).contains(&acts.len()) && out.len() == acts.len(),
        "{} row dot: {} tokens for {} outputs (1..={MAX_Q8A_TOKENS})",
        q.name(),
        acts.len(),
        out.len()
    );
    for act in acts {
        check_q8a(q, row, act);
    }
}

/// The x86 tiers of a file's multi-token Q8A dot: `select_tokens(isa, prefetch)` hands out
/// `avx512_tokens::<PF>` or `avx2_tokens::<PF>`, which check their lengths (in release builds)
/// and run the file's `$body::<VNNI, PF>(blocks, acts, out)`: each block's quants unpacked
/// once for all the tokens, then each token's sums as the one-token kernel computes them, so
/// every output equals that kernel's bit for bit (the test says so). Other tiers: `None` (the
/// one-token kernel per token).
macro_rules! x86_q8a_tokens {
    ($block:ty, $body:ident) => {
        pub fn select_tokens(isa: Isa, prefetch: bool) -> Option<super::table::DotQ8ATokensFn> {
            match (isa, prefetch) {
                #[cfg(target_arch = "x86_64")]
                (Isa::Avx512, true) => Some(avx512_tokens::<true>),
                #[cfg(target_arch = "x86_64")]
                (Isa::Avx512, false) => Some(avx512_tokens::<false>),
                #[cfg(target_arch = "x86_64")]
                (Isa::Avx2, true) => Some(avx2_tokens::<true>),
                #[cfg(target_arch = "x86_64")]
                (Isa::Avx2, false) => Some(avx2_tokens::<false>),
                _ => None,
            }
        }
        #[cfg(target_arch = "x86_64")]
        fn avx512_tokens<const PF: bool>(
            row: &[u8],
            acts: &[&[dejavu_backend_api::quant::BlockQ8A]],
            out: &mut [f32],
        ) {
            super::check_q8a_tokens(QTYPE, row, acts, out);
            // SAFETY: handed out by `select_tokens` only for tiers whose features this CPU
            // has; the lengths were checked above.
            unsafe { avx512_tokens_impl::<PF>(&super::as_blocks::<$block>(row), acts, out) }
        }
        #[cfg(target_arch = "x86_64")]
        fn avx2_tokens<const PF: bool>(
            row: &[u8],
            acts: &[&[dejavu_backend_api::quant::BlockQ8A]],
            out: &mut [f32],
        ) {
            super::check_q8a_tokens(QTYPE, row, acts, out);
            // SAFETY: as in `avx512_tokens`.
            unsafe { avx2_tokens_impl::<PF>(&super::as_blocks::<$block>(row), acts, out) }
        }
        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
        unsafe fn avx512_tokens_impl<const PF: bool>(
            w: &[$block],
            acts: &[&[dejavu_backend_api::quant::BlockQ8A]],
            out: &mut [f32],
        ) {
            $body::<true, PF>(w, acts, out)
        }
        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn avx2_tokens_impl<const PF: bool>(
            w: &[$block],
            acts: &[&[dejavu_backend_api::quant::BlockQ8A]],
            out: &mut [f32],
        ) {
            $body::<false, PF>(w, acts, out)
        }
    };
}

#[cfg(target_arch = "aarch64")]
mod arm;
pub mod axpy;
pub mod axpy_blocks;
pub mod axpy_blocks_i8;
pub mod axpy_q;
mod block_tables;
pub mod dequantize;
pub mod dot_float;
pub mod dot_iq4nl;
pub mod dot_iq4xs;
pub mod dot_q2k;
pub mod dot_q3k;
pub mod dot_q4_0;
pub mod dot_q4_1;
pub mod dot_q4k;
pub mod dot_q5_0;
pub mod dot_q5_1;
pub mod dot_q5k;
pub mod dot_q6k;
pub mod dot_q8_0;
pub mod dot_repacked;
pub mod dot_rows;
pub mod gemm_q8a;
pub mod glu;
pub mod quantize_act;
pub mod repack;
pub mod softmax;
pub mod table;
pub mod tail_mass;
#[cfg(test)]
pub(crate) mod testutil;
#[cfg(target_arch = "x86_64")]
mod x86;

/// `row` as blocks of `B`: borrowed when it is aligned for them (as loaded weights always are:
/// the loader refuses misaligned tensors), else copied, so a misaligned row is read right and
/// never makes a kernel panic.
pub(crate) fn as_blocks<B: bytemuck::Pod>(row: &[u8]) -> std::borrow::Cow<'_, [B]> {
    match bytemuck::try_cast_slice(row) {
        Ok(blocks) => std::borrow::Cow::Borrowed(blocks),
        Err(_) => std::borrow::Cow::Owned(bytemuck::pod_collect_to_vec(row)),
    }
}

/// `dot_rows`' and `axpy`'s many-vector kernels (`(xs, rows, stride, outs)`) on the tiers
/// that read the rows once per vector: one call of `f`, the one-vector kernel, per vector.
pub(crate) fn each_vector<T>(
    what: &str,
    f: fn(&[f32], &[T], usize, &mut [f32]),
    xs: &[&[f32]],
    rows: &[T],
    stride: usize,
    outs: &mut [&mut [f32]],
) {
    check_many(what, xs, outs);
    for (x, o) in xs.iter().zip(outs.iter_mut()) {
        f(x, rows, stride, o);
    }
}

/// A many-vector kernel's contract: as many vectors as outputs, the vectors of one length, the
/// outputs of one length.
pub(crate) fn check_many(what: &str, xs: &[&[f32]], outs: &[&mut [f32]]) {
    assert!(
        xs.len() == outs.len()
            && xs.iter().all(|x| x.len() == xs[0].len())
            && outs.iter().all(|o| o.len() == outs[0].len()),
        "{what}: {} vectors for {} outputs, or lengths that differ",
        xs.len(),
        outs.len()
    );
}

/// An element of the rows that `dot_rows` and `axpy` read: f32, or f16 (an f16 KV cache),
/// widened to f32 exactly.
pub trait RowElem: Copy + Send + Sync + 'static {
    fn widen(self) -> f32;
    /// `s[..8]` as eight f32 lanes.
    fn load8(s: &[Self]) -> wide::f32x8;
}

impl RowElem for f32 {
    #[inline(always)]
    fn widen(self) -> f32 {
        self
    }
    #[inline(always)]
    fn load8(s: &[Self]) -> wide::f32x8 {
        wide::f32x8::from(&s[..8])
    }
}

impl RowElem for half::f16 {
    #[inline(always)]
    fn widen(self) -> f32 {
        self.to_f32()
    }
    #[inline(always)]
    fn load8(s: &[Self]) -> wide::f32x8 {
        let s = &s[..8];
        wide::f32x8::from(std::array::from_fn::<f32, 8, _>(|i| s[i].to_f32()))
    }
}
