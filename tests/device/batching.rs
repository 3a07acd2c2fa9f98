//! Steps of several sequences (continuous batching, `DeviceSession::step_many`) against each
//! sequence's own decode steps on the same device.
use super::*;

/// Which sequences step together at each step, in which row order: all, a subset out of
/// order, one alone, all reversed, two.
const ROUNDS: [&[usize]; 5] = [&[0, 1, 2, 3], &[2, 0], &[3], &[3, 2, 1, 0], &[1, 3]];

/// On every fixture (learned positions, RoPE of both styles, grouped queries, Q/K norms,
/// sliding windows, soft caps, post-norm blocks), four dense sequences with prompts of
/// different lengths step in the batches of [`ROUNDS`]; each row's logits equal the same
/// sequence stepping alone on the same device (`exact`: bit for bit, the CPU's batch
/// invariance; else within the suite's tolerance), and so does a step after them (the
/// batched steps' keys and values are its own steps'). Returns the worst error.
pub fn batched_steps_are_each_sequences_own<D: Device>(dev: &D, exact: bool) -> f32 {
    let mut worst = 0f32;
    for name in FIXTURES {
        let eng = load(name);
        let c = &eng.model.config;
        let dense = eng.policy("dense", None).unwrap();
        let dm = eng.device_model(dev, &[&dense]).unwrap();
        let open = || {
            let plan = DevicePlan::policy(dev, c, &dense).unwrap();
            DeviceSession::new(dev, &dm, plan, 32).unwrap()
        };
        let mut batched: Vec<_> = (0..4).map(|_| open()).collect();
        let mut alone: Vec<_> = (0..4).map(|_| open()).collect();
        for (i, (b, a)) in batched.iter_mut().zip(&mut alone).enumerate() {
            let prompt = &TOKENS[i..2 * i + 2];
            b.forward(prompt).unwrap();
            a.forward(prompt).unwrap();
        }
        let mut check = |what: String, got: &[f32], want: &[f32]| {
            if exact {
                let same = (got.iter().zip(want)).all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "{what}: not the sequence's own step bit for bit");
            }
            worst = worst.max(assert_close(&what, got, want));
        };
        for (round, seqs) in ROUNDS.iter().enumerate() {
            let tokens: Vec<u32> = seqs.iter().map(|&s| TOKENS[(round * 3 + s) % 9]).collect();
            let mut refs: Vec<Option<&mut DeviceSession<D>>> =
                batched.iter_mut().map(Some).collect();
            let mut rows: Vec<_> = seqs.iter().map(|&s| refs[s].take().unwrap()).collect();
            let got = DeviceSession::step_many(&mut rows, &tokens).unwrap();
            assert_eq!(got.len(), seqs.len() * c.vocab_size);
            for (r, (&s, &t)) in seqs.iter().zip(&tokens).enumerate() {
                let want = alone[s].forward(&[t]).unwrap();
                let row = &got[r * c.vocab_size..(r + 1) * c.vocab_size];
                check(format!("{name}: round {round}, sequence {s}"), row, want);
            }
        }
        for (s, (b, a)) in batched.iter_mut().zip(&mut alone).enumerate() {
            assert_eq!(b.len(), a.len(), "{name}: sequence {s}'s length");
            let got = b.forward(&[TOKENS[s]]).unwrap().to_vec();
            check(
                format!("{name}: sequence {s}'s step after"),
                &got,
                a.forward(&[TOKENS[s]]).unwrap(),
            );
        }
    }
    worst
}

#[test]
fn batched_steps_on_every_cpu_tier_are_each_sequences_own() {
    use dejavu_backend_cpu::isa::Isa;
    batched_steps_are_each_sequences_own(&CpuDevice::reference(), true);
    for isa in Isa::supported() {
        batched_steps_are_each_sequences_own(&CpuDevice::with_isa(isa, 2).unwrap(), true);
    }
}

/// A step of several sequences refuses, before anything runs: a sequence under a sparse plan,
/// one whose context is full, a token out of the vocabulary, and a token count that is not the
/// sequence count. No sequence's cache changes.
#[test]
fn a_bad_step_of_several_sequences_changes_nothing() {
    let dev = CpuDevice::reference();
    let eng = load("llama-silu");
    let c = &eng.model.config;
    let (dense, sparse) = (
        eng.policy("dense", None).unwrap(),
        eng.policy("gate-first:0.3", None).unwrap(),
    );
    let dm = eng.device_model(&dev, &[&sparse]).unwrap();
    let open = |p, n_ctx| {
        DeviceSession::new(&dev, &dm, DevicePlan::policy(&dev, c, p).unwrap(), n_ctx).unwrap()
    };
    let (mut a, mut b, mut full, mut sp) = (
        open(&dense, 16),
        open(&dense, 16),
        open(&dense, 4),
        open(&sparse, 16),
    );
    a.forward(&TOKENS[..2]).unwrap();
    full.forward(&TOKENS[..4]).unwrap();
    let vocab = c.vocab_size as u32;
    for case in 0..4 {
        let (what, mut seqs, tokens) = match case {
            0 => ("a sparse plan", vec![&mut a, &mut sp], vec![1, 2]),
            1 => ("a full context", vec![&mut a, &mut full], vec![1, 2]),
            2 => ("a token out of range", vec![&mut a, &mut b], vec![1, vocab]),
            _ => ("fewer tokens", vec![&mut a, &mut b], vec![1]),
        };
        let err = DeviceSession::step_many(&mut seqs, &tokens);
        assert!(err.is_err(), "{what}: refused");
    }
    assert_eq!((a.len(), b.len(), full.len(), sp.len()), (2, 0, 4, 0));
}
