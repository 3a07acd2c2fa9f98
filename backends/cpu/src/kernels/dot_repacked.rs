//! Repacked row (see [`super::repack`]) . Q8A activations, for Q8_0, Q4_0, Q4_1 and Q5_0.
//!
//! Reference: each block decoded from the group layout and dotted as its ggml type's reference
//! does (`d_w d_a sum(q qa)`, minus `8 d_w s_a` (Q4_0) or `16 d_w s_a` (Q5_0), plus `m_w s_a`
//! (Q4_1)); the ggml tail blocks by the type's own reference.
//!
//! The x86 tiers take a group (8 blocks) per step: lane `j` of every vector is block `j`, so
//! 8 integer dots (Q8_0 signs, nibble masks and Q5_0 fifth bits first) give the 8 block sums in
//! one register, then one conversion of the 8 scales and one multiply-add serve all 8 blocks.
//! The ggml-layout kernels spend a horizontal reduction, a scale conversion, a broadcast and a
//! multiply-add per block: that made them compute-bound (7-12 GB/s per core).
//!
//! The NEON tiers do the same with 128-bit vectors: a 32-byte step is two registers, blocks
//! 0..4 and 4..8, each lane one block, summed by `sdot` (or its widening emulation).
//!
//! The portable and scalar tiers use the reference: the engine repacks only on the x86 and NEON
//! tiers ([`repacks`]).
use super::repack::{self, ActGroup, GROUP};
use crate::isa::Isa;
use dejavu_backend_api::quant::{BlockQ8A, QuantType};

/// `(row, act, groups)`: a repacked row, the token's activation blocks, and the same blocks'
/// whole groups transposed ([`repack::act_groups`]).
pub type DotR8Fn = fn(&[u8], &[BlockQ8A], &[ActGroup]) -> f32;

/// Most tokens one [`DotR8TokensFn`] call takes.
pub const MAX_TOKENS: usize = 8;

/// `(rows, acts, groups, out)`: repacked rows of one length, back to back, each dotted with
/// `acts.len()` tokens (1..=[`MAX_TOKENS`]), token `t` given by its blocks `acts[t]` and their
/// groups `groups[t]`; `out` holds `acts.len()` outputs per row (`out[r * n + t]`), and the rows
/// are `out.len() / n` equal parts of `rows`. Each output equals the same tier's [`DotR8Fn`] on
/// its row and token bit for bit: a batch of decode rows gets its steps' logits. The x86 tiers
/// unpack each group's quants once for all the tokens (the integer work a one-token dot repeats
/// per token), and run the rows of one call in one loop (one check, no call per row: short rows
/// make a call's overhead count); the others call the one-token dot.
pub type DotR8TokensFn = fn(&[u8], &[&[BlockQ8A]], &[&[ActGroup]], &mut [f32]);

/// Does this tier read repacked rows faster than ggml rows (so the backend should repack)?
pub fn repacks(isa: Isa, q: QuantType) -> bool {
    repack::supports(q) && matches!(isa, Isa::Avx2 | Isa::Avx512 | Isa::Neon | Isa::Dotprod)
}

/// A repacked type, for the SIMD tiers' `Group` impls: its ggml type, and the factor of its
/// offset term `sum(off_w * s_a)` (0: none; `off_w` is `d_w`, or the Q4_1 mins).
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
pub(crate) trait Repacked {
    const Q: QuantType;
    const OFF_SCALE: f32;
}

macro_rules! repacked_types {
    ($($t:ident: $q:ident, $off:expr;)*) => {$(
        #[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
        pub(crate) struct $t;
        #[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
        impl Repacked for $t {
            const Q: QuantType = QuantType::$q;
            const OFF_SCALE: f32 = $off;
        }
    )*};
}

repacked_types! {
    R8_0: Q8_0, 0.0;
    R4_0: Q4_0, -8.0;
    R4_1: Q4_1, 1.0;
    R5_0: Q5_0, -16.0;
}

/// The function of `isa` (and `prefetch`) for the repacked type `$t`: `x86::$avx512` or
/// `x86::$avx2` (`::<$t, PREFETCH>`), `arm::$neon` (`::<$t, DOTPROD>`), else `$other`.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
macro_rules! tier_fn {
    ($t:ty, $isa:expr, $pf:expr, $avx512:ident, $avx2:ident, $neon:ident, $other:expr) => {
        match ($isa, $pf) {
            #[cfg(target_arch = "x86_64")]
            (Isa::Avx512, true) => x86::$avx512::<$t, true>,
            #[cfg(target_arch = "x86_64")]
            (Isa::Avx512, false) => x86::$avx512::<$t, false>,
            #[cfg(target_arch = "x86_64")]
            (Isa::Avx2, true) => x86::$avx2::<$t, true>,
            #[cfg(target_arch = "x86_64")]
            (Isa::Avx2, false) => x86::$avx2::<$t, false>,
            #[cfg(target_arch = "aarch64")]
            (Isa::Dotprod, _) => arm::$neon::<$t, true>,
            #[cfg(target_arch = "aarch64")]
            (Isa::Neon, _) => arm::$neon::<$t, false>,
            _ => $other,
        }
    };
}

/// [`tier_fn`] for the repacked type of `q`; `$other` for the tiers without one, the other
/// types and other architectures.
macro_rules! by_type {
    ($q:expr, $isa:expr, $pf:expr, $avx512:ident, $avx2:ident, $neon:ident, $other:expr) => {{
        #[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
        let f = match $q {
            QuantType::Q8_0 => tier_fn!(R8_0, $isa, $pf, $avx512, $avx2, $neon, $other),
            QuantType::Q4_0 => tier_fn!(R4_0, $isa, $pf, $avx512, $avx2, $neon, $other),
            QuantType::Q4_1 => tier_fn!(R4_1, $isa, $pf, $avx512, $avx2, $neon, $other),
            QuantType::Q5_0 => tier_fn!(R5_0, $isa, $pf, $avx512, $avx2, $neon, $other),
            _ => $other,
        };
        #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
        let f = {
            let _ = ($isa, $pf);
            $other
        };
        f
    }};
}

/// The dot of repacked rows of `q` (one of [`repack::supports`]) for `isa`, prefetching ahead
/// if `prefetch` (dense products; the NEON tiers never prefetch).
pub fn select(q: QuantType, isa: Isa, prefetch: bool) -> DotR8Fn {
    by_type!(q, isa, prefetch, avx512, avx2, neon, scalar_of(q))
}

/// The multi-token dot of repacked rows of `q` for `isa` (see [`DotR8TokensFn`]), prefetching
/// ahead if `prefetch` (the NEON tiers never prefetch).
pub fn select_tokens(q: QuantType, isa: Isa, prefetch: bool) -> DotR8TokensFn {
    by_type!(
        q,
        isa,
        prefetch,
        avx512_tokens,
        avx2_tokens,
        neon_tokens,
        scalar_tokens_of(q)
    )
}

/// The scalar reference token by token.
fn scalar_tokens_of(q: QuantType) -> DotR8TokensFn {
    macro_rules! each {
        ($($q:ident)*) => {
            match q {
                $(QuantType::$q => |rows, a, g, o| {
                    let rb = check_tokens(QuantType::$q, rows, a, g, o);
                    for (r, o) in rows.chunks_exact(rb).zip(o.chunks_exact_mut(a.len())) {
                        for ((a, g), o) in a.iter().zip(g).zip(o.iter_mut()) {
                            *o = scalar_of(QuantType::$q)(r, a, g);
                        }
                    }
                },)*
                _ => panic!("{q:?} rows are never repacked"),
            }
        };
    }
    each!(Q8_0 Q4_0 Q4_1 Q5_0)
}

/// The scalar reference for repacked rows of `q`.
pub fn scalar_of(q: QuantType) -> DotR8Fn {
    match q {
        QuantType::Q8_0 => |r, a, g| {
            check(QuantType::Q8_0, r, a, g);
            scalar(QuantType::Q8_0, r, a)
        },
        QuantType::Q4_0 => |r, a, g| {
            check(QuantType::Q4_0, r, a, g);
            scalar(QuantType::Q4_0, r, a)
        },
        QuantType::Q4_1 => |r, a, g| {
            check(QuantType::Q4_1, r, a, g);
            scalar(QuantType::Q4_1, r, a)
        },
        QuantType::Q5_0 => |r, a, g| {
            check(QuantType::Q5_0, r, a, g);
            scalar(QuantType::Q5_0, r, a)
        },
        _ => panic!("{q:?} rows are never repacked"),
    }
}

/// The ggml-layout reference of `q`, for the tail blocks.
fn ggml_scalar(q: QuantType) -> super::table::DotQ8AFn {
    match q {
        QuantType::Q8_0 => super::dot_q8_0::scalar,
        QuantType::Q4_0 => super::dot_q4_0::scalar,
        QuantType::Q4_1 => super::dot_q4_1::scalar,
        _ => super::dot_q5_0::scalar,
    }
}

/// The length contract, checked by every tier in release builds: `row` holds the
/// `act.len() * 32` elements of `q`, and `groups` are `act`'s whole groups (`repack::act_groups`).
#[inline(always)] // per row: inlined, the type's sizes fold to constants
fn check(q: QuantType, row: &[u8], act: &[BlockQ8A], groups: &[ActGroup]) {
    super::check_q8a(q, row, act);
    assert!(
        groups.len() == act.len() / GROUP,
        "repacked row dot: {} activation groups for {} blocks",
        groups.len(),
        act.len()
    );
}

/// The contract of a [`DotR8TokensFn`] call, checked once for all its rows: 1..=[`MAX_TOKENS`]
/// tokens, `out` a whole number (at least one) of rows' outputs, `rows` as many rows of one
/// length, and [`check`] of that length for every token. Returns the row length in bytes.
fn check_tokens(
    q: QuantType,
    rows: &[u8],
    acts: &[&[BlockQ8A]],
    groups: &[&[ActGroup]],
    out: &[f32],
) -> usize {
    let n = acts.len();
    assert!(
        (1..=MAX_TOKENS).contains(&n) && groups.len() == n && out.len().is_multiple_of(n),
        "repacked row dot: {n} tokens' blocks and {} tokens' groups for {} outputs (1..={MAX_TOKENS} tokens)",
        groups.len(),
        out.len(),
    );
    let n_rows = out.len() / n;
    assert!(
        n_rows > 0 && rows.len().is_multiple_of(n_rows),
        "repacked row dot: {} bytes are not {n_rows} rows",
        rows.len()
    );
    let rb = rows.len() / n_rows;
    for (a, g) in acts.iter().zip(groups) {
        check(q, &rows[..rb], a, g);
    }
    rb
}

fn scalar(q: QuantType, row: &[u8], act: &[BlockQ8A]) -> f32 {
    super::check_q8a(q, row, act);
    let gb = repack::layout(q).bytes;
    let groups = (row.len() / gb).min(act.len() / GROUP);
    let mut acc = 0f32;
    for (g, a8) in row
        .chunks_exact(gb)
        .take(groups)
        .zip(act.chunks_exact(GROUP))
    {
        for (j, a) in a8.iter().enumerate() {
            let b = repack::group_block(q, g, j);
            let s: i32 =
                b.q.iter()
                    .zip(&a.qs)
                    .map(|(&w, &x)| w as i32 * x as i32)
                    .sum();
            let d = half::f16::from_bits(b.d).to_f32();
            acc += match q {
                QuantType::Q8_0 => d * a.d * s as f32,
                QuantType::Q4_0 => d * (a.d * s as f32 - 8.0 * a.s),
                QuantType::Q4_1 => d * a.d * s as f32 + half::f16::from_bits(b.m).to_f32() * a.s,
                _ => d * (a.d * s as f32 - 16.0 * a.s),
            };
        }
    }
    acc + ggml_scalar(q)(&row[groups * gb..], &act[groups * GROUP..])
}

#[cfg(target_arch = "x86_64")]
mod x86;

#[cfg(target_arch = "aarch64")]
mod arm;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::repack::repack_row;
    use crate::kernels::table::Kernels;
    use crate::kernels::testutil::{random_f32, random_row};
    use dejavu_backend_api::quant::QK;

    const TYPES: [QuantType; 4] = [
        QuantType::Q8_0,
        QuantType::Q4_0,
        QuantType::Q4_1,
        QuantType::Q5_0,
    ];

    fn groups_of(act: &[BlockQ8A]) -> Vec<ActGroup> {
        let mut g = vec![ActGroup::ZERO; act.len() / GROUP];
        repack::act_groups(act, &mut g);
        g
    }

    fn act_of(x: &[f32]) -> Vec<BlockQ8A> {
        let mut act = vec![
            BlockQ8A {
                d: 0.0,
                s: 0.0,
                qs: [0; QK]
            };
            x.len() / QK
        ];
        (Kernels::for_isa(Isa::Scalar).unwrap().quantize)(x, &mut act);
        act
    }

    /// The repacked reference equals the ggml reference on the same row (same per-block terms
    /// in the same order, so equal up to f32 rounding of the sum), and every tier's repacked dot
    /// (prefetching or not) is within 1e-5 of `sum |w x|` of the reference: whole groups, ragged
    /// tails and tail-only rows.
    #[test]
    fn tiers_match_reference() {
        for q in TYPES {
            for blocks in [1usize, 7, 8, 9, 28, 33, 67] {
                let n = blocks * QK;
                let row = random_row(q, n, 11 * blocks as u64);
                let mut packed = vec![0u8; row.len()];
                repack_row(q, &row, &mut packed);
                let x = random_f32(n, blocks as u64);
                let act = act_of(&x);
                let mut deq = vec![0f32; n];
                crate::dequant::dequantize_row(q, &row, &mut deq);
                let mag: f32 = deq.iter().zip(&x).map(|(w, x)| (w * x).abs()).sum();
                let Some(ggml) = Kernels::for_isa(Isa::Scalar).unwrap().dot(q, false).q8a() else {
                    panic!()
                };
                let want = ggml(&row, &act);
                let groups = groups_of(&act);
                let reference = scalar_of(q)(&packed, &act, &groups);
                assert!(
                    (reference - want).abs() <= 1e-6 * mag + 1e-6,
                    "{q:?} {blocks}"
                );
                for isa in Isa::supported() {
                    for pf in [false, true] {
                        let got = select(q, isa, pf)(&packed, &act, &groups);
                        assert!(
                            (got - reference).abs() <= 1e-5 * mag + 1e-6,
                            "{isa} {q:?} {blocks} blocks (prefetch {pf}): {got} vs {reference}"
                        );
                    }
                }
            }
        }
    }

    /// Every tier's multi-token dot gives each token its one-token dot bit for bit (1 to
    /// `MAX_TOKENS` tokens, whole groups, ragged tails and tail-only rows, prefetching or not;
    /// 1 to 4 rows per call, so the AVX-512 tier's row pairs meet an odd row and none), and
    /// refuses mismatched token counts.
    #[test]
    fn tokens_equal_one_token_dots() {
        for q in TYPES {
            for blocks in [1usize, 8, 9, 28, 67] {
                let n = blocks * QK;
                let row = random_row(q, n, 3 * blocks as u64);
                let mut packed = vec![0u8; row.len()];
                repack_row(q, &row, &mut packed);
                // Four rows back to back: this one and three others.
                let mut many_rows = packed.clone();
                for seed in [5, 6, 7] {
                    let other = random_row(q, n, seed * blocks as u64);
                    let mut p = vec![0u8; other.len()];
                    repack_row(q, &other, &mut p);
                    many_rows.extend_from_slice(&p);
                }
                let acts: Vec<Vec<BlockQ8A>> = (0..MAX_TOKENS as u64)
                    .map(|t| act_of(&random_f32(n, 17 + t)))
                    .collect();
                let groups: Vec<Vec<ActGroup>> = acts.iter().map(|a| groups_of(a)).collect();
                for isa in Isa::supported() {
                    for pf in [false, true] {
                        let (one, many) = (select(q, isa, pf), select_tokens(q, isa, pf));
                        for (k, n_rows) in
                            (1..=MAX_TOKENS).flat_map(|k| (1..=4).map(move |r| (k, r)))
                        {
                            let a: Vec<&[BlockQ8A]> = acts[..k].iter().map(|a| &a[..]).collect();
                            let g: Vec<&[ActGroup]> = groups[..k].iter().map(|g| &g[..]).collect();
                            let rows = &many_rows[..n_rows * packed.len()];
                            let mut out = vec![f32::NAN; n_rows * k];
                            many(rows, &a, &g, &mut out);
                            for (r, row) in rows.chunks_exact(packed.len()).enumerate() {
                                for t in 0..k {
                                    let want = one(row, &acts[t], &groups[t]);
                                    assert_eq!(
                                        out[r * k + t].to_bits(),
                                        want.to_bits(),
                                        "{isa} {q:?} {blocks} blocks, {k} tokens, row {r} of \
                                         {n_rows}, token {t}"
                                    );
                                }
                            }
                        }
                        let a = [&acts[0][..]];
                        let refused = std::panic::catch_unwind(|| {
                            many(&packed, &a, &[&groups[0][..]], &mut [0.0; 2])
                        });
                        assert!(refused.is_err(), "{isa} {q:?}: 1 token, 2 outputs, 1 row");
                        let refused = std::panic::catch_unwind(|| {
                            many(&many_rows[1..], &a, &[&groups[0][..]], &mut [0.0; 3])
                        });
                        assert!(refused.is_err(), "{isa} {q:?}: 3 rows short of a byte");
                    }
                }
            }
        }
    }

    /// Q8_0 quants of -128 (the sign trick's edge) and Q5_0 rows of all-ones high bits.
    #[test]
    fn extreme_quants() {
        for (q, fill) in [(QuantType::Q8_0, 0x80u8), (QuantType::Q5_0, 0xFF)] {
            let n = 16 * QK;
            let mut row = random_row(q, n, 5);
            let bb = q.block_bytes();
            for b in row.chunks_exact_mut(bb) {
                b[2..].fill(fill);
            }
            let mut packed = vec![0u8; row.len()];
            repack_row(q, &row, &mut packed);
            let act = act_of(&random_f32(n, 3));
            let groups = groups_of(&act);
            let want = scalar_of(q)(&packed, &act, &groups);
            for isa in Isa::supported() {
                let got = select(q, isa, true)(&packed, &act, &groups);
                assert!(
                    (got - want).abs() <= 1e-5 * want.abs() + 1e-4,
                    "{isa} {q:?}"
                );
            }
        }
    }
}
