//! Greedy output does not change with the thread count (issue 23): every row's reduction is the
//! same at any split, so the logits of a prefill batch and of the decode steps after it are
//! bit-identical at 1, 2 and 3 threads (the prefill tiles used to follow the thread count).
mod common;
use common::*;
use dejavu::exec::Decoder;
use dejavu::exec::{Engine, EngineOptions};
use dejavu::sparsity::policy::Policy;

fn logits(path: &std::path::Path, threads: usize, prompt: &[u32]) -> Vec<Vec<f32>> {
    let eng = Engine::load(
        path,
        &EngineOptions {
            threads: Some(threads),
            n_ctx: Some(512),
            ..Default::default()
        },
    )
    .unwrap();
    let policy = Policy::dense(&eng.model.config);
    let mut dec = eng.decoder(&policy).unwrap();
    let mut out = vec![dec.decode(prompt).unwrap().to_vec()];
    for t in [17u32, 4242, 9] {
        out.push(dec.decode(&[t]).unwrap().to_vec());
    }
    out
}

#[test]
fn logits_are_bit_identical_at_any_thread_count() {
    for name in [SMOLLM2, QWEN] {
        let path = model_path(name);
        let eng = engine(name);
        let text = eng.tokenizer.encode(&public_eval()[..1500]).unwrap();
        drop(eng);
        // Short prompts too: the product's blocking depends on the batch's shape.
        for n in [6, 37, text.len()] {
            let prompt = &text[..n];
            let one = logits(&path, 1, prompt);
            for threads in [2, 3] {
                let other = logits(&path, threads, prompt);
                for (step, (a, b)) in one.iter().zip(&other).enumerate() {
                    let same = a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
                    assert!(
                        same,
                        "{name}: {n} tokens, step {step} differs at 1 and {threads} threads"
                    );
                }
            }
        }
    }
}
