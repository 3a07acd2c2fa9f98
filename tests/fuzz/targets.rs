//! The fuzz targets' bodies, shared by the `cargo fuzz` binaries (tests/fuzz/fuzz_targets/) and
//! the regression replay that `cargo test` runs (tests/fuzz_replay.rs). Each takes any bytes and
//! must return without panicking, hanging or allocating without bound: bad input is an `Err`.
#![allow(dead_code)]
use dejavu::exec::{Engine, EngineOptions};
use dejavu::serve::api::Request;
use dejavu::sparsity::policy::Policy;
use dejavu::sparsity::predictors_file::Predictors;
use dejavu::text::generate::generate_on;
use dejavu::text::sampling::{Sampler, SamplerConfig};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// Models up to this size are also run (a prompt and a few tokens) once they load.
const RUN_BELOW: usize = 1 << 20;

/// A scratch directory of this process (tmpfs where there is one).
fn scratch(name: &str) -> PathBuf {
    let shm = Path::new("/dev/shm");
    let base = if shm.is_dir() {
        shm.to_path_buf()
    } else {
        std::env::temp_dir()
    };
    let d = base.join(format!("dejavu-fuzz-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&d).expect("scratch directory");
    d
}

fn options() -> EngineOptions {
    EngineOptions {
        threads: Some(1),
        n_ctx: None,
        ..Default::default()
    }
}

/// Load, and for a small model generate a few greedy tokens from a prompt and a chat.
fn load_and_run(path: &Path) {
    let Ok(engine) = Engine::load(path, &options()) else {
        return;
    };
    let bytes: usize = engine.model.mapped_files().iter().map(|f| f.len()).sum();
    if bytes > RUN_BELOW {
        return;
    }
    let policy = Policy::dense(&engine.model.config);
    let mut prompts = vec![engine.tokenizer.encode_prompt("w1 w2 hello")];
    if engine.tokenizer.has_chat_template() {
        let chat = [("user".to_string(), "hi".to_string())];
        if let Ok(text) = engine.tokenizer.apply_chat_template(&chat) {
            prompts.push(engine.tokenizer.encode(&text));
        }
    }
    for ids in prompts.into_iter().flatten() {
        let Ok(mut session) = engine.decoder(&policy) else {
            return;
        };
        let mut sampler = Sampler::new(SamplerConfig::greedy());
        let _ = generate_on(&engine, &mut session, &ids, 4, &mut sampler, |_| {});
    }
}

/// A GGUF file: header, metadata, tensor table, config, tokenizer, then a short run.
pub fn gguf(data: &[u8]) {
    let _ = dejavu_formats::gguf::parse(data);
    let path = scratch("gguf").join("model.gguf");
    std::fs::write(&path, data).expect("scratch write");
    load_and_run(&path);
}

/// Split `data` into `n` parts: each but the last a little-endian u32 length and its bytes.
pub fn parts(mut data: &[u8], n: usize) -> Vec<&[u8]> {
    let mut out = Vec::with_capacity(n);
    for _ in 1..n {
        let Some((len, rest)) = data.split_first_chunk::<4>() else {
            break;
        };
        let len = (u32::from_le_bytes(*len) as usize).min(rest.len());
        out.push(&rest[..len]);
        data = &rest[len..];
    }
    out.push(data);
    out.resize(n, &[]);
    out
}

/// A Hugging Face directory: `config.json`, `model.safetensors.index.json` (when not empty)
/// and one shard, then a short run.
pub fn hf(data: &[u8]) {
    let [config, index, shard] = parts(data, 3)[..] else {
        return;
    };
    let _ = dejavu_formats::safetensors::parse(shard);
    if let Ok(text) = std::str::from_utf8(index) {
        let _ = dejavu_formats::hf::parse_index(text);
    }
    let dir = scratch("hf");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("scratch directory");
    std::fs::write(dir.join("config.json"), config).expect("scratch write");
    let shard_name = match index.is_empty() {
        true => "model.safetensors",
        false => {
            std::fs::write(dir.join("model.safetensors.index.json"), index).expect("scratch write");
            "model-00001-of-00001.safetensors"
        }
    };
    std::fs::write(dir.join(shard_name), shard).expect("scratch write");
    load_and_run(&dir);
}

/// A PyTorch checkpoint shard (a `torch.save` zip), and the same bytes as a bare pickle through
/// the restricted pickle machine.
pub fn torch(data: &[u8]) {
    let _ = dejavu_formats::torch::parse(Path::new("fuzz.bin"), data);
    let _ = dejavu_formats::torch::check_pickle(data);
}

/// The tiny llama (the GGUF seed), loaded once, for the predictors target.
fn tiny_engine() -> &'static Engine {
    static E: OnceLock<Engine> = OnceLock::new();
    E.get_or_init(|| {
        let p = scratch("tiny").join("tiny.gguf");
        std::fs::write(&p, include_bytes!("corpus/gguf/tiny-q8_0.gguf")).expect("scratch write");
        Engine::load(&p, &options()).expect("the tiny llama loads")
    })
}

/// A predictors file for the tiny llama; when it loads, its policy runs a short generation.
pub fn predictors(data: &[u8]) {
    let engine = tiny_engine();
    let path = scratch("pred").join("predictors.safetensors");
    std::fs::write(&path, data).expect("scratch write");
    let Ok(p) = Predictors::load(&path, &engine.model) else {
        return;
    };
    for spec in ["dejavu:0.5", "paper+lazy-kv", "recommended"] {
        let Ok(policy) = engine.policy(spec, Some(&p)) else {
            continue;
        };
        let Ok(mut session) = engine.decoder(&policy) else {
            continue;
        };
        let mut sampler = Sampler::new(SamplerConfig::greedy());
        let _ = generate_on(engine, &mut session, &[1, 5, 6], 3, &mut sampler, |_| {});
    }
}

/// A chat template, then NUL-separated role and content pairs.
pub fn chat_template(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    let mut it = text.split('\0');
    let tpl = it.next().unwrap_or_default();
    let rest: Vec<&str> = it.collect();
    let messages: Vec<(String, String)> = rest
        .chunks(2)
        .map(|p| {
            (
                p[0].to_string(),
                p.get(1).copied().unwrap_or("").to_string(),
            )
        })
        .collect();
    let _ = dejavu::model::tokenizer::render_chat_template(tpl, &messages, "<s>", "</s>");
}

/// A request body for both generation endpoints.
pub fn request(data: &[u8]) {
    for chat in [true, false] {
        if let Ok(r) = Request::parse(data) {
            let _ = r.validate(chat, 16, 4096);
        }
    }
}
