//! The device-resident decoder (`engine::device`) against the host executor: the same fixed
//! plans (dense, and sparse sets of neurons and heads) give the same logits, and a policy's
//! device-side selections, replayed on the host as a fixed plan, give its logits too. Runs on
//! [`HostDevice`] (the scalar reference, everywhere) and, built with `--features cuda`, on the
//! GPU (skipped with the reason printed where there is none).
//!
//! Tolerance: the host reference computes in f32 on the same weights with an f32 KV cache; the
//! device stores keys and values in f16 (relative rounding 2^-11 ~ 4.9e-4 per element) and sums
//! in another order. Through <= 6 layers of the tiny fixtures and logits of magnitude <= 30 we
//! allow |device - host| <= 0.02 + 0.002 |host| on every logit of every step.
mod common;
use dejavu::engine::device::{DeviceModel, DevicePlan, DeviceSession};
use dejavu::engine::executor::{Executor, Logits, Plan};
use dejavu::engine::kv_cache::KvCache;
use dejavu::engine::{Engine, EngineOptions};
use dejavu::sparsity::{LayerPlan, SparsePlan};
use dejavu_backend_api::{Device, IndexSet};
use dejavu_backend_cpu::device::HostDevice;
use dejavu_backend_cpu::CpuBackend;
use rand::{Rng, SeedableRng};
use std::path::PathBuf;

const FIXTURES: [&str; 6] = [
    "opt-relu",
    "opt-postln-proj",
    "opt-noaffine",
    "llama-relu",
    "llama-silu",
    "qwen2",
];
const TOKENS: [u32; 9] = [1, 17, 42, 99, 5, 23, 64, 7, 3];

/// The checkout: where the test was built, else (a test binary carried to another machine) the
/// working directory.
fn root() -> PathBuf {
    let built = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    match built.exists() {
        true => built,
        false => std::env::current_dir().unwrap(),
    }
}

fn load(name: &str) -> Engine {
    let dir = root().join("tests/fixtures/hf").join(name);
    let opts = EngineOptions {
        keep_file_layout: true,
        ..Default::default()
    };
    Engine::load(dir, &opts).unwrap_or_else(|e| panic!("{name}: {e}"))
}

/// A seeded random plan keeping about `keep` of each layer's neurons and heads (layer 0 dense).
fn random_plan(eng: &Engine, keep: f64, seed: u64) -> SparsePlan {
    let c = &eng.model.config;
    let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let mut pick = |n: usize| {
        let v: Vec<u32> = (0..n as u32).filter(|_| r.gen_bool(keep)).collect();
        IndexSet::new(n, if v.is_empty() { vec![0] } else { v }).unwrap()
    };
    let layers = (0..c.n_layers)
        .map(|l| match l {
            0 => LayerPlan::dense(c),
            _ => LayerPlan::new(c, pick(c.n_ff), pick(c.n_heads)).unwrap(),
        })
        .collect();
    SparsePlan::new(c, layers).unwrap()
}

fn assert_close(what: &str, dev: &[f32], host: &[f32]) -> f32 {
    let mut worst = 0f32;
    for (i, (d, h)) in dev.iter().zip(host).enumerate() {
        let err = (d - h).abs();
        assert!(
            err <= 0.02 + 0.002 * h.abs(),
            "{what}: logit {i}: device {d}, host {h}"
        );
        worst = worst.max(err);
    }
    worst
}

/// Every step of `plan` on the device against the host executor; returns the worst error.
fn check_plan<D: Device>(
    dev: &D,
    eng: &Engine,
    dm: &DeviceModel<D>,
    plan: &SparsePlan,
    what: &str,
) -> f32 {
    let reference = CpuBackend::f32_reference(1);
    let mut exec = Executor::new(&eng.model, &reference).unwrap();
    exec.layout = Some(eng.sparse_layout().unwrap());
    let mut cache = KvCache::new(&eng.model, 64, Default::default());
    let dplan = DevicePlan::fixed(dev, &eng.model.config, plan, what).unwrap();
    let mut sess = DeviceSession::new(dev, dm, dplan, 64).unwrap();
    let mut worst = 0f32;
    for (i, &t) in TOKENS.iter().enumerate() {
        let host = exec
            .run(&[t], &mut cache, Plan::Fixed(plan), Logits::Last)
            .unwrap()
            .to_vec();
        let got = sess.forward(&[t]).unwrap();
        worst = worst.max(assert_close(&format!("{what} step {i}"), got, &host));
    }
    worst
}

pub fn check_fixtures<D: Device>(dev: &D) {
    for name in FIXTURES {
        let eng = load(name);
        let layout = eng.sparse_layout().unwrap();
        let dm = DeviceModel::upload(dev, &eng.model, Some(layout)).unwrap();
        let dense = check_plan(
            dev,
            &eng,
            &dm,
            &SparsePlan::dense(&eng.model.config),
            "dense",
        );
        let sparse = check_plan(dev, &eng, &dm, &random_plan(&eng, 0.4, 7), "sparse");
        eprintln!(
            "{} {name}: worst |logit error| dense {dense:.2e}, sparse 40% {sparse:.2e}",
            dev.name()
        );
    }
}

#[test]
fn fixed_plans_on_the_reference_device_match_the_host_executor() {
    check_fixtures(&HostDevice::new());
}

#[test]
fn device_errors_are_errors() {
    let dev = HostDevice::new();
    let eng = load("llama-silu");
    let dm = DeviceModel::upload(&dev, &eng.model, None).unwrap();
    let plan = random_plan(&eng, 0.5, 1);
    let dplan = DevicePlan::fixed(&dev, &eng.model.config, &plan, "p").unwrap();
    assert!(
        DeviceSession::new(&dev, &dm, dplan, 8).is_err(),
        "a sparse plan without a layout"
    );
    let dense = DevicePlan::fixed(
        &dev,
        &eng.model.config,
        &SparsePlan::dense(&eng.model.config),
        "d",
    )
    .unwrap();
    let mut s = DeviceSession::new(&dev, &dm, dense, 4).unwrap();
    let vocab = eng.model.config.vocab_size as u32;
    assert!(s.forward(&[vocab]).is_err(), "token out of range");
    assert!(s.forward(&[1, 2, 3, 4, 5]).is_err(), "beyond the context");
    assert!(s.forward(&[]).is_err(), "no tokens");
    assert_eq!(s.len(), 0, "failed steps leave the cache as it was");
    // Repacked rows cannot be uploaded.
    let packed = Engine::load(
        root().join("tests/fixtures/hf/llama-silu"),
        &EngineOptions::default(),
    )
    .unwrap();
    if packed
        .model
        .matrices()
        .iter()
        .any(|w| w.layout != Default::default())
    {
        assert!(DeviceModel::upload(&dev, &packed.model, None).is_err());
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use super::*;
    use dejavu_backend_cuda::CudaDevice;

    fn gpu() -> Option<CudaDevice> {
        CudaDevice::new(0)
            .map_err(|e| eprintln!("skipped: no usable GPU ({e})"))
            .ok()
    }

    #[test]
    fn fixed_plans_on_the_gpu_match_the_host_executor() {
        if let Some(g) = gpu() {
            check_fixtures(&g);
        }
    }
}
