//! Steps of several sequences (continuous batching, `DeviceSession::step_many`) against each
//! sequence's own decode steps on the same device.
use super::*;

/// Which sequences step together at each step, in which row order: all, a subset out of
/// order, one alone, all reversed, two; then a leader and a row count again with other rows
/// behind it (a device that records a step of several sequences, once per leader and row
/// count, replays it over other sequences' caches and positions).
const ROUNDS: [&[usize]; 7] = [
    &[0, 1, 2, 3],
    &[2, 0],
    &[3],
    &[3, 2, 1, 0],
    &[1, 3],
    &[0, 3, 1, 2],
    &[2, 1],
];

/// On every fixture (learned positions, RoPE of both styles, grouped queries, Q/K norms,
/// sliding windows, soft caps, post-norm blocks), four sequences with prompts of different
/// lengths step in the batches of [`ROUNDS`]; each row's logits equal the same sequence
/// stepping alone on the same device (`exact`: bit for bit, the CPU's batch invariance; else
/// within the suite's tolerance), and so does a step after them (the batched steps' keys and
/// values are its own steps'). Dense; or with `sparse`, one fixed random plan (about 40% of
/// each layer's neurons and heads) for every sequence, so that the MLP's union is each row's
/// own set and each row attends over its own heads. Returns the worst error.
pub fn batched_steps_are_each_sequences_own<D: Device>(dev: &D, exact: bool, sparse: bool) -> f32 {
    let mut worst = 0f32;
    for name in FIXTURES {
        let eng = load(name);
        let c = &eng.model.config;
        let plan = match sparse {
            true => random_plan(&eng, 0.4, 7),
            false => SparsePlan::dense(c),
        };
        let layout = sparse.then(|| eng.sparse_layout().unwrap());
        let dm = DeviceModel::upload(dev, &eng.model, layout).unwrap();
        let open = || {
            let p = DevicePlan::fixed(dev, c, &plan, "plan").unwrap();
            DeviceSession::new(dev, &dm, p, 32).unwrap()
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

/// Under a Deja Vu policy (random predictors of MLP neurons and heads, synthetic:opt-125m),
/// four sequences with different prompts step in the batches of [`ROUNDS`]: each row's
/// logits are the reference's step (the CPU's f32 kernels, the host's sparse step) under the
/// plan the batch ran for that row: the heads its own predictors chose (read back from its
/// sequence after the step) and, for the MLP, the union of every row's chosen neurons. Each
/// reference sequence runs every step of its sequence that way, so their caches stay equal.
/// Some union is larger than a row's own set (the batch computes neurons a row did not
/// choose). The predictors at layer 0 (its neurons, its heads and layer 1's) read only the
/// token and its position, so each row's choices there are those of its sequence stepping
/// alone on the same device: `exact` (the CPU, whose batched products are each row's own)
/// every one; else all but a few near-ties (under 1% of the indices; a row that took another
/// row's scores would differ in about half). Returns the worst error.
pub fn predicted_batched_steps_run_each_rows_heads_and_the_union<D: Device>(
    dev: &D,
    exact: bool,
) -> f32 {
    let opts = EngineOptions {
        keep_file_layout: true,
        n_ctx: Some(16),
        ..Default::default()
    };
    let eng = Engine::load("synthetic:opt-125m", &opts).unwrap();
    let c = &eng.model.config;
    let preds = eng.predictors(None).unwrap();
    let policy = eng
        .policy("dejavu:0.1+dejavu-attn:0.5", preds.as_ref())
        .unwrap();
    let dm = DeviceModel::upload(dev, &eng.model, Some(eng.sparse_layout().unwrap())).unwrap();
    let open = || {
        let plan = DevicePlan::policy(dev, c, &policy).unwrap();
        DeviceSession::new(dev, &dm, plan, 16).unwrap()
    };
    let mut batched: Vec<_> = (0..4).map(|_| open()).collect();
    let mut alone: Vec<_> = (0..4).map(|_| open()).collect();
    let host = OnCpu::with_cache(&eng, CpuBackend::f32_reference(2), true, false);
    let dense = SparsePlan::dense(c);
    let mut want: Vec<_> = (0..4).map(|_| host.fixed(&dense, 16)).collect();
    let (mut worst, mut grew) = (0f32, false);
    for (i, (b, w)) in batched.iter_mut().zip(&mut want).enumerate() {
        let prompt = &TOKENS[i..2 * i + 2];
        forward_both(b, w, prompt, "a prompt");
        alone[i].forward(prompt).unwrap();
    }
    // Layer 0's choices, each sorted: its neurons, its heads, layer 1's heads.
    let first = |sel: &[dejavu::exec::Selections]| -> [Option<Vec<u32>>; 3] {
        [sel[0].0.clone(), sel[0].1.clone(), sel[1].1.clone()]
    };
    let (mut differ, mut chosen) = (0, 0);
    let set = |v: &Option<Vec<u32>>, n: usize| match v {
        Some(v) => IndexSet::new(n, v.clone()).unwrap(),
        None => IndexSet::full(n),
    };
    for (round, seqs) in ROUNDS.iter().enumerate() {
        let tokens: Vec<u32> = seqs.iter().map(|&s| TOKENS[(round * 3 + s) % 9]).collect();
        let mut refs: Vec<Option<&mut DeviceSession<D>>> = batched.iter_mut().map(Some).collect();
        let mut rows: Vec<_> = seqs.iter().map(|&s| refs[s].take().unwrap()).collect();
        let got = DeviceSession::step_many(&mut rows, &tokens).unwrap();
        let sels: Vec<_> = rows.iter().map(|s| s.selections().unwrap()).collect();
        for (r, (&s, &t)) in seqs.iter().zip(&tokens).enumerate() {
            alone[s].forward(&[t]).unwrap();
            let (mine, own) = (first(&sels[r]), first(&alone[s].selections().unwrap()));
            for (g, o) in mine.iter().zip(&own) {
                let (g, o) = (g.as_deref().unwrap(), o.as_deref().unwrap());
                assert_eq!(g.len(), o.len(), "round {round}, sequence {s}: layer 0's k");
                chosen += g.len();
                differ += g.iter().filter(|i| o.binary_search(i).is_err()).count();
            }
            let layers = (0..c.n_layers)
                .map(|l| {
                    // The union of the rows' neurons at layer l.
                    let mut union: Vec<u32> = (sels.iter())
                        .flat_map(|sel| {
                            sel[l]
                                .0
                                .clone()
                                .unwrap_or_else(|| (0..c.n_ff as u32).collect())
                        })
                        .collect();
                    union.sort_unstable();
                    union.dedup();
                    grew |= sels[r][l]
                        .0
                        .as_ref()
                        .is_some_and(|own| own.len() < union.len());
                    let mlp = IndexSet::new(c.n_ff, union).unwrap();
                    LayerPlan::new(c, mlp, set(&sels[r][l].1, c.n_heads)).unwrap()
                })
                .collect();
            let plan = SparsePlan::new(c, layers).unwrap();
            assert!(!plan.is_dense(), "the policy selects");
            want[s]
                .set_plan(DevicePlan::fixed(&host.dev, c, &plan, "batch").unwrap())
                .unwrap();
            let expect = want[s].forward(&[t]).unwrap();
            let row = &got[r * c.vocab_size..(r + 1) * c.vocab_size];
            let what = format!("round {round}, sequence {s}");
            worst = worst.max(assert_close(&what, row, expect));
        }
    }
    assert!(grew, "no union was larger than a row's own neurons");
    match exact {
        true => assert_eq!(differ, 0, "layer 0's choices: not each row's own"),
        false => assert!(
            differ * 100 < chosen,
            "layer 0's choices: {differ} of {chosen} indices not each row's own"
        ),
    }
    worst
}

/// On every fixture, sequences forked from another's prompt (`DeviceSession::copy_prefix`:
/// its first 6 positions, and its first 4 into a sequence that held other tokens) step as
/// rows of one batch with it: each row equals a sequence that ran the same tokens itself
/// (`exact`: bit for bit). A fork past the source's length is refused. Returns the worst
/// error.
pub fn forked_sequences_continue_as_their_source<D: Device>(dev: &D, exact: bool) -> f32 {
    let mut worst = 0f32;
    for name in FIXTURES {
        let eng = load(name);
        let c = &eng.model.config;
        let dm = DeviceModel::upload(dev, &eng.model, None).unwrap();
        let open = || {
            let p = DevicePlan::fixed(dev, c, &SparsePlan::dense(c), "dense").unwrap();
            DeviceSession::new(dev, &dm, p, 32).unwrap()
        };
        let (mut src, mut long, mut short) = (open(), open(), open());
        src.forward(&TOKENS[..6]).unwrap();
        short.forward(&TOKENS[3..9]).unwrap();
        long.copy_prefix(&src, 6).unwrap();
        short.copy_prefix(&src, 4).unwrap();
        assert!(
            open().copy_prefix(&src, 7).is_err(),
            "{name}: past the source"
        );
        assert_eq!((long.len(), short.len()), (6, 4));
        let tokens = [TOKENS[7], TOKENS[8], TOKENS[4]];
        let want: Vec<Vec<f32>> = [(6, tokens[0]), (6, tokens[1]), (4, tokens[2])]
            .iter()
            .map(|&(n, t)| {
                let mut own = open();
                own.forward(&TOKENS[..n]).unwrap();
                own.forward(&[t]).unwrap().to_vec()
            })
            .collect();
        let mut rows = vec![&mut src, &mut long, &mut short];
        let got = DeviceSession::step_many(&mut rows, &tokens).unwrap();
        for (r, want) in want.iter().enumerate() {
            let row = &got[r * c.vocab_size..(r + 1) * c.vocab_size];
            if exact {
                let same = (row.iter().zip(want)).all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(
                    same,
                    "{name}: row {r} is not its own sequence's step bit for bit"
                );
            }
            worst = worst.max(assert_close(&format!("{name}: forked row {r}"), row, want));
        }
    }
    worst
}

#[test]
fn forked_sequences_on_every_cpu_tier_continue_as_their_source() {
    use dejavu_backend_cpu::isa::Isa;
    forked_sequences_continue_as_their_source(&CpuDevice::reference(), true);
    for isa in Isa::supported() {
        forked_sequences_continue_as_their_source(&CpuDevice::with_isa(isa, 2).unwrap(), true);
    }
}

#[test]
fn batched_steps_on_every_cpu_tier_are_each_sequences_own() {
    use dejavu_backend_cpu::isa::Isa;
    batched_steps_are_each_sequences_own(&CpuDevice::reference(), true, false);
    for isa in Isa::supported() {
        batched_steps_are_each_sequences_own(&CpuDevice::with_isa(isa, 2).unwrap(), true, false);
    }
}

/// On every fixture, every CPU tier: a position's logits bit for bit the same however its
/// prompt was split (the CPU's default batch invariance).
#[test]
fn prompt_splits_on_every_cpu_tier_give_one_logits() {
    use dejavu_backend_cpu::isa::Isa;
    for name in FIXTURES {
        let eng = load(name);
        for isa in Isa::supported() {
            let dev = CpuDevice::with_isa(isa, 2).unwrap();
            prompt_splits_give_one_logits(&dev, &eng, &format!("{name} on {isa}"));
        }
    }
}

/// Under a fixed sparse plan on every CPU tier, within the suite's tolerance (a batch's W_o
/// reads every head's row, zeros for the heads a row did not select, where a sparse step
/// reads only the selected rows: the same sum in another order).
#[test]
fn sparse_batched_steps_on_every_cpu_tier_are_each_sequences_own() {
    use dejavu_backend_cpu::isa::Isa;
    batched_steps_are_each_sequences_own(&CpuDevice::reference(), false, true);
    for isa in Isa::supported() {
        batched_steps_are_each_sequences_own(&CpuDevice::with_isa(isa, 2).unwrap(), false, true);
    }
}

#[test]
fn predicted_batched_steps_on_the_cpu_run_each_rows_heads_and_the_union() {
    use dejavu_backend_cpu::isa::Isa;
    for isa in Isa::supported() {
        let dev = CpuDevice::with_isa(isa, 2).unwrap();
        predicted_batched_steps_run_each_rows_heads_and_the_union(&dev, true);
    }
}

/// A step of several sequences refuses, before anything runs: a sequence under a plan that
/// selects from its layers' own activations (`gate-first`), one whose context is full, a token out of the vocabulary, and a token count that is not the
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
            0 => ("a gate-first plan", vec![&mut a, &mut sp], vec![1, 2]),
            1 => ("a full context", vec![&mut a, &mut full], vec![1, 2]),
            2 => ("a token out of range", vec![&mut a, &mut b], vec![1, vocab]),
            _ => ("fewer tokens", vec![&mut a, &mut b], vec![1]),
        };
        let err = DeviceSession::step_many(&mut seqs, &tokens);
        assert!(err.is_err(), "{what}: refused");
    }
    assert_eq!((a.len(), b.len(), full.len(), sp.len()), (2, 0, 4, 0));
}

/// A position's logits on `eng`'s model, dense, bit for bit the same however its prompt ran:
/// whole, in chunks of 1, 3 or 7 rows, or after a cached prefix (a longer sequence truncated
/// to 17 or 9 positions, the rest run as a prompt): on a batch-invariant device
/// (`Device::batch_invariant`), each row of a prompt is its own decode step.
pub fn prompt_splits_give_one_logits<D: Device>(dev: &D, eng: &Engine, what: &str) {
    use dejavu::exec::Decoder;
    let c = &eng.model.config;
    let dm = DeviceModel::upload(dev, &eng.model, None).unwrap();
    let ids: Vec<u32> = (0..40)
        .map(|i| (i * 37 + 11) % c.vocab_size as u32)
        .collect();
    let run = |chunk: usize, cached: usize| -> Vec<u32> {
        let plan = DevicePlan::fixed(dev, c, &SparsePlan::dense(c), "plan").unwrap();
        let mut s = DeviceSession::new(dev, &dm, plan, 64).unwrap();
        if cached > 0 {
            s.prompt(&ids).unwrap();
            Decoder::truncate(&mut s, cached);
        }
        let mut last = Vec::new();
        for ch in ids[cached..].chunks(chunk) {
            last = (s.prompt(ch).unwrap().iter())
                .map(|v| v.to_bits())
                .collect();
        }
        last
    };
    let whole = run(ids.len(), 0);
    for (chunk, cached) in [(1, 0), (3, 0), (7, 0), (ids.len(), 17), (5, 9)] {
        assert!(
            run(chunk, cached) == whole,
            "{what}: chunks of {chunk} after {cached} cached differ from the whole prompt"
        );
    }
}
