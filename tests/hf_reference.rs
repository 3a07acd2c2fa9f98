//! Hugging Face checkpoint directories against Hugging Face's own implementation: the tiny
//! fixtures of tests/fixtures/hf, made and recorded by tools/make_hf_fixtures.py (transformers,
//! fp32 on the saved 16-bit weights, eager attention).
//!
//! Tolerances, derived: the engine reads the same f16/bf16 weights and computes in f32, as the
//! reference does; only summation order and transcendental rounding differ. A dot of length
//! n <= 1536 carries a relative error of ~sqrt(n) 2^-24 ~ 2.5e-6 of its absolute sum; through
//! <= 6 layers and logits of magnitude <= 30 this stays far under 0.01. We assert
//! |ours - ref| <= 0.01 + 0.001 |ref| on the top-5 logits of every teacher-forced step, batched
//! and token by token (the decode kernels keep f32 activations for float weights), the
//! reference's top-1 wherever its margin exceeds 0.5, the tokenizer's ids, and perplexity within
//! 0.5%.
mod common;
use common::*;
use dejavu::eval::perplexity::{perplexity, Feed};
use dejavu::exec::Logits;
use dejavu::exec::{Engine, EngineOptions};
use dejavu::sparsity::SparsePlan;
use dejavu::text::sampling::argmax;
use dejavu_backend_cpu::isa::Isa;
use dejavu_backend_cpu::CpuBackend;
use std::path::PathBuf;

const FIXTURES: [&str; common::HF_FIXTURES.len()] = common::HF_FIXTURES;
const ABS_TOL: f32 = 0.01;
const REL_TOL: f32 = 0.001;

fn dir(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/hf")
        .join(name)
}

fn hf_reference(name: &str) -> Reference {
    let text = std::fs::read_to_string(dir(name).join("reference.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn load(name: &str) -> Engine {
    Engine::load(dir(name), &EngineOptions::default()).unwrap_or_else(|e| panic!("{name}: {e}"))
}

fn check_logits(name: &str, eng: &Engine, backend: CpuBackend, batch: bool) -> (f32, usize) {
    let cpu = OnCpu::new(eng, backend, false);
    let plan = SparsePlan::dense(&eng.model.config);
    let vocab = eng.model.config.vocab_size;
    let (mut worst, mut top1) = (0f32, 0);
    for case in &hf_reference(name).greedy.cases {
        assert_eq!(
            eng.tokenizer.encode_prompt(&case.prompt).unwrap(),
            case.prompt_ids,
            "{name}: tokenizer on {:?}",
            case.prompt
        );
        let mut seq = case.prompt_ids.clone();
        seq.extend(&case.greedy_ids[..case.steps.len() - 1]);
        let p = case.prompt_ids.len();
        let mut s = cpu.fixed(&plan, eng.n_ctx);
        let logits: Vec<f32> = if batch {
            let r = Logits::Range(p - 1, seq.len());
            s.run(&seq, r).unwrap().to_vec()
        } else {
            s.run(&seq[..p - 1], Logits::Last).unwrap();
            (seq[p - 1..].iter())
                .flat_map(|&t| s.run(&[t], Logits::Last).unwrap().to_vec())
                .collect()
        };
        for (i, step) in case.steps.iter().enumerate() {
            let row = &logits[i * vocab..(i + 1) * vocab];
            if step.top5[0].1 - step.top5[1].1 > 0.5 {
                assert_eq!(
                    argmax(row),
                    step.top5[0].0,
                    "{name} {:?} step {i}: top-1",
                    case.prompt
                );
                top1 += 1;
            }
            for &(id, want) in &step.top5 {
                let err = (row[id as usize] - want).abs();
                worst = worst.max(err);
                assert!(
                    err <= ABS_TOL + REL_TOL * want.abs(),
                    "{name} {:?} step {i} token {id}: {} vs {want}",
                    case.prompt,
                    row[id as usize]
                );
            }
        }
    }
    (worst, top1)
}

#[test]
fn fixtures_match_hugging_face_logits() {
    for name in FIXTURES {
        let eng = load(name);
        for isa in Isa::supported() {
            for batch in [true, false] {
                let backend = CpuBackend::with_isa(isa, 2).unwrap();
                let (worst, top1) = check_logits(name, &eng, backend, batch);
                eprintln!("{name} {isa} batch={batch}: worst top-5 logit error {worst:.5}, top-1 checked at {top1} steps");
            }
        }
    }
}

/// Issue 52, item 5: a PyTorch checkpoint whose storages are not aligned in its zip (a writer
/// other than `torch.save`, which pads them to 64 bytes) loads by copying those tensors, and
/// computes Hugging Face's logits: opt-torch's shards rewritten by the zip crate behind a
/// 1-byte entry, so that storages start at odd offsets.
#[test]
fn a_pytorch_zip_with_misaligned_storages_loads_by_copying() {
    let d = tempfile::tempdir().unwrap();
    let mut odd = 0;
    for f in std::fs::read_dir(dir("opt-torch")).unwrap() {
        let f = f.unwrap().path();
        let to = d.path().join(f.file_name().unwrap());
        if f.extension().is_none_or(|e| e != "bin") {
            std::fs::copy(&f, &to).unwrap();
            continue;
        }
        let mut src = zip::ZipArchive::new(std::fs::File::open(&f).unwrap()).unwrap();
        let mut z = zip::ZipWriter::new(std::fs::File::create(&to).unwrap());
        let stored = zip::write::SimpleFileOptions::default()
            .compression_method(zip::CompressionMethod::Stored);
        let prefix = (src.file_names().next().unwrap().split('/').next().unwrap()).to_string();
        z.start_file(format!("{prefix}/.pad"), stored).unwrap();
        std::io::Write::write_all(&mut z, b"x").unwrap();
        for i in 0..src.len() {
            let mut e = src.by_index(i).unwrap();
            z.start_file(e.name().to_string(), stored).unwrap();
            std::io::copy(&mut e, &mut z).unwrap();
        }
        z.finish().unwrap();
        let mut out = zip::ZipArchive::new(std::fs::File::open(&to).unwrap()).unwrap();
        for i in 0..out.len() {
            let e = out.by_index_raw(i).unwrap();
            odd += (e.name().contains("/data/") && e.data_start() % 2 == 1) as usize;
        }
    }
    assert!(odd > 0, "the rewritten shards keep every storage aligned");
    let eng = Engine::load(d.path(), &EngineOptions::default()).unwrap();
    let backend = CpuBackend::with_isa(Isa::Scalar, 1).unwrap();
    let (worst, top1) = check_logits("opt-torch", &eng, backend, true);
    eprintln!("{odd} storages at odd offsets: worst top-5 logit error {worst:.5}, top-1 at {top1}");
}

#[test]
fn fixtures_match_hugging_face_perplexity() {
    let text = std::fs::read_to_string(dir("eval.txt")).unwrap();
    for name in FIXTURES {
        let eng = load(name);
        let r = hf_reference(name).perplexity;
        let tokens = eng.tokenizer.encode_document(&text).unwrap();
        let plan = SparsePlan::dense(&eng.model.config);
        for feed in [Feed::Batch, Feed::TokenByToken] {
            let got = perplexity(
                &eng,
                &mut eng.session(eng.fixed_plan(&plan).unwrap()).unwrap(),
                &tokens,
                r.ctx,
                feed,
                |_, _, _| {},
            )
            .unwrap();
            assert_eq!(got.n_chunks, r.chunks, "{name}");
            let rel = (got.ppl - r.reference_f32_weights).abs() / r.reference_f32_weights;
            eprintln!(
                "{name} {feed:?}: ppl {:.4} vs Hugging Face {:.4} ({:+.4}%)",
                got.ppl,
                r.reference_f32_weights,
                rel * 100.0
            );
            assert!(
                rel < 0.005,
                "{name} {feed:?}: ppl {} vs {}",
                got.ppl,
                r.reference_f32_weights
            );
        }
    }
}

/// A dense decode step reads every weight once: its counted bytes are the model's dense bytes
/// per token (embedding and position rows and the OPT projections included).
#[test]
fn dense_step_reads_every_weight_once() {
    for name in FIXTURES {
        let eng = load(name);
        let plan = SparsePlan::dense(&eng.model.config);
        let mut s = eng.session(eng.fixed_plan(&plan).unwrap()).unwrap();
        s.run(&[5, 6], Logits::Last).unwrap();
        s.run(&[7], Logits::Last).unwrap();
        assert_eq!(
            s.last_step().unwrap().weight_bytes,
            eng.model.dense_bytes_per_token(),
            "{name}"
        );
    }
}

/// `relu-exact` on the ReLU fixtures: the same logits as dense, decoding token by token (it
/// skips only neurons ReLU made zero; the neuron-major down projection is the f16 matrix
/// transposed, so only summation order differs), fewer MLP neurons and fewer bytes read.
#[test]
fn relu_exact_is_exact_and_reads_less() {
    for name in ["opt-relu", "llama-relu"] {
        let eng = load(name);
        let policy = eng.policy("relu-exact", None).unwrap();
        let dense = SparsePlan::dense(&eng.model.config);
        let case = &hf_reference(name).greedy.cases[0];
        let mut seq = case.prompt_ids.clone();
        seq.extend(&case.greedy_ids[..16]);
        let mut cd = eng.session(eng.fixed_plan(&dense).unwrap()).unwrap();
        let mut cs = eng.decoder(&policy).unwrap();
        for &t in &seq {
            let want = cd.run(&[t], Logits::Last).unwrap().to_vec();
            let got = cs.run(&[t], Logits::Last).unwrap();
            let worst = got
                .iter()
                .zip(&want)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            assert!(worst < 1e-3, "{name}: logits differ by {worst}");
            let s = cs.last_step().unwrap();
            let dense = cd.last_step().unwrap();
            assert!(
                s.mlp_kept < s.mlp_total && s.weight_bytes < dense.weight_bytes,
                "{name}: {s:?}"
            );
        }
    }
}
