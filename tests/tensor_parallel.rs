//! Tensor parallelism (`exec::parallel`) on the scalar reference: ranks are threads with a
//! `CpuDevice` each, summing through `HostWorld` (the collectives' reference; NCCL on GPUs).
//! World sizes 2, 3 and 4 give the whole model's logits, step by step, over a prompt batch and
//! decode steps; a fixed sparse plan gives the same selections and logits at every world size.
//!
//! Tolerance: the ranks compute the same f32 products over a split of their sums (one partial
//! per rank, added in rank order), so only the order of summation differs from the whole model:
//! |tp - whole| <= 1e-3 + 1e-4 |whole| on every logit (the fixtures' logits are at most ~30).
mod common;
use dejavu::exec::parallel::{self, ParallelDecoder, Shard, WorldSpec};
use dejavu::exec::Decoder;
use dejavu::exec::{DeviceModel, DevicePlan, DeviceSession};
use dejavu::exec::{Engine, EngineOptions};
use dejavu::sparsity::SparsePlan;
use dejavu_backend_api::IndexSet;
use dejavu_backend_cpu::device::CpuDevice;
use dejavu_backend_cpu::world::HostWorld;
use std::path::PathBuf;

const PROMPT: [u32; 5] = [1, 17, 42, 99, 5];
const STEPS: [u32; 3] = [23, 64, 7];

fn load(name: &str) -> Engine {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/hf")
        .join(name);
    let opts = EngineOptions {
        keep_file_layout: true,
        ..Default::default()
    };
    Engine::load(dir, &opts).unwrap_or_else(|e| panic!("{name}: {e}"))
}

fn close(what: &str, got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len(), "{what}");
    let mut worst = 0f32;
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let err = (g - w).abs();
        assert!(
            err <= 1e-3 + 1e-4 * w.abs(),
            "{what}: logit {i}: {g} against {w}"
        );
        worst = worst.max(err);
    }
    worst
}

/// [`close`] at every step; the worst error.
fn close_steps(what: &str, got: &[Vec<f32>], want: &[Vec<f32>]) -> f32 {
    assert_eq!(got.len(), want.len(), "{what}: steps");
    (got.iter().zip(want).enumerate())
        .map(|(i, (g, w))| close(&format!("{what} step {i}"), g, w))
        .fold(0.0, f32::max)
}

/// The logits of the prompt (one batch) and of each decode step after it.
fn steps(dec: &mut dyn Decoder) -> Vec<Vec<f32>> {
    let mut out = vec![dec.decode(&PROMPT).unwrap().to_vec()];
    for t in STEPS {
        out.push(dec.decode(&[t]).unwrap().to_vec());
    }
    out
}

/// The whole model under `plan` on one host device.
fn whole(eng: &Engine, plan: &SparsePlan) -> Vec<Vec<f32>> {
    let dev = CpuDevice::reference();
    let layout = eng.sparse_layout().unwrap();
    let dm = DeviceModel::upload(&dev, &eng.model, Some(layout)).unwrap();
    let dp = DevicePlan::fixed(&dev, &eng.model.config, plan, "p").unwrap();
    let mut s = DeviceSession::new(&dev, &dm, dp, 32).unwrap();
    steps(&mut s)
}

/// `body` on a world of `world` host ranks, each running the plan `plan` makes for it.
fn on_host_world<R>(
    eng: &Engine,
    world: usize,
    plan: impl Fn(&CpuDevice, Shard) -> dejavu::Result<DevicePlan<CpuDevice>> + Sync,
    body: impl FnOnce(&mut ParallelDecoder) -> R,
) -> dejavu::Result<R> {
    let hw = HostWorld::new(world);
    let spec = WorldSpec {
        world,
        device: |s: Shard| Ok(CpuDevice::rank(s.rank, hw.clone())?),
        plans: |d: &CpuDevice, _: &DeviceModel<CpuDevice>, s: Shard| Ok(vec![plan(d, s)?]),
        model: &eng.model,
        layout: Some(eng.sparse_layout().unwrap()),
        n_ctx: 32,
    };
    parallel::run(spec, |dec| Ok(body(dec)))
}

/// `body` on a world of `world` host ranks running the fixed `plan`.
fn on_world<R>(
    eng: &Engine,
    world: usize,
    plan: &SparsePlan,
    body: impl FnOnce(&mut ParallelDecoder) -> R,
) -> R {
    let c = &eng.model.config;
    let fixed = |d: &CpuDevice, s: Shard| DevicePlan::fixed_shard(d, c, s, plan, "p");
    on_host_world(eng, world, fixed, body).unwrap()
}

#[test]
fn every_world_size_gives_the_whole_models_logits() {
    for (name, worlds) in [
        ("llama-silu", &[2][..]),
        ("qwen2", &[2]),
        ("qwen3", &[2]),
        ("mistral-swa", &[2]),
        ("phi3", &[2]),
        ("gemma2", &[2]),
        ("gemma3", &[2]),
        ("opt-relu", &[2, 3]),
        ("opt-postln-proj", &[3]),
        ("opt-noaffine", &[2]),
    ] {
        let eng = load(name);
        let dense = SparsePlan::dense(&eng.model.config);
        let want = whole(&eng, &dense);
        for &w in worlds {
            let got = on_world(&eng, w, &dense, |d| steps(d));
            let worst = close_steps(&format!("{name} world {w}"), &got, &want);
            println!("{name}: world {w}: worst |tp - whole| = {worst:.2e}");
        }
    }
}

#[test]
fn an_explicit_sparse_plan_is_the_same_at_every_world_size() {
    let eng = load("opt-relu");
    let c = &eng.model.config;
    let plan = common::uneven_plan(&eng);
    let want = whole(&eng, &plan);
    for w in [2, 3] {
        let (got, sel) = on_world(&eng, w, &plan, |d| {
            let got = steps(d);
            (got, d.selections(c).unwrap())
        });
        close_steps(&format!("world {w}"), &got, &want);
        for (l, (lp, (m, h))) in plan.layers.iter().zip(sel).enumerate() {
            let all = |s: &IndexSet| s.iter().map(|i| i as u32).collect::<Vec<_>>();
            assert_eq!(
                m.unwrap_or_else(|| (0..c.n_ff as u32).collect()),
                all(&lp.mlp),
                "layer {l}"
            );
            assert_eq!(
                h.unwrap_or_else(|| (0..c.n_heads as u32).collect()),
                all(&lp.heads),
                "layer {l}"
            );
        }
    }
}

#[test]
fn a_world_that_does_not_divide_the_model_is_refused() {
    let eng = load("llama-silu"); // 4 heads, 2 KV heads
    let dense = SparsePlan::dense(&eng.model.config);
    let c = &eng.model.config;
    let fixed = |d: &CpuDevice, s: Shard| DevicePlan::fixed_shard(d, c, s, &dense, "p");
    let err = on_host_world(&eng, 4, fixed, |_| ())
        .unwrap_err()
        .to_string();
    assert!(err.contains("do not split evenly"), "{err}");
}

/// OPT-125M's shape with seeded random weights (12 heads: world 4 divides it), and the
/// predictors it comes with.
#[test]
fn a_synthetic_opt_over_four_ranks_gives_the_whole_models_logits() {
    let opts = EngineOptions {
        keep_file_layout: true,
        synthetic: dejavu::model::synthetic::SyntheticOptions {
            seed: 7,
            ..Default::default()
        },
        ..Default::default()
    };
    let eng = Engine::load("synthetic:opt-125m", &opts).unwrap();
    let dense = SparsePlan::dense(&eng.model.config);
    let want = whole(&eng, &dense);
    let got = on_world(&eng, 4, &dense, |d| steps(d));
    let worst = close_steps("synthetic opt-125m world 4", &got, &want);
    println!("synthetic opt-125m: world 4: worst |tp - whole| = {worst:.2e}");
}

/// `--tensor-parallel N` / `-tp N` on the command line: 1 is the whole model; more ranks on
/// the CPU, or none, are clear errors with a non-zero exit.
#[test]
fn the_tensor_parallel_flag_is_checked() {
    let model = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf/llama-silu");
    let run = |extra: &[&str]| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_dejavu"))
            .args([
                "generate",
                "-m",
                model.to_str().unwrap(),
                "-p",
                "hi",
                "-n",
                "2",
            ])
            .args(extra)
            .output()
            .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (code, err) = run(&["-tp", "1"]);
    assert_eq!(code, Some(0), "{err}");
    let (code, err) = run(&["-tp", "2"]);
    assert!(
        code == Some(1) && err.contains("--backend cuda"),
        "{code:?} {err}"
    );
    let (code, err) = run(&["--tensor-parallel=0"]);
    assert!(
        code == Some(2) && err.contains("not in 1..=64"),
        "{code:?} {err}"
    );
}

/// A Deja Vu policy over 2 ranks (synthetic OPT-125M and its random predictors): each rank
/// keeps its share of K among its own neurons and heads, by the replicated predictors' scores.
#[test]
fn a_policy_over_two_ranks_selects_k_over_world_on_each() {
    let opts = EngineOptions {
        keep_file_layout: true,
        ..Default::default()
    };
    let eng = Engine::load("synthetic:opt-125m", &opts).unwrap();
    let c = &eng.model.config;
    let preds = eng.predictors(None).unwrap();
    let policy = eng
        .policy("dejavu:0.1+dejavu-attn:0.5", preds.as_ref())
        .unwrap();
    let predicted = |d: &CpuDevice, s: Shard| DevicePlan::policy_shard(d, c, s, &policy);
    let sel = on_host_world(&eng, 2, predicted, |d| {
        let logits = d.decode(&PROMPT).unwrap();
        assert!(logits.iter().all(|x| x.is_finite()));
        d.decode(&[STEPS[0]]).unwrap();
        d.selections(c).unwrap()
    })
    .unwrap();
    let per_rank = |n: usize, keep: f64| ((keep * (n / 2) as f64).round() as usize).max(1);
    for (l, (m, h)) in sel.iter().enumerate() {
        for (set, n, keep) in [(m, c.n_ff, 0.1), (h, c.n_heads, 0.5)] {
            let set = set.as_ref().expect("a predicted selection");
            let half = n as u32 / 2;
            let (lo, hi): (Vec<u32>, Vec<u32>) = set.iter().partition(|&&i| i < half);
            assert_eq!(
                lo.len(),
                per_rank(n, keep),
                "layer {l}: rank 0's share of {n}"
            );
            assert_eq!(
                hi.len(),
                per_rank(n, keep),
                "layer {l}: rank 1's share of {n}"
            );
            let mut distinct = set.clone();
            distinct.dedup();
            assert!(distinct.len() == set.len() && set.iter().all(|&i| i < n as u32));
        }
    }
}

/// `dejavu bench --tensor-parallel` on the host reference: each policy's rows over 2 ranks,
/// their bytes summed over the ranks, and the collectives timed on their own.
#[test]
fn the_bench_runs_over_a_world() {
    use dejavu::eval::bench::{self, BenchSpec};
    let opts = EngineOptions {
        keep_file_layout: true,
        ..Default::default()
    };
    let eng = Engine::load("synthetic:opt-125m", &opts).unwrap();
    let preds = eng.predictors(None).unwrap();
    let policies = ["dense", "dejavu:0.25"].map(|p| eng.policy(p, preds.as_ref()).unwrap());
    let hw = HostWorld::new(2);
    let device = |s: Shard| Ok(CpuDevice::rank(s.rank, hw.clone())?);
    let spec = BenchSpec {
        engine: &eng,
        policies: &policies,
        n_prompt: 4,
        n_gen: 3,
        reps: 1,
    };
    let rows = bench::on_world(2, device, &spec, &mut || {}).unwrap();
    assert_eq!(rows.len(), 4, "pp and tg of each policy");
    let whole = DeviceModel::upload(&CpuDevice::reference(), &eng.model, None)
        .unwrap()
        .dense_bytes();
    for r in &rows {
        assert!(r.backend.ends_with("x2 (tensor parallel)"), "{}", r.backend);
        assert!(r.tok_per_s_median > 0.0);
    }
    let (dense, sparse) = (&rows[2], &rows[3]);
    // Each rank reads its share of the layers and the head, and a whole embedding row and
    // position row (under 8 KiB here).
    let slack = 8 << 10;
    assert!(
        dense.weight_bytes_per_token as usize <= whole + slack,
        "{} against the whole model's {whole}",
        dense.weight_bytes_per_token
    );
    assert!(
        dense.weight_bytes_per_token as usize >= whole,
        "{}",
        dense.weight_bytes_per_token
    );
    assert!(sparse.weight_bytes_per_token < dense.weight_bytes_per_token);
    assert!(dense.blocks.all_reduce.ms > 0.0 && sparse.blocks.all_reduce.ms > 0.0);
    print!("{}", bench::markdown(&rows));
}
