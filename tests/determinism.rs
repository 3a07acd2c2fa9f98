//! Same request, same reply (issue 52): on the CPU a token's logits do not depend on how its
//! prompt was split, on a cached prefix, on the requests batched beside it or on the thread
//! count, so every way of sending a request gives the bytes `dejavu generate` prints.
//!
//! For SmolLM2 and Qwen2.5-Coder-0.5B, 16 requests of 4 chat prompts, greedy and sampled at
//! temperature 0.8 with a fixed seed, against `dejavu serve` as a process:
//! (a) one by one, (b) all at once with `--parallel 8`, (c) each again after itself (a warm
//! prompt cache: all but its last token reused), (d) with `"cache_prompt": false`, (e) under
//! `-t 1` and `-t 2`, (f) under a sparse policy (`gate-first:0.5`, against `generate` under
//! it). Every reply must equal `generate`'s byte for byte. And the logits of a prompt's last
//! position are bit for bit the same whether the prompt ran whole, in chunks of 1, 7 or 64
//! tokens, or after a cached prefix, at 1 and 2 threads, dense and under the policy.
mod common;

use common::same_reply::{replies_equal_generate, SPARSE};
use common::{engine, model_path, QWEN, SMOLLM2};
use dejavu::exec::{Engine, EngineOptions};
use dejavu::sparsity::policy::Policy;

fn on_the_cpu(name: &str) {
    replies_equal_generate(&model_path(name), name, &[], &["dense", SPARSE]);
}

#[test]
fn smollm2_replies_are_generates_however_they_are_sent() {
    on_the_cpu(SMOLLM2);
}

#[test]
fn qwen_replies_are_generates_however_they_are_sent() {
    on_the_cpu(QWEN);
}

/// The last position's logits of `ids` on a fresh sequence, the prompt run as `chunks` (each
/// [`Decoder::prompt`], after `cached` tokens run and kept as a prefix first).
fn last_logits(
    eng: &Engine,
    policy: &Policy,
    ids: &[u32],
    chunk: usize,
    cached: usize,
) -> Vec<u32> {
    let mut dec = eng.decoder(policy).unwrap();
    if cached > 0 {
        // A cache that held a longer sequence: the prefix is kept, the rest run again.
        dec.prompt(ids).unwrap();
        dec.truncate(cached);
    }
    let mut last = Vec::new();
    for c in ids[cached..].chunks(chunk) {
        last = dec.prompt(c).unwrap().iter().map(|v| v.to_bits()).collect();
    }
    last
}

#[test]
fn a_positions_logits_do_not_depend_on_the_prompts_split() {
    for name in [SMOLLM2, QWEN] {
        let text = "The old harbour town woke up slowly, and the fishermen carried their nets \
                    down to the boats while the gulls circled overhead. ";
        let ids = engine(name).tokenizer.encode(&text.repeat(4)).unwrap();
        assert!(ids.len() > 64, "{} tokens", ids.len());
        for threads in [1, 2] {
            let opts = EngineOptions {
                threads: Some(threads),
                n_ctx: Some(256),
                ..Default::default()
            };
            let eng = Engine::load(model_path(name), &opts).unwrap();
            let policies = [
                Policy::dense(&eng.model.config),
                Policy::parse(SPARSE, &eng.model.config, None).unwrap(),
            ];
            for policy in &policies {
                let whole = last_logits(&eng, policy, &ids, ids.len(), 0);
                for (chunk, cached) in [(1, 0), (7, 0), (64, 0), (ids.len(), 40), (5, 61)] {
                    let got = last_logits(&eng, policy, &ids, chunk, cached);
                    assert!(
                        got == whole,
                        "{name} -t {threads} {}: chunks of {chunk} after {cached} cached \
                         differ from the whole prompt",
                        policy.name
                    );
                }
            }
        }
    }
}

/// `--deterministic true` on the GPU refuses what it cannot keep, before any device opens (so
/// this runs in a build without CUDA too): a sparse policy (a step of several sequences computes
/// the union of their neurons) and `--tensor-parallel` (NCCL picks its algorithm by size).
#[test]
fn the_gpus_deterministic_mode_refuses_sparse_plans_and_tensor_parallelism() {
    let fixture = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/hf/llama-silu");
    let base = [
        "generate",
        "-m",
        fixture,
        "-p",
        "hi",
        "-n",
        "2",
        "--backend",
        "cuda",
    ];
    let det = ["--deterministic", "true"];
    let sparse = [&base[..], &det, &["--sparsity", "gate-first:0.5"]].concat();
    common::fails_with(&sparse, "runs dense plans only");
    let tp = [&base[..], &det, &["--tensor-parallel", "2"]].concat();
    common::fails_with(&tp, "--deterministic runs on one GPU");
}
