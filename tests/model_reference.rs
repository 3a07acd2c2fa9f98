//! The engine on the real models against tests/reference (llama.cpp, an independent mature engine, f32
//! weights): tokenizer ids, teacher-forced logits, incremental decoding, perplexity.
//!
//! Logit tolerances, derived:
//! - The prompt tiles (`--deterministic false`) on tiers without an integer prefill kernel (`gemm_q8a`): f32
//!   activations on f32-dequantized weights, as the reference, so only summation order and
//!   transcendental rounding differ. A dot of length n <= 4864 carries a
//!   relative error of typically sqrt(n) * 2^-24 ~ 4e-6 of its absolute sum; through 24-30 residual
//!   layers this stays well under 0.1 on logits of magnitude 10-35. We assert
//!   |ours - ref| <= 0.05 + 0.002 |ref| (measured worst: 0.013 SmolLM2, 0.019 Qwen). On tiers
//!   with the integer kernel (AVX-512) a batch quantizes activations as decode does (below) and
//!   gets the decode tolerance (measured: worst 0.82 SmolLM2, 0.40 Qwen).
//! - Decode path, under every ISA tier this CPU has: activations are quantized to 8 bits per
//!   block of 32 (as llama.cpp does), each value moving by up to max|block| / 254; with the
//!   outlier channels of these models that is a ~1% perturbation per matmul, compounded over the
//!   layers. That rounding is discontinuous: a last-bit change upstream (summation order of an f32
//!   kernel) can flip an 8-bit value and move a logit by tenths. Measured: replacing attention's
//!   f32 dot and axpy by tier kernels that agree with the scalar reference to 1e-6 moved the worst
//!   SmolLM2 error relative to top-1 from 0.45 / 0.58 / 0.68 (scalar / portable / AVX2) to
//!   0.49 / 1.13 / 0.57 (Qwen now: 0.31 / 0.19 / 0.19), so one tier's worst step is not a
//!   stable figure. Logits are compared relative to the reference top-1 logit (softmax ignores
//!   a common shift) within 1.5 and absolutely within 1.5, and the top-1 rule must still hold;
//!   a wrong kernel (a dropped block, a wrong scale) moves logits by whole units at every step,
//!   and the perplexity tests below bound the average.
mod common;
use common::*;
use dejavu::exec::Logits;
use dejavu::sparsity::SparsePlan;
use dejavu::text::sampling::argmax;
use dejavu_backend_cpu::isa::Isa;
use dejavu_backend_cpu::kernels::table::Kernels;
use dejavu_backend_cpu::CpuBackend;

/// How the teacher-forced sequence is fed: one batch on the default, batch-invariant device
/// (each row computed as its decode step computes it: bit for bit the token-by-token logits),
/// one token at a time (decode kernels, 8-bit quantized activations for quantized weights), or
/// one batch through the prompt tiles (`--deterministic false`: f32 activations, or 8-bit ones
/// on tiers with the integer prefill kernel).
#[derive(Clone, Copy, PartialEq, Debug)]
enum Feed {
    Batch,
    TokenByToken,
    Tiles,
}

/// Logit tolerances of one feed: `|ours - ref| <= abs + rel |ref|`, the same relative to the
/// top-1 logit within `shift`, and the reference's top-1 token ours where its lead over the
/// second exceeds `margin`.
#[derive(Clone, Copy)]
struct Tol {
    abs: f32,
    rel: f32,
    shift: f32,
    margin: f32,
}

/// Batches with f32 activations (see the header).
const F32_BATCH: Tol = Tol {
    abs: 0.05,
    rel: 0.002,
    shift: 0.05,
    margin: 0.5,
};
/// 8-bit activations (decode, and batches on tiers with the integer prefill kernel).
const Q8_ACTS: Tol = Tol {
    abs: 1.5,
    rel: 0.0,
    shift: 1.5,
    margin: 0.5,
};

/// The teacher-forced logits of every case, fed as `feed`, checked against the reference
/// within `tol`.
fn check_model(name: &str, isa: Isa, feed: Feed, tol: Tol) -> Vec<Vec<f32>> {
    let Tol {
        abs: abs_tol,
        rel: rel_tol,
        shift: shift_tol,
        margin: margin_tol,
    } = tol;
    let eng = engine(name);
    let r = reference(name);
    let mut cpu = OnCpu::new(&eng, CpuBackend::with_isa(isa, 2).unwrap(), false);
    if feed == Feed::Tiles {
        cpu.dev = cpu.dev.with_prompt_tiles();
    }
    let mut all = Vec::new();
    let plan = SparsePlan::dense(&eng.model.config);
    let vocab = eng.model.config.vocab_size;
    let (mut worst, mut worst_rel) = (0f32, 0f32);
    let (mut checked_top1, mut skipped_top1) = (0, 0);
    for case in &r.greedy.cases {
        assert_eq!(
            eng.tokenizer.encode(&case.prompt).unwrap(),
            case.prompt_ids,
            "{name}: tokenizer on {:?}",
            case.prompt
        );
        // Teacher forcing: feed prompt + reference tokens in one batch, read every step's logits.
        let mut seq = case.prompt_ids.clone();
        seq.extend(&case.greedy_ids[..case.steps.len() - 1]);
        let p = case.prompt_ids.len();
        let mut s = cpu.fixed(&plan, eng.n_ctx);
        let logits: Vec<f32> = match feed {
            Feed::Batch | Feed::Tiles => s
                .run(&seq, Logits::Range(p - 1, seq.len()))
                .unwrap()
                .to_vec(),
            Feed::TokenByToken => {
                s.run(&seq[..p - 1], Logits::Last).unwrap();
                let mut step = |t: u32| s.run(&[t], Logits::Last).unwrap().to_vec();
                seq[p - 1..].iter().flat_map(|&t| step(t)).collect()
            }
        };
        all.push(logits.clone());
        for (i, step) in case.steps.iter().enumerate() {
            let row = &logits[i * vocab..(i + 1) * vocab];
            let margin = step.top5[0].1 - step.top5[1].1;
            if margin > margin_tol {
                assert_eq!(
                    argmax(row),
                    step.top5[0].0,
                    "{name} {feed:?} {:?} step {i}: top-1 differs",
                    case.prompt
                );
                checked_top1 += 1;
            } else {
                skipped_top1 += 1;
            }
            // Logits are compared relative to the reference's top-1 token, since softmax ignores
            // a common shift of all logits.
            let (top_id, top_want) = step.top5[0];
            let top_got = row[top_id as usize];
            for &(id, want) in &step.top5 {
                let got = row[id as usize];
                let err = (got - want).abs();
                let rel_err = ((got - top_got) - (want - top_want)).abs();
                worst = worst.max(err);
                worst_rel = worst_rel.max(rel_err);
                assert!(
                    err <= abs_tol + rel_tol * want.abs() && rel_err <= shift_tol,
                    "{name} {feed:?} {:?} step {i} token {id}: {got} vs {want} (relative to top-1: {rel_err})",
                    case.prompt
                );
            }
        }
    }
    eprintln!("{name} {isa} {feed:?}: worst top-5 logit error {worst:.5}, relative to top-1 {worst_rel:.5}; top-1 checked at {checked_top1} steps, {skipped_top1} under margin");
    all
}

/// Batches on every tier and token by token on every tier. The prompt tiles' products take f32
/// activations on tiers without an integer prefill kernel (tolerance 0.05) and 8-bit ones where
/// it has one (`gemm_q8a`), as every decode step does (the decode tolerance, 1.5); the default
/// device's batches are its decode steps.
fn check_every_feed(name: &str, f32_batch: Tol, q8_acts: Tol) {
    check_feeds(name, &Isa::supported(), f32_batch, q8_acts);
}

/// The tiles and token by token on the given tiers (the tiles with the tolerance of the tier's
/// prefill path); and on this CPU's best tier, the default device's batch bit for bit its
/// token-by-token decoding (issue 52; the kernels' tests check every tier's multi-token paths
/// against their one-token calls, bit for bit).
fn check_feeds(name: &str, tiers: &[Isa], f32_batch: Tol, q8_acts: Tol) {
    for &isa in tiers {
        let integer = Kernels::for_isa(isa).is_some_and(|k| k.gemm_q8a.is_some());
        let tiles = if integer { q8_acts } else { f32_batch };
        check_model(name, isa, Feed::Tiles, tiles);
        let steps = check_model(name, isa, Feed::TokenByToken, q8_acts);
        if isa != Isa::detect() {
            continue;
        }
        let batch = check_model(name, isa, Feed::Batch, q8_acts);
        let bits = |v: &[Vec<f32>]| -> Vec<Vec<u32>> {
            v.iter()
                .map(|c| c.iter().map(|x| x.to_bits()).collect())
                .collect()
        };
        assert!(
            bits(&batch) == bits(&steps),
            "{name} {isa}: a batch's logits are not its decode steps' bit for bit"
        );
    }
}

#[test]
fn smollm2_matches_reference() {
    check_every_feed(SMOLLM2, F32_BATCH, Q8_ACTS);
}

#[test]
fn qwen_matches_reference() {
    check_every_feed(QWEN, F32_BATCH, Q8_ACTS);
}

/// Gemma 3's residual stream is large (embeddings scaled by sqrt(640), four norms a layer), so
/// 8-bit activations move its logits more: llama.cpp's own 8-bit path on this file (its default
/// run, against its f32 weights, the greedy steps where both agree) deviates by up to 3.0, 2.38
/// relative to the top-1 logit; ours is held to 3.0 relative to top-1 (8.0 absolute), and the
/// top-1 token where the reference leads by more than that. With f32 activations the reference's
/// own f16 GELU table is the largest difference left (measured worst 0.126, 0.071 relative).
#[test]
fn gemma_matches_reference() {
    let f32_batch = Tol {
        abs: 0.2,
        shift: 0.1,
        ..F32_BATCH
    };
    let q8_acts = Tol {
        abs: 8.0,
        rel: 0.0,
        shift: 3.0,
        margin: 3.0,
    };
    // The tiers' kernels are checked on every tier with SmolLM2 and Qwen; Gemma (a 262144-token
    // head) runs the f32 prefill path's tier and this CPU's best one, to keep the suite short.
    let tiers = [Isa::Portable, Isa::detect()];
    check_feeds(GEMMA, &tiers, f32_batch, q8_acts);
}

/// Token-by-token decoding through the KV cache gives the logits of the batched forward pass.
/// Both run on the f32 reference backend, its batches through the prompt tiles, so only
/// summation order differs (per-row dots vs dequantized gemm); the integer decode kernels are
/// checked against the reference above (the default device's batches are its steps bit for
/// bit: `check_feeds`).
#[test]
fn incremental_decode_matches_batch() {
    for name in [SMOLLM2, QWEN] {
        let eng = engine(name);
        let mut cpu = OnCpu::new(&eng, CpuBackend::f32_reference(2), false);
        cpu.dev = cpu.dev.with_prompt_tiles();
        let plan = SparsePlan::dense(&eng.model.config);
        let vocab = eng.model.config.vocab_size;
        let case = &reference(name).greedy.cases[1];
        let mut seq = case.prompt_ids.clone();
        seq.extend(&case.greedy_ids[..8]);
        let batch = (cpu.fixed(&plan, eng.n_ctx))
            .run(&seq, Logits::Range(0, seq.len()))
            .unwrap()
            .to_vec();
        let mut s = cpu.fixed(&plan, eng.n_ctx);
        for (i, &t) in seq.iter().enumerate() {
            let step = s.run(&[t], Logits::Last).unwrap();
            let want = &batch[i * vocab..(i + 1) * vocab];
            let worst = step
                .iter()
                .zip(want)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            assert!(
                worst < 0.02,
                "{name} position {i}: max logit difference {worst}"
            );
        }
        assert_eq!(s.len(), seq.len());
    }
}

/// The decode kernels (8-bit activations) score the text within 1% of the mature engine's
/// native-quantization figure; SmolLM2 only, to keep the suite short (Qwen's decode path is
/// checked token by token above). Scored in batches: on the default, batch-invariant device a
/// batch's logits are its token-by-token decoding's bit for bit (`check_feeds` asserts it).
#[test]
fn smollm2_decode_path_perplexity_within_1_percent_of_native() {
    let eng = engine(SMOLLM2);
    let r = reference(SMOLLM2).perplexity;
    let tokens = eng.tokenizer.encode(&public_eval()).unwrap();
    let plan = SparsePlan::dense(&eng.model.config);
    let feed = dejavu::eval::perplexity::Feed::Batch;
    let res = dejavu::eval::perplexity::perplexity(
        &eng,
        &mut eng.session(eng.fixed_plan(&plan).unwrap()).unwrap(),
        &tokens,
        r.ctx,
        feed,
        |_, _, _| {},
    )
    .unwrap();
    assert_eq!(res.n_scored, r.chunks * (r.ctx / 2 - 1));
    let rel = (res.ppl / r.reference_native_quant - 1.0).abs();
    eprintln!(
        "decode path: ppl {:.4}, reference native {:.4} ({:+.3}%)",
        res.ppl,
        r.reference_native_quant,
        100.0 * rel
    );
    assert!(
        rel < 0.01,
        "decode-path ppl {} vs native reference {}",
        res.ppl,
        r.reference_native_quant
    );
}

fn check_perplexity(name: &str) {
    let eng = engine(name);
    let r = reference(name).perplexity;
    let tokens = eng.tokenizer.encode(&public_eval()).unwrap();
    let plan = SparsePlan::dense(&eng.model.config);
    let res = dejavu::eval::perplexity::perplexity(
        &eng,
        &mut eng.session(eng.fixed_plan(&plan).unwrap()).unwrap(),
        &tokens,
        r.ctx,
        dejavu::eval::perplexity::Feed::Batch,
        |_, _, _| {},
    )
    .unwrap();
    assert_eq!(res.n_chunks, r.chunks);
    assert_eq!(res.n_scored, r.chunks * (r.ctx / 2 - 1));
    let rel = (res.ppl / r.reference_f32_weights - 1.0).abs();
    eprintln!(
        "{name}: ppl {:.4}, reference f32 {:.4} ({:+.3}%)",
        res.ppl,
        r.reference_f32_weights,
        100.0 * rel
    );
    assert!(
        rel < 0.01,
        "{name}: ppl {} vs reference {}",
        res.ppl,
        r.reference_f32_weights
    );
}

#[test]
fn smollm2_perplexity_within_1_percent() {
    check_perplexity(SMOLLM2);
}

#[test]
fn qwen_perplexity_within_1_percent() {
    check_perplexity(QWEN);
}

#[test]
fn gemma_perplexity_within_1_percent() {
    check_perplexity(GEMMA);
}
