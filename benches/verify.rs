//! What a speculative verification costs on the CPU (issue 26, item 4): `n` tokens verified in
//! one batch (`DeviceSession::verify`, each row as a decode step computes it), against the same
//! `n` tokens as decode steps and as a prompt's batch (`Logits::Range`, the integer GEMM from 4
//! rows), on a dense session of SmolLM2 (2 threads, 64 cached positions; fetched on first use).
//! Run: `cargo bench --bench verify`.
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use dejavu::exec::{Decoder, Engine, EngineOptions, Logits};
use dejavu::sparsity::policy::Policy;

fn verify(c: &mut Criterion) {
    let path = dejavu::fetch::fetch("smollm2-135m-instruct").expect("SmolLM2");
    let opts = EngineOptions {
        threads: Some(2),
        n_ctx: Some(256),
        ..Default::default()
    };
    let eng = Engine::load(path, &opts).expect("load");
    let mut dec = eng
        .decoder(&Policy::dense(&eng.model.config))
        .expect("session");
    let prompt: Vec<u32> = (100..164).collect();
    dec.decode(&prompt).expect("prompt");
    let at = prompt.len();
    let mut g = c.benchmark_group("verify");
    g.sample_size(20);
    for n in [1usize, 3, 5, 9] {
        let toks: Vec<u32> = (200..200 + n as u32).collect();
        g.bench_with_input(BenchmarkId::new("verify", n), &toks, |b, t| {
            b.iter(|| {
                dec.verify(t).expect("verify");
                dec.truncate(at);
            })
        });
        g.bench_with_input(BenchmarkId::new("steps", n), &toks, |b, t| {
            b.iter(|| {
                for &x in t {
                    dec.decode(&[x]).expect("step");
                }
                dec.truncate(at);
            })
        });
        g.bench_with_input(BenchmarkId::new("batch", n), &toks, |b, t| {
            b.iter(|| {
                dec.run(t, Logits::Range(0, t.len())).expect("batch");
                dec.truncate(at);
            })
        });
    }
    g.finish();
}

criterion_group!(benches, verify);
criterion_main!(benches);
