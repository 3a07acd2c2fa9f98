//! Lossless speculation (`--speculate K`, issue 26 item 4): a sparse plan drafts, the dense model
//! verifies. On the CPU a verification's rows are the dense decode steps' logits bit for bit, so
//! greedy speculation must produce dense decoding's very tokens (and stop for the same reason),
//! on the real models and the trained fixtures, at any K, through context limits and a
//! continued conversation.
mod common;
use common::*;
use dejavu::exec::{Decoder, Engine, EngineOptions};
use dejavu::text::generate::{generate_speculative, GenerateStats, Stop, StopRules};
use dejavu::text::sampling::{Sampler, SamplerConfig};
use std::path::PathBuf;

fn fixture(name: &str, n_ctx: usize) -> Engine {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/hf")
        .join(name);
    let opts = EngineOptions {
        n_ctx: Some(n_ctx),
        ..Default::default()
    };
    Engine::load(dir, &opts).unwrap()
}

fn real(name: &str, n_ctx: usize) -> Engine {
    let opts = EngineOptions {
        threads: Some(2),
        n_ctx: Some(n_ctx),
        ..Default::default()
    };
    Engine::load(model_path(name), &opts).unwrap()
}

/// Generate from `turns` one after another on one sequence (each turn's prompt appended after
/// what the cache holds, as a chat continues), under `spec` (`None`: dense decoding) drafting
/// with `policy`; the tokens and stats of each turn.
fn turns(
    e: &Engine,
    policy: &str,
    spec: Option<usize>,
    turns: &[Vec<u32>],
    max_tokens: usize,
    cfg: SamplerConfig,
    rules: &StopRules,
) -> Vec<(Vec<u32>, GenerateStats)> {
    let pol = e.policy(if spec.is_some() { policy } else { "dense" }, None);
    let mut dec = e.decoder(&pol.unwrap()).unwrap();
    let mut sampler = Sampler::new(cfg);
    let mut out = Vec::new();
    for prompt in turns {
        let base = dec.len();
        let dec: &mut dyn Decoder = &mut dec;
        let r = generate_speculative(
            e,
            dec,
            prompt,
            max_tokens,
            &mut sampler,
            rules,
            spec,
            |_| {},
        );
        let (tokens, stats) = r.unwrap();
        // Every emitted token is in the cache but the last one, unless an end token followed.
        let undecoded = usize::from(stats.stop != Stop::EndOfGeneration && !tokens.is_empty());
        assert_eq!(
            dec.len(),
            base + prompt.len() + tokens.len() - undecoded,
            "{policy}, K {spec:?}: the cache holds the prompt and the decoded tokens"
        );
        out.push((tokens, stats));
    }
    out
}

fn assert_same_as_dense(
    e: &Engine,
    what: &str,
    policies: &[&str],
    ks: &[usize],
    prompts: &[Vec<u32>],
    n: usize,
) {
    let rules = StopRules::default();
    let dense = turns(
        e,
        "dense",
        None,
        prompts,
        n,
        SamplerConfig::greedy(),
        &rules,
    );
    for policy in policies {
        for &k in ks {
            let spec = turns(
                e,
                policy,
                Some(k),
                prompts,
                n,
                SamplerConfig::greedy(),
                &rules,
            );
            for (i, ((dt, ds), (st, ss))) in dense.iter().zip(&spec).enumerate() {
                assert_eq!(
                    dt, st,
                    "{what}: {policy}, K {k}, turn {i}: not dense decoding's tokens"
                );
                assert_eq!(ds.stop, ss.stop, "{what}: {policy}, K {k}, turn {i}: stop");
                let sp = ss.speculation.expect("speculation's stats");
                assert!(
                    sp.dense_passes > 0 && sp.accepted <= sp.drafted,
                    "{what}: {sp:?}"
                );
                assert!(sp.drafted <= sp.dense_passes * k, "{what}: {sp:?}");
            }
        }
    }
}

fn eval_prompts(e: &Engine, lens: &[usize]) -> Vec<Vec<u32>> {
    let text = public_eval();
    let ids = e.tokenizer.encode(&text[..4000]).unwrap();
    let mut at = 0;
    lens.iter()
        .map(|&n| {
            let p = ids[at..at + n].to_vec();
            at += n;
            p
        })
        .collect()
}

#[test]
fn greedy_speculation_is_dense_decoding_on_the_real_models() {
    let e = real(SMOLLM2, 512);
    let prompts = eval_prompts(&e, &[40, 7]);
    let policies = ["gate-first:0.3", "up-first:0.5+attn-norm:0.5"];
    assert_same_as_dense(&e, SMOLLM2, &policies, &[1, 3, 8], &prompts, 48);
    let e = real(QWEN, 512);
    let prompts = eval_prompts(&e, &[30, 5]);
    assert_same_as_dense(&e, QWEN, &["gate-first:0.3"], &[4], &prompts, 32);
}

#[test]
fn greedy_speculation_is_dense_decoding_on_the_fixtures() {
    for (name, policy) in [
        ("opt-relu", "oracle:0.3+attn-norm:0.5"),
        ("llama-silu", "gate-first:0.25"),
        ("gemma3", "up-first:0.3"),
        ("qwen3", "attn-norm:0.4"),
    ] {
        // A short context: some turns end on it (the drafts are cut to the room left).
        let e = fixture(name, 96);
        let prompts = eval_prompts(&e, &[12, 5, 9]);
        assert_same_as_dense(&e, name, &[policy], &[1, 2, 5], &prompts, 30);
        let rules = StopRules::default();
        let g = SamplerConfig::greedy();
        let stops: Vec<Stop> = (turns(&e, policy, Some(5), &prompts, 30, g, &rules).iter())
            .map(|(_, s)| s.stop)
            .collect();
        assert!(stops.contains(&Stop::ContextFull), "{name}: {stops:?}");
    }
}

#[test]
fn a_verification_is_the_dense_steps_bit_for_bit() {
    let e = real(SMOLLM2, 256);
    let prompt = eval_prompts(&e, &[20, 9]);
    let vocab = e.model.config.vocab_size;
    for policy in ["dense", "gate-first:0.2+attn-norm:0.5"] {
        let mut dec = e.decoder(&e.policy(policy, None).unwrap()).unwrap();
        dec.decode(&prompt[0]).unwrap();
        // The draft's own steps first, as speculation runs them: the verification overwrites.
        for &t in &prompt[1] {
            dec.decode(&[t]).unwrap();
        }
        dec.truncate(prompt[0].len());
        let rows = dec.verify(&prompt[1]).unwrap().to_vec();
        assert_eq!(rows.len(), prompt[1].len() * vocab);
        let mut dense = e.decoder(&e.policy("dense", None).unwrap()).unwrap();
        dense.decode(&prompt[0]).unwrap();
        for (i, &t) in prompt[1].iter().enumerate() {
            let step = dense.decode(&[t]).unwrap();
            let row = &rows[i * vocab..(i + 1) * vocab];
            let same = step
                .iter()
                .zip(row)
                .all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "{policy}: row {i} differs from the dense step");
        }
    }
}

#[test]
fn sampled_speculation_is_seeded_and_stops_where_asked() {
    let e = fixture("llama-silu", 256);
    let prompts = eval_prompts(&e, &[10]);
    let cfg = SamplerConfig {
        temperature: 0.9,
        seed: 11,
        ..Default::default()
    };
    let rules = StopRules {
        ignore_eos: true,
        ..Default::default()
    };
    let a = turns(
        &e,
        "gate-first:0.3",
        Some(4),
        &prompts,
        40,
        cfg.clone(),
        &rules,
    );
    let b = turns(&e, "gate-first:0.3", Some(4), &prompts, 40, cfg, &rules);
    assert_eq!(a[0].0, b[0].0, "one seed, one text");
    assert_eq!(a[0].0.len(), 40, "ignore_eos runs to max_tokens");
    let vocab = e.tokenizer.vocab_size() as u32;
    assert!(a[0].0.iter().all(|&t| t < vocab));
}

#[test]
fn speculation_refuses_what_it_cannot_verify() {
    let e = fixture("opt-relu", 64);
    let pol = e.policy("attn-norm:0.5+lazy-kv", None).unwrap();
    let mut dec = e.decoder(&pol).unwrap();
    let mut s = Sampler::new(SamplerConfig::greedy());
    let rules = StopRules::default();
    let err = generate_speculative(&e, &mut dec, &[5, 6, 7], 8, &mut s, &rules, Some(2), |_| {})
        .unwrap_err()
        .to_string();
    assert!(err.contains("lazy K/V"), "{err}");
    let mut dec = e.decoder(&e.policy("dense", None).unwrap()).unwrap();
    let err = generate_speculative(&e, &mut dec, &[5, 6], 8, &mut s, &rules, Some(0), |_| {})
        .unwrap_err()
        .to_string();
    assert!(err.contains("at least 1"), "{err}");
}
