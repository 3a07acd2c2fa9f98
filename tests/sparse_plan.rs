//! The forward pass under sparse plans: a full plan is the dense model; a random plan equals the
//! dense model whose skipped neurons and heads are masked out in the weights themselves.
mod common;
use common::*;
use dejavu::exec::Logits;
use dejavu::exec::{Engine, EngineOptions};
use dejavu::sparsity::{LayerPlan, SparsePlan};
use dejavu_backend_api::IndexSet;
use dejavu_formats::gguf::GgmlType;
use rand::{seq::index::sample, SeedableRng};

const TOKENS: [u32; 6] = [72, 101, 108, 108, 111, 33];

fn tiny_engine(bytes: &[u8]) -> (tempfile::NamedTempFile, Engine) {
    let f = temp_file(bytes);
    let e = Engine::load(
        f.path(),
        &EngineOptions {
            threads: Some(2),
            n_ctx: None,
            ..Default::default()
        },
    )
    .unwrap();
    (f, e)
}

/// Logits of every token, fed one at a time (the decode path), on the f32 reference backend:
/// the integer kernels quantize activations per block of 32, so zeroed heads would change the
/// rounding of their neighbours and masked-dense equality would not hold there. A sparse plan
/// reads the sparse layout (the down projection and W_o transposed).
fn decode_logits(e: &Engine, plans: &SparsePlan) -> Vec<f32> {
    let backend = dejavu_backend_cpu::CpuBackend::f32_reference(2);
    let cpu = OnCpu::new(e, backend, !plans.is_dense());
    let mut s = cpu.fixed(plans, e.n_ctx);
    (TOKENS.iter())
        .flat_map(|&t| s.run(&[t], Logits::Last).unwrap().to_vec())
        .collect()
}

fn random_plan(e: &Engine, seed: u64) -> SparsePlan {
    let c = &e.model.config;
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let mut pick = |n: usize, k: usize| {
        IndexSet::from_unsorted(
            n,
            sample(&mut rng, n, k)
                .into_iter()
                .map(|i| i as u32)
                .collect(),
        )
        .unwrap()
    };
    let layers = (0..c.n_layers)
        .map(|_| {
            LayerPlan::new(c, pick(c.n_ff, c.n_ff / 3), pick(c.n_heads, c.n_heads / 2)).unwrap()
        })
        .collect();
    SparsePlan::new(c, layers).unwrap()
}

#[test]
fn full_plan_from_explicit_indices_equals_dense_on_real_model() {
    let eng = engine(SMOLLM2);
    let c = &eng.model.config;
    let all = |n: usize| IndexSet::new(n, (0..n as u32).collect()).unwrap();
    let explicit = SparsePlan::new(
        c,
        (0..c.n_layers)
            .map(|_| LayerPlan::new(c, all(c.n_ff), all(c.n_heads)).unwrap())
            .collect(),
    )
    .unwrap();
    assert!(explicit.is_dense());
    let ids = eng
        .tokenizer
        .encode("Contextual sparsity skips weights.")
        .unwrap();
    let run = |plan: &SparsePlan| {
        let mut s = eng.session(eng.fixed_plan(plan).unwrap()).unwrap();
        s.run(&ids, Logits::Range(0, ids.len())).unwrap().to_vec()
    };
    assert_eq!(run(&explicit), run(&SparsePlan::dense(c)));
}

#[test]
fn random_plan_equals_masked_dense_reference() {
    // F32 down projections and W_o: their sparse layout is an exact transposition.
    let base = tiny_f32_down();
    let (_f, eng) = tiny_engine(&base);
    let c = eng.model.config.clone();
    for seed in 0..3 {
        let plan = random_plan(&eng, seed);
        assert!(!plan.is_dense());
        let sparse = decode_logits(&eng, &plan);
        // Mask the weights: zero the gate rows of skipped neurons (silu(0) * up = 0) and the W_o
        // columns of skipped heads. Q8_0 values of 0 dequantize to exactly 0.
        let hd = c.head_dim;
        let masked = tiny_llama_gguf(|_, tensors| {
            f32_down(tensors);
            for (name, dims, ty, bytes) in tensors.iter_mut() {
                let cols = dims[0] as usize;
                let mut zero = |row: usize, col: usize| match ty {
                    GgmlType::Q8_0 => {
                        bytes[(row * cols + col) / 32 * 34 + 2 + (row * cols + col) % 32] = 0
                    }
                    _ => {
                        let at = (row * cols + col) * 4;
                        bytes[at..at + 4].fill(0)
                    }
                };
                let layer: Option<usize> = name
                    .strip_prefix("blk.")
                    .and_then(|s| s.split('.').next())
                    .and_then(|s| s.parse().ok());
                let Some(l) = layer else { continue };
                let lp = &plan.layers[l];
                if name.ends_with("ffn_gate.weight") {
                    (0..c.n_ff)
                        .filter(|&n| !lp.mlp.contains(n))
                        .for_each(|n| (0..cols).for_each(|k| zero(n, k)));
                }
                if name.ends_with("attn_output.weight") {
                    for h in (0..c.n_heads).filter(|&h| !lp.heads.contains(h)) {
                        (0..c.d_model)
                            .for_each(|r| (h * hd..(h + 1) * hd).for_each(|k| zero(r, k)));
                    }
                }
            }
        });
        let (_g, masked_eng) = tiny_engine(&masked);
        let dense = decode_logits(&masked_eng, &SparsePlan::dense(&c));
        // The same sums in another order (the transposed rows, compact selections).
        let scale = dense.iter().fold(0f32, |m, v| m.max(v.abs()));
        for (a, b) in sparse.iter().zip(&dense) {
            assert!(
                (a - b).abs() <= 1e-5 * scale,
                "seed {seed}: sparse plan {a} vs masked dense model {b}"
            );
        }
        // And a sparse plan really changes the output of the unmasked model.
        assert_ne!(sparse, decode_logits(&eng, &SparsePlan::dense(&c)));
    }
}

#[test]
fn plans_are_validated() {
    let (_f, eng) = tiny_engine(&tiny_llama_gguf(|_, _| {}));
    let c = &eng.model.config;
    assert!(LayerPlan::new(c, IndexSet::full(c.n_ff + 1), IndexSet::full(c.n_heads)).is_err());
    assert!(LayerPlan::new(c, IndexSet::full(c.n_ff), IndexSet::full(c.n_heads - 1)).is_err());
    assert!(SparsePlan::new(c, vec![LayerPlan::dense(c)]).is_err());
}
