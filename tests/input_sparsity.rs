//! Input sparsity (`teal`, `wina`) on the tiny crafted model with every projection in f32 (so
//! the input-major layouts are exact transposes and only the order of summation differs):
//! - a threshold of 0 keeps every nonzero input: the dense model's logits through the
//!   input-major kernels; a group kept whole (threshold below 0) runs the dense products
//!   themselves, bit for bit, and reads the dense step's bytes;
//! - a threshold above every score of one input group drops it: the logits of the dense model
//!   whose matrices reading that input are zero (each group wired to its own matrices);
//! - on 8- and 4-bit weights (the input-block layout, the file's own values transposed), every
//!   input kept is the dense model with f32 activations (the reference device);
//! - calibrated thresholds drop about the requested fraction, and the step reads fewer bytes;
//! - a group whose sparse products would be slower than its dense ones runs dense (`:always`
//!   runs it sparse);
//! - a masked batch (calibration's allocation search) is the decode steps under the thresholds;
//! - the greedy allocation rises to its end, and `teal:S` reads it (`:uniform` does not);
//! - the policy grammar's refusals.
mod common;
use common::*;
use dejavu::exec::{Engine, EngineOptions, Logits};
use dejavu::sparsity::input::{Group, Score};
use dejavu::sparsity::policy::{InputRule, Policy};
use dejavu_formats::GgmlType;

const TOKENS: [u32; 8] = [72, 101, 108, 108, 111, 33, 10, 84];

/// Every projection of the tiny model as F32; the matrices named by `zero` (name suffixes)
/// zeroed.
fn f32_model(zero: &[&str]) -> Vec<u8> {
    tiny_llama_gguf(|_, tensors| {
        for (name, _, ty, bytes) in tensors.iter_mut() {
            if !name.starts_with("blk.") || *ty != GgmlType::Q8_0 {
                continue;
            }
            let z = zero.iter().any(|s| name.ends_with(s));
            let vals: Vec<u8> = (bytes.chunks_exact(34))
                .flat_map(|b| {
                    let d = half::f16::from_le_bytes([b[0], b[1]]).to_f32();
                    b[2..]
                        .iter()
                        .map(move |&q| if z { 0.0 } else { d * q as i8 as f32 })
                })
                .flat_map(|v| v.to_le_bytes())
                .collect();
            (*bytes, *ty) = (vals, GgmlType::F32);
        }
    })
}

fn load(bytes: &[u8]) -> (tempfile::TempDir, Engine) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tiny.gguf");
    std::fs::write(&path, bytes).unwrap();
    let opts = EngineOptions {
        threads: Some(2),
        ..Default::default()
    };
    (dir, Engine::load(&path, &opts).unwrap())
}

/// The logits of every token of [`TOKENS`], fed one at a time, under `pol`.
fn decode(e: &Engine, pol: &Policy) -> Vec<f32> {
    let mut s = e.decoder(pol).unwrap();
    (TOKENS.iter())
        .flat_map(|&t| s.run(&[t], Logits::Last).unwrap().to_vec())
        .collect()
}

/// `teal` with thresholds `th` (per group, every layer).
fn with_thresholds(e: &Engine, th: [f32; 4]) -> Policy {
    let c = &e.model.config;
    let mut pol = Policy::dense(c);
    pol.name = format!("teal {th:?}");
    pol.inputs = Some(InputRule {
        score: Score::Teal,
        sparsity: 0.5,
        thresholds: vec![th; c.n_layers],
        group_sparsity: [0.5; 4],
        always: true,
    });
    pol
}

fn assert_close(what: &str, got: &[f32], want: &[f32]) {
    assert_within(what, got, want, 1e-4);
}

fn assert_within(what: &str, got: &[f32], want: &[f32], tol: f32) {
    assert_eq!(got.len(), want.len());
    let worst = (got.iter().zip(want))
        .map(|(a, b)| (a - b).abs() / (1.0 + b.abs()))
        .fold(0f32, f32::max);
    assert!(worst < tol, "{what}: worst relative error {worst}");
}

#[test]
fn keeping_every_input_is_the_dense_model() {
    let (_d, e) = load(&f32_model(&[]));
    let dense = decode(&e, &Policy::dense(&e.model.config));
    assert_close(
        "all kept",
        &decode(&e, &with_thresholds(&e, [0.0; 4])),
        &dense,
    );
    // Some groups through the input-major kernels, the others whole.
    for th in [[0.0, -1.0, 0.0, -1.0], [-1.0, 0.0, -1.0, 0.0]] {
        let got = decode(&e, &with_thresholds(&e, th));
        assert_close(&format!("{th:?}"), &got, &dense);
    }
}

/// Every group kept whole (TEAL's allocation at sparsity 0 for it): the dense products
/// themselves, so the dense model's logits bit for bit, and the dense step's bytes.
#[test]
fn groups_kept_whole_run_the_dense_products() {
    let (_d, e) = load(&q4_1_model());
    let c = &e.model.config;
    let step = |pol: &Policy| {
        let mut s = e.decoder(pol).unwrap();
        let logits: Vec<f32> = (TOKENS.iter())
            .flat_map(|&t| s.run(&[t], Logits::Last).unwrap().to_vec())
            .collect();
        (logits, s.last_step().unwrap().weight_bytes)
    };
    let (dense, dense_bytes) = step(&Policy::dense(c));
    let (whole, whole_bytes) = step(&with_thresholds(&e, [-1.0; 4]));
    let differ = (whole.iter().zip(&dense))
        .filter(|(a, b)| a.to_bits() != b.to_bits())
        .count();
    assert_eq!(differ, 0, "every group whole: logits other than dense's");
    assert_eq!(whole.len(), dense.len());
    assert_eq!(
        whole_bytes, dense_bytes,
        "every group whole: the dense bytes"
    );
    // One group through the kernels (all its nonzero inputs kept): fewer or as many bytes.
    let (_, some) = step(&with_thresholds(&e, [-1.0, -1.0, 0.0, -1.0]));
    assert!(
        some <= dense_bytes + dense_bytes / 50,
        "{some} vs {dense_bytes}"
    );
}

/// What an input-sparse step's bytes count, on the device: the kept inputs (nonzero, NaN
/// included) and the blocks of 32 that hold one (each reads its block's scale table whole).
#[test]
fn kept_inputs_and_their_blocks_are_counted() {
    use dejavu_backend_api::Device;
    use dejavu_backend_cpu::device::CpuDevice;
    let dev = CpuDevice::reference();
    let mut x = vec![0f32; 100];
    (x[3], x[40], x[41], x[99]) = (1.0, -2.0, f32::NAN, 0.5);
    let mut out = dev.zeros(4).unwrap();
    dev.count_nonzero(&x, 100, 1, &mut out, 0).unwrap();
    dev.count_nonzero(&x, 100, 32, &mut out, 1).unwrap();
    dev.count_nonzero(&x, 99, 32, &mut out, 2).unwrap();
    dev.count_nonzero(&x, 100, 200, &mut out, 3).unwrap();
    assert_eq!(out, [4.0, 3.0, 2.0, 1.0]);
    assert!(dev.count_nonzero(&x, 100, 0, &mut out, 0).is_err());
}

/// The tiny model's Q8_0 projections as Q4_1 (requantized from their values).
fn q4_1_model() -> Vec<u8> {
    tiny_llama_gguf(|_, tensors| {
        for (name, _, ty, bytes) in tensors.iter_mut() {
            if !name.starts_with("blk.") || *ty != GgmlType::Q8_0 {
                continue;
            }
            let vals: Vec<f32> = (bytes.chunks_exact(34))
                .flat_map(|b| {
                    let d = half::f16::from_le_bytes([b[0], b[1]]).to_f32();
                    b[2..].iter().map(move |&q| d * q as i8 as f32)
                })
                .collect();
            let mut out = Vec::new();
            dejavu_backend_api::quantize::quantize_row(
                dejavu_backend_api::QuantType::Q4_1,
                &vals,
                &mut out,
            )
            .unwrap();
            (*bytes, *ty) = (out, GgmlType::Q4_1);
        }
    })
}

/// On the reference device (f32 activations everywhere), every input kept through the
/// input-block layout is the dense model: the layout holds the file's own values. (The tiers'
/// kernels are held to the reference in `kernels::axpy_blocks`.) Q4_K and Q5_K: a synthetic
/// OPT-125m in Q4_K_M and Q5_K_M, its W_o and fc1 (Q4_K or Q5_K in every layer, 768 and 3072
/// outputs) through the K-quants' own input blocks, the other groups dense (their Q6_K layers
/// are requantized to Q8_0).
#[test]
fn input_blocks_keep_the_files_values() {
    use dejavu::exec::{DevicePlan, DeviceSession};
    use dejavu::quantize::mix::FileType;
    use dejavu_backend_api::QuantType;
    use dejavu_backend_cpu::device::CpuDevice;
    let synthetic = |dtype: FileType| {
        let opts = EngineOptions {
            threads: Some(2),
            n_ctx: Some(64),
            synthetic: dejavu::model::synthetic::SyntheticOptions {
                dtype,
                ..Default::default()
            },
            ..Default::default()
        };
        (
            tempfile::tempdir().unwrap(),
            Engine::load("synthetic:opt-125m", &opts).unwrap(),
        )
    };
    let target = dejavu::sparsity::blocks::target;
    for q in [QuantType::Q4K, QuantType::Q5K] {
        assert_eq!(target(q, 3072, 768), Some(q));
    }
    let k_quants = [-1.0, 0.0, 0.0, -1.0];
    let cases = [
        ("q8_0", load(&tiny_llama_gguf(|_, _| {})), [0.0; 4]),
        ("q4_1", load(&q4_1_model()), [0.0; 4]),
        ("q4_k", synthetic(FileType::Q4KM), k_quants),
        ("q5_k", synthetic(FileType::Q5KM), k_quants),
    ];
    for (what, (_d, e), th) in cases {
        let c = &e.model.config;
        let dev = CpuDevice::reference();
        let run = |pol: &Policy| -> Vec<f32> {
            let m = e.device_model(&dev, &[pol]).unwrap();
            let plan = DevicePlan::policy(&dev, c, pol).unwrap();
            let mut s = DeviceSession::new(&dev, &m, plan, 64).unwrap();
            (TOKENS.iter())
                .flat_map(|&t| s.forward(&[t]).unwrap().to_vec())
                .collect()
        };
        let want = run(&Policy::dense(c));
        let got = run(&with_thresholds(&e, th));
        // f32 sums in another order than the dense dot's (the input-block product adds its kept
        // blocks in 4 chunks, summed apart): 1.02e-4 on Q5_K_M's 12 layers. A scale or min
        // decoded wrong is off by far more.
        assert_within(&format!("{what}: every input kept"), &got, &want, 2.5e-4);
    }
}

#[test]
fn dropping_a_group_is_zeroing_the_matrices_that_read_it() {
    let (_d, e) = load(&f32_model(&[]));
    for (g, zero) in [
        (
            Group::Qkv,
            &["attn_q.weight", "attn_k.weight", "attn_v.weight"][..],
        ),
        (Group::O, &["attn_output.weight"][..]),
        (Group::GateUp, &["ffn_gate.weight", "ffn_up.weight"][..]),
        (Group::Down, &["ffn_down.weight"][..]),
    ] {
        let mut th = [-1.0; 4];
        th[Group::ALL.iter().position(|&x| x == g).unwrap()] = f32::INFINITY;
        let (_z, ez) = load(&f32_model(zero));
        let want = decode(&ez, &Policy::dense(&ez.model.config));
        assert_close(
            &format!("{g:?} dropped"),
            &decode(&e, &with_thresholds(&e, th)),
            &want,
        );
    }
}

/// Thresholds calibrated on the model's own activations drop about the requested fraction of
/// inputs (each input's rows go unread: the step's bytes), for TEAL's and WINA's scores.
#[test]
fn calibrated_thresholds_drop_about_the_requested_fraction() {
    let (_d, e) = load(&f32_model(&[]));
    let text = "The quick brown fox jumps over the lazy dog. fn main() {} ".repeat(4);
    let tokens = e.tokenizer.encode(&text).unwrap();
    let stats = dejavu::tune::thresholds::input_stats(&e, &e, &tokens, 32).unwrap();
    let preds = dejavu::sparsity::predictors_file::Predictors::inputs_only(stats);
    let dense_bytes = {
        let mut s = e.decoder(&Policy::dense(&e.model.config)).unwrap();
        s.run(&TOKENS, Logits::Last).unwrap();
        s.info().unwrap().step.weight_bytes
    };
    for spec in ["teal:0.5:always", "wina:0.5:always", "teal:0.2:always"] {
        let pol = e.policy(spec, Some(&preds)).unwrap();
        let mut s = e.decoder(&pol).unwrap();
        let (mut layers, mut sum) = (0, 0usize);
        for &t in &tokens[..16] {
            s.run(&[t], Logits::Last).unwrap();
            sum += s.last_step().unwrap().bytes.mlp;
            layers += 1;
        }
        let st = s.last_step().unwrap();
        assert!(
            st.weight_bytes < dense_bytes,
            "{spec}: {} bytes",
            st.weight_bytes
        );
        // The MLP's bytes are its inputs' rows: about (1 - S) of dense on the calibration text.
        let dense_mlp = {
            let mut d = e.decoder(&Policy::dense(&e.model.config)).unwrap();
            d.run(&[tokens[0]], Logits::Last).unwrap();
            d.last_step().unwrap().bytes.mlp
        };
        let s_req: f64 = spec[5..spec.len() - 7].parse().unwrap();
        let kept = sum as f64 / (layers * dense_mlp) as f64;
        assert!(
            (kept - (1.0 - s_req)).abs() < 0.15,
            "{spec}: the MLP read {kept:.2} of its bytes"
        );
    }
}

/// On the CPU, a group of inputs whose sparse products would take longer than its dense ones
/// at its kept share runs dense: the tiny model's matrices (64 outputs and fewer) are far below
/// the width where an input-block product pays, so `teal:0.5` and `wina:0.5` decode the dense
/// model bit for bit and read its bytes, while `:always` reads fewer and moves the logits.
#[test]
fn sparsity_that_would_cost_time_runs_dense() {
    let (_d, e) = load(&f32_model(&[]));
    let preds = dejavu::sparsity::predictors_file::Predictors::inputs_only(stats(&e));
    let dense = Policy::dense(&e.model.config);
    let step = |pol: &Policy| {
        let mut s = e.decoder(pol).unwrap();
        s.run(&TOKENS[..4], Logits::Last).unwrap();
        s.run(&TOKENS[4..5], Logits::Last).unwrap();
        s.last_step().unwrap()
    };
    let bytes = |pol: &Policy| step(pol).weight_bytes;
    let (want, want_bytes) = (decode(&e, &dense), bytes(&dense));
    let groups = 4 * e.model.config.n_layers;
    assert_eq!(step(&dense).input_groups, 0);
    // Every group runs dense here (below): an engine that runs only such plans builds no
    // input-major layout (this one built it for the statistics).
    let (_d2, fresh) = load(&f32_model(&[]));
    let pol = fresh.policy("teal:0.5", Some(&preds)).unwrap();
    assert!(decode(&fresh, &pol) == decode(&e, &dense));
    assert!(
        !fresh.input_layout_loaded(),
        "a layout built for plans that read none"
    );
    let always = fresh.policy("teal:0.5:always", Some(&preds)).unwrap();
    assert!(fresh.input_layout_loaded() && decode(&fresh, &always) != decode(&e, &dense));
    for spec in ["teal:0.5", "wina:0.5", "teal:0.5:uniform"] {
        let pol = e.policy(spec, Some(&preds)).unwrap();
        assert!(!pol.inputs.as_ref().unwrap().always, "{spec}");
        assert!(
            decode(&e, &pol) == want,
            "{spec}: not the dense model's bits"
        );
        assert_eq!(bytes(&pol), want_bytes, "{spec}: bytes");
        // The step says so: every group read whole.
        let s = step(&pol);
        assert_eq!((s.input_groups, s.input_groups_whole), (groups, groups));
        let always = e.policy(&format!("{spec}:always"), Some(&preds)).unwrap();
        assert!(always.inputs.as_ref().unwrap().always);
        let s = step(&always);
        assert_eq!(s.input_groups, groups);
        assert!(
            s.input_groups_whole < groups,
            "{spec}:always read every group whole"
        );
        assert!(
            bytes(&always) < want_bytes,
            "{spec}:always read the dense bytes"
        );
        assert!(
            decode(&e, &always) != want,
            "{spec}:always changed no logit"
        );
    }
}

/// Calibrated input statistics of `e` on a short text.
fn stats(e: &Engine) -> dejavu::sparsity::input::InputStats {
    let text = "The quick brown fox jumps over the lazy dog. fn main() {} ".repeat(4);
    let tokens = e.tokenizer.encode(&text).unwrap();
    dejavu::tune::thresholds::input_stats(e, e, &tokens, 32).unwrap()
}

/// A prompt's batch under `mask_batches` computes each row as the plan's decode step does:
/// every group's thresholds calibrated (so each drops about half its inputs), every row's
/// logits against the step's, on the f32 model (only the order of summation differs).
#[test]
fn a_masked_batch_is_the_decode_steps() {
    let (_d, e) = load(&f32_model(&[]));
    let preds = dejavu::sparsity::predictors_file::Predictors::inputs_only(stats(&e));
    let pol = e.policy("teal:0.5:uniform:always", Some(&preds)).unwrap();
    let steps = decode(&e, &pol);
    let mut s = e.decoder(&pol).unwrap();
    s.mask_batches(true).unwrap();
    let batch = s
        .run(&TOKENS, Logits::Range(0, TOKENS.len()))
        .unwrap()
        .to_vec();
    assert_close("masked batch", &batch, &steps);
    // Unmasked, the batch is the dense model's: the masking changed it.
    let mut s = e.decoder(&pol).unwrap();
    let plain = s
        .run(&TOKENS, Logits::Range(0, TOKENS.len()))
        .unwrap()
        .to_vec();
    let moved = plain.iter().zip(&steps).any(|(a, b)| (a - b).abs() > 1e-2);
    assert!(moved, "the thresholds changed no logit");
    // A plan without thresholds, or with WINA's, refuses.
    let mut d = e.decoder(&Policy::dense(&e.model.config)).unwrap();
    assert!(d.mask_batches(true).is_err());
    let wina = e.policy("wina:0.5:always", Some(&preds)).unwrap();
    assert!(e.decoder(&wina).unwrap().mask_batches(true).is_err());
}

/// The greedy search's rows rise in model-wide sparsity one step of one group at a time to the
/// search's end; `teal:S` takes the groups' sparsities from them (at a row, exactly), the
/// file keeps them, and `teal:S:uniform` keeps every group at S.
#[test]
fn the_greedy_allocation_rises_to_its_end_and_teal_reads_it() {
    use dejavu::tune::allocation::{greedy, model_wide, weights, MAX, STEP};
    let (dir, e) = load(&f32_model(&[]));
    let mut st = stats(&e);
    let text = "Pack my box with five dozen liquor jugs; 1 + 2 = 3. ".repeat(6);
    let tokens = e.tokenizer.encode(&text).unwrap();
    st.alloc = greedy(&e, &st, &tokens, 64).unwrap();
    let w = weights(&e.model.config);
    let mut prev = [0f64; 4];
    for row in &st.alloc {
        let s = [row[1], row[2], row[3], row[4]].map(f64::from);
        let raised: Vec<f64> = s.iter().zip(prev).map(|(a, b)| a - b).collect();
        let ones = raised.iter().filter(|d| (*d - STEP).abs() < 1e-6).count();
        let zeros = raised.iter().filter(|d| d.abs() < 1e-6).count();
        assert_eq!((ones, zeros), (1, 3), "one group a step: {raised:?}");
        assert!((model_wide(&w, &s) - row[0] as f64).abs() < 1e-5);
        prev = s;
    }
    let last = st.alloc.last().expect("rows");
    assert!(last[0] as f64 >= MAX - 1e-5, "stopped at {}", last[0]);
    // `teal:S` at a row's model-wide sparsity: that row's thresholds.
    let row = st.alloc[st.alloc.len() / 2];
    let out = dir.path().join("p.safetensors");
    let preds = dejavu::sparsity::predictors_file::Predictors::inputs_only(st.clone());
    preds.save(&out, &e.model).unwrap();
    let loaded = e.predictors(Some(&out)).unwrap().unwrap();
    assert_eq!(loaded.inputs.as_ref().unwrap().alloc, st.alloc);
    let spec = format!("teal:{}", row[0]);
    let got = e.policy(&spec, Some(&loaded)).unwrap().inputs.unwrap();
    let groups = [row[1], row[2], row[3], row[4]].map(f64::from);
    let want = InputRule::groups(Score::Teal, row[0] as f64, groups, &st);
    for (a, b) in got.thresholds.iter().zip(&want.thresholds) {
        for (x, y) in a.iter().zip(b) {
            assert!((x - y).abs() <= 1e-4 * y.abs().max(1.0), "{a:?} vs {b:?}");
        }
    }
    let uniform = e.policy(&format!("{spec}:uniform"), Some(&loaded)).unwrap();
    // The sparsity the spec carries: `row[0]` printed, then read as f64 (not `row[0] as f64`,
    // which differs past f32's digits and may move a threshold by an ulp).
    let carried: f64 = row[0].to_string().parse().unwrap();
    let want = InputRule::uniform(Score::Teal, carried, &st);
    assert_eq!(uniform.inputs.unwrap().thresholds, want.thresholds);
}

#[test]
fn bad_input_sparsity_specs_are_refused() {
    let (_d, e) = load(&f32_model(&[]));
    let err = |spec: &str| e.policy(spec, None).err().unwrap().to_string();
    assert!(
        err("teal:0.5").contains("input thresholds"),
        "{}",
        err("teal:0.5")
    );
    let text = "Some calibration text, repeated. ".repeat(4);
    let tokens = e.tokenizer.encode(&text).unwrap();
    let stats = dejavu::tune::thresholds::input_stats(&e, &e, &tokens, 32).unwrap();
    let preds = dejavu::sparsity::predictors_file::Predictors::inputs_only(stats);
    let err = |spec: &str| e.policy(spec, Some(&preds)).err().unwrap().to_string();
    for (spec, why) in [
        ("teal:1.0", "[0, 1)"),
        ("teal:-0.1", "[0, 1)"),
        ("teal:0.5+gate-first:0.5", "one rule of this kind"),
        ("gate-first:0.5+teal:0.5", "no other MLP rule"),
        ("teal:0.5+wina:0.5", "no other MLP rule"),
        ("wina:0.5+attn-norm:0.5", "column norms"),
        ("teal", "one `teal:S`"),
        ("teal:0.5:even", "one `teal:S`"),
        ("teal:0.5:always:uniform", "one `teal:S`"),
        ("teal:0.5:always:always", "one `teal:S`"),
    ] {
        assert!(err(spec).contains(why), "{spec}: {}", err(spec));
    }
    assert!(e.policy("teal:0.3+attn-norm:0.5", Some(&preds)).is_ok());
}
