//! Models and inputs that used to give silent garbage or a crash (issue 23, items 10-13, 15, 16):
//! each is now a clear error and exit 1. Through the `dejavu` binary.
mod common;
use common::*;
use dejavu_formats::gguf::{GgmlType, MetaValue};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::Command;

fn run(args: &[&std::ffi::OsStr]) -> (Option<i32>, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_dejavu"))
        .args(args)
        .output()
        .unwrap();
    let s = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    (out.status.code(), s(&out.stdout), s(&out.stderr))
}

fn write(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, bytes).unwrap();
    p
}

fn generate(model: &Path, needle: &str) {
    fails_with(
        &[
            "generate",
            "-m",
            model.to_str().unwrap(),
            "-p",
            "hi",
            "-n",
            "4",
        ],
        needle,
    );
}

/// A copy of a Hugging Face fixture with `edit` applied to its config.json, generation_config.json
/// and tokenizer.json.
fn hf_copy(name: &str, edit: impl FnOnce(&mut Value, &mut Value, &mut Value)) -> tempfile::TempDir {
    let src = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/hf")
        .join(name);
    let d = tempfile::tempdir().unwrap();
    for f in std::fs::read_dir(&src).unwrap() {
        let f = f.unwrap().path();
        std::fs::copy(&f, d.path().join(f.file_name().unwrap())).unwrap();
    }
    let read = |f: &str| {
        serde_json::from_str::<Value>(&std::fs::read_to_string(d.path().join(f)).unwrap()).unwrap()
    };
    let (mut c, mut g, mut t) = (
        read("config.json"),
        read("generation_config.json"),
        read("tokenizer.json"),
    );
    edit(&mut c, &mut g, &mut t);
    for (f, v) in [
        ("config.json", c),
        ("generation_config.json", g),
        ("tokenizer.json", t),
    ] {
        std::fs::write(d.path().join(f), v.to_string()).unwrap();
    }
    d
}

/// Item 10: a layer count smaller than the file's is refused (it printed "ldldld...").
#[test]
fn fewer_layers_than_the_file_holds_are_refused() {
    let d = tempfile::tempdir().unwrap();
    let m = write(
        d.path(),
        "one.gguf",
        &tiny_llama_gguf(|meta, _| {
            for (k, v) in meta.iter_mut() {
                if k == "llama.block_count" {
                    *v = MetaValue::U32(1);
                }
            }
        }),
    );
    generate(&m, "does not use");
    let ck = hf_copy("llama-silu", |c, _, _| c["num_hidden_layers"] = 1.into());
    generate(ck.path(), "does not use");
}

/// Item 16: a layer count no file could hold is an error before anything is sized by it, also
/// under a 4 GB address-space limit (it reserved 6.2 GB and aborted).
#[test]
fn an_absurd_layer_count_is_refused_before_any_allocation() {
    let d = tempfile::tempdir().unwrap();
    let m = write(
        d.path(),
        "many.gguf",
        &tiny_llama_gguf(|meta, _| {
            for (k, v) in meta.iter_mut() {
                if k == "llama.block_count" {
                    *v = MetaValue::U32(8_388_609);
                }
            }
        }),
    );
    let cmd = format!(
        "ulimit -v 4000000; exec '{}' generate -m '{}' -p hi -n 2",
        env!("CARGO_BIN_EXE_dejavu"),
        m.display()
    );
    let out = Command::new("sh").args(["-c", &cmd]).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("8388609 layers"), "{err}");
}

/// Item 11: NaN or infinite norms, scales and embeddings are refused at load; weights that
/// overflow at run time stop generation and perplexity with an error, never `ppl: NaN`.
#[test]
fn non_finite_weights_are_refused() {
    let d = tempfile::tempdir().unwrap();
    let poison = |name: &'static str, at: usize, bytes: &'static [u8]| {
        tiny_llama_gguf(move |_, tensors| {
            let t = tensors.iter_mut().find(|t| t.0 == name).unwrap();
            t.3[at..at + bytes.len()].copy_from_slice(bytes);
        })
    };
    let nan32 = f32::NAN.to_le_bytes();
    let nan32: &'static [u8] = Box::leak(Box::new(nan32));
    let inf16: &'static [u8] = Box::leak(Box::new(half::f16::INFINITY.to_le_bytes()));
    for (name, at, bytes) in [
        ("blk.0.attn_norm.weight", 8, nan32),
        ("output_norm.weight", 0, nan32),
        ("token_embd.weight", 34 * 5, inf16),
        ("blk.1.ffn_down.weight", 0, inf16),
    ] {
        let m = write(d.path(), "bad.gguf", &poison(name, at, bytes));
        generate(&m, name);
        generate(&m, "non-finite");
    }
    // A NaN the load check's samples miss (an f16 matrix of 16384 values, sampled every 4th):
    // generation and perplexity stop with an error at run time, never `ppl: NaN`.
    let sneaky = tiny_llama_gguf(|meta, tensors| {
        let ff = 256usize;
        for (k, v) in meta.iter_mut() {
            if k == "llama.feed_forward_length" {
                *v = MetaValue::U32(ff as u32);
            }
        }
        for t in tensors
            .iter_mut()
            .filter(|t| t.0.contains(".ffn_") && !t.0.contains("norm"))
        {
            let down = t.0.contains("ffn_down");
            let (rows, cols) = if down { (TINY.d, ff) } else { (ff, TINY.d) };
            let vals: Vec<u8> = (0..rows * cols)
                .flat_map(|i| {
                    half::f16::from_f32(((i * 7919) % 13) as f32 * 0.01 - 0.06).to_le_bytes()
                })
                .collect();
            *t = (
                t.0.clone(),
                vec![cols as u64, rows as u64],
                GgmlType::F16,
                vals,
            );
        }
        let up = tensors
            .iter_mut()
            .find(|t| t.0 == "blk.0.ffn_up.weight")
            .unwrap();
        up.3[2..4].copy_from_slice(&half::f16::NAN.to_le_bytes()); // element 1
    });
    let m = write(d.path(), "sneaky.gguf", &sneaky);
    generate(&m, "non-finite");
    let text = write(
        d.path(),
        "t.txt",
        "some words to score. ".repeat(40).as_bytes(),
    );
    fails_with(
        &[
            "perplexity",
            "-m",
            m.to_str().unwrap(),
            "--file",
            text.to_str().unwrap(),
            "--ctx",
            "32",
        ],
        "not finite",
    );
}

/// Item 12: a checkpoint whose tokenizer covers far fewer ids than its embedding has rows, or
/// whose BOS/EOS lie outside the vocabulary, is refused (the GGUF path already was).
#[test]
fn a_tokenizer_that_does_not_fit_the_model_is_refused() {
    let small = hf_copy("llama-silu", |_, _, t| {
        let keep = |id: u64| id < 300;
        let vocab = t["model"]["vocab"].as_object().unwrap().clone();
        let kept: serde_json::Map<String, Value> = vocab
            .into_iter()
            .filter(|(_, v)| keep(v.as_u64().unwrap()))
            .collect();
        let has = |s: &str| kept.contains_key(s);
        let merges: Vec<Value> = (t["model"]["merges"].as_array().unwrap().iter())
            .filter(|m| {
                let (a, b) = match m {
                    Value::String(s) => {
                        let mut it = s.splitn(2, ' ');
                        (
                            it.next().unwrap_or("").to_string(),
                            it.next().unwrap_or("").to_string(),
                        )
                    }
                    Value::Array(p) => {
                        (p[0].as_str().unwrap().into(), p[1].as_str().unwrap().into())
                    }
                    _ => unreachable!(),
                };
                has(&a) && has(&b) && has(&format!("{a}{b}"))
            })
            .cloned()
            .collect();
        t["model"]["vocab"] = Value::Object(kept);
        t["model"]["merges"] = Value::Array(merges);
        let added: Vec<Value> = (t["added_tokens"].as_array().unwrap().iter())
            .filter(|a| keep(a["id"].as_u64().unwrap()))
            .cloned()
            .collect();
        t["added_tokens"] = Value::Array(added);
    });
    generate(small.path(), "embedding rows");
    let eos = hf_copy("llama-silu", |c, g, _| {
        c["eos_token_id"] = 100_000.into();
        g["eos_token_id"] = 100_000.into();
    });
    generate(eos.path(), "outside the tokenizer");
}

/// Item 13: `perplexity` reads only what --chunks and --ctx need, and at most a bounded text:
/// `/dev/zero` is an error or a prefix, never an endless read.
#[test]
fn perplexity_reads_a_bounded_text() {
    if !Path::new("/dev/zero").exists() {
        return;
    }
    let d = tempfile::tempdir().unwrap();
    let m = write(d.path(), "m.gguf", &tiny_llama_gguf(|_, _| {}));
    let ms = m.to_str().unwrap();
    let t0 = std::time::Instant::now();
    fails_with(
        &["perplexity", "-m", ms, "--file", "/dev/zero", "--ctx", "32"],
        "larger than",
    );
    let args = [
        "perplexity",
        "-m",
        ms,
        "--file",
        "/dev/zero",
        "--ctx",
        "32",
        "--chunks",
        "2",
    ];
    let os: Vec<&std::ffi::OsStr> = args.iter().map(|a| a.as_ref()).collect();
    let (code, out, err) = run(&os);
    assert_eq!(code, Some(0), "{err}");
    assert!(out.contains("ppl: "), "{out}");
    assert!(t0.elapsed() < std::time::Duration::from_secs(60));
}

/// Item 15: arguments that are not UTF-8: a path is accepted, a prompt is a clear error (exit 2,
/// clap's usage error), never a panic.
#[cfg(unix)]
#[test]
fn non_utf8_arguments() {
    use std::os::unix::ffi::OsStrExt;
    let d = tempfile::tempdir().unwrap();
    let name = std::ffi::OsStr::from_bytes(b"mod\xffel.gguf");
    let m = d.path().join(name);
    std::fs::write(&m, tiny_llama_gguf(|_, _| {})).unwrap();
    let args: Vec<&std::ffi::OsStr> = vec![
        "generate".as_ref(),
        "-m".as_ref(),
        m.as_os_str(),
        "-p".as_ref(),
        "hi".as_ref(),
        "-n".as_ref(),
        "2".as_ref(),
    ];
    let (code, _, err) = run(&args);
    assert_eq!(code, Some(0), "{err}");
    let prompt = std::ffi::OsStr::from_bytes(b"caf\xe9");
    let args: Vec<&std::ffi::OsStr> = vec![
        "generate".as_ref(),
        "-m".as_ref(),
        m.as_os_str(),
        "-p".as_ref(),
        prompt,
        "-n".as_ref(),
        "2".as_ref(),
    ];
    let (code, _, err) = run(&args);
    assert_eq!(code, Some(2), "{err}");
    assert!(!err.contains("panicked") && err.contains("UTF-8"), "{err}");
}

/// A head width the weights do not have is refused by name: a Qwen3 checkpoint whose
/// `head_dim` is not its tensors' (they are 32 wide; hidden / heads would be 16), and a GGUF whose
/// value heads are wider than its key heads.
#[test]
fn a_head_width_the_weights_do_not_have_is_refused() {
    let ck = hf_copy("qwen3", |c, _, _| c["head_dim"] = 16.into());
    generate(ck.path(), "q_proj.weight` has shape");
    let d = tempfile::tempdir().unwrap();
    let m = write(
        d.path(),
        "kv.gguf",
        &tiny_llama_gguf(|meta, _| {
            meta.push(("llama.attention.value_length".into(), MetaValue::U32(1024)));
        }),
    );
    generate(&m, "value_length");
}

/// Issue 52: a sharded PyTorch checkpoint whose index and shards disagree. A tensor the index
/// puts in a shard that does not hold it is reported against pytorch_model.bin.index.json (it
/// named model.safetensors.index.json); a tensor a shard holds that the index does not list was
/// ignored, and is refused, as the GGUF path refuses unused tensors.
#[test]
fn a_pytorch_index_that_disagrees_with_its_shards_is_refused() {
    let src = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf/opt-torch");
    let index = "pytorch_model.bin.index.json";
    let with_index = |edit: &dyn Fn(&mut serde_json::Map<String, serde_json::Value>)| {
        let d = tempfile::tempdir().unwrap();
        for f in std::fs::read_dir(&src).unwrap() {
            let f = f.unwrap().path();
            std::fs::copy(&f, d.path().join(f.file_name().unwrap())).unwrap();
        }
        let text = std::fs::read_to_string(src.join(index)).unwrap();
        let mut v: serde_json::Value = serde_json::from_str(&text).unwrap();
        edit(v["weight_map"].as_object_mut().unwrap());
        std::fs::write(d.path().join(index), v.to_string()).unwrap();
        d
    };
    let other = "pytorch_model-00002-of-00002.bin";
    let moved = with_index(&|m| {
        let first = m
            .get("decoder.embed_tokens.weight")
            .unwrap()
            .as_str()
            .unwrap();
        assert_ne!(first, other, "the fixture's layout changed");
        m.insert("decoder.embed_tokens.weight".into(), other.into());
    });
    generate(
        moved.path(),
        "pytorch_model.bin.index.json puts `decoder.embed_tokens.weight` in pytorch_model-00002",
    );
    let unlisted = with_index(&|m| {
        m.remove("decoder.layers.0.fc1.bias");
    });
    generate(
        unlisted.path(),
        "holds `decoder.layers.0.fc1.bias`, which pytorch_model.bin.index.json's weight_map does not list",
    );
}

/// A PyTorch checkpoint whose pickle asks for code (`os.system` through GLOBAL and REDUCE,
/// `builtins.eval`, `builtins.exec` through STACK_GLOBAL, an object built by INST) is refused,
/// naming what it asked for, and nothing runs: the payload would create a file, which does not
/// appear. A shard that is not a zip at all is an error too.
#[test]
fn pickles_that_ask_for_code_are_refused() {
    let src = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf/opt-torch");
    let marker = tempfile::tempdir().unwrap();
    let made = marker.path().join("pwned");
    let cmd = format!("touch {}", made.display());
    let s = |t: &str| {
        let mut v = vec![b'X'];
        v.extend((t.len() as u32).to_le_bytes());
        v.extend(t.as_bytes());
        v
    };
    let call = |global: &[u8]| {
        let mut p = b"\x80\x02".to_vec();
        p.extend(global);
        p.extend(s(&cmd));
        p.extend(b"\x85R.");
        p
    };
    let mut stack_global = b"\x80\x02".to_vec();
    stack_global.extend(s("builtins"));
    stack_global.extend(s("exec"));
    stack_global.extend(b"\x93");
    stack_global.extend(s("import os"));
    stack_global.extend(b"\x85R.");
    let cases: [(Vec<u8>, &str); 4] = [
        (call(b"cos\nsystem\n"), "`os.system`"),
        (call(b"cbuiltins\neval\n"), "`builtins.eval`"),
        (stack_global, "`builtins.exec`"),
        (
            b"\x80\x02(ios\nsystem\nX\x01\x00\x00\x00x.".to_vec(),
            "opcode 0x69",
        ),
    ];
    for (pickle, needle) in cases {
        let d = tempfile::tempdir().unwrap();
        for f in std::fs::read_dir(&src).unwrap() {
            let f = f.unwrap().path();
            std::fs::copy(&f, d.path().join(f.file_name().unwrap())).unwrap();
        }
        let shard = d.path().join("pytorch_model-00002-of-00002.bin");
        let mut z = zip::ZipWriter::new(std::fs::File::create(&shard).unwrap());
        let opts = zip::write::SimpleFileOptions::default()
            .compression_method(zip::CompressionMethod::Stored);
        z.start_file("archive/data.pkl", opts).unwrap();
        std::io::Write::write_all(&mut z, &pickle).unwrap();
        z.finish().unwrap();
        generate(d.path(), needle);
        assert!(!made.exists(), "{needle}: the payload ran");
    }
    let d = tempfile::tempdir().unwrap();
    for f in std::fs::read_dir(&src).unwrap() {
        let f = f.unwrap().path();
        std::fs::copy(&f, d.path().join(f.file_name().unwrap())).unwrap();
    }
    write(
        d.path(),
        "pytorch_model-00001-of-00002.bin",
        b"\x80\x02cos\nsystem\n.",
    );
    generate(d.path(), "not a PyTorch zip");
}

/// Issue 52: a GGUF tokenizer's special-token ids past its vocabulary, token types outside
/// llama.cpp's 0-6 and SentencePiece scores that are not numbers were taken silently (the EOS
/// then never ended a reply, the merges ranked at random): each is an error naming its key.
#[test]
fn a_gguf_tokenizers_bad_ids_types_and_scores_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let set = |key: &'static str, v: MetaValue| {
        move |meta: &mut Vec<(String, MetaValue)>,
              _: &mut Vec<(String, Vec<u64>, GgmlType, Vec<u8>)>| {
            meta.retain(|(k, _)| k != key);
            meta.push((key.into(), v));
        }
    };
    let eos = write(
        dir.path(),
        "eos.gguf",
        &tiny_llama_gguf(set("tokenizer.ggml.eos_token_id", MetaValue::U32(999_999))),
    );
    generate(&eos, "tokenizer.ggml.eos_token_id");
    let types = MetaValue::Array(
        (0..256)
            .map(|i| MetaValue::I32(if i == 7 { 99 } else { 1 }))
            .collect(),
    );
    let typed = write(
        dir.path(),
        "types.gguf",
        &tiny_llama_gguf(set("tokenizer.ggml.token_type", types)),
    );
    generate(&typed, "token 7 has type");
    // SentencePiece (`llama`) with every score NaN.
    let spm = tiny_llama_gguf(|meta, _| {
        meta.retain(|(k, _)| k != "tokenizer.ggml.model" && k != "tokenizer.ggml.pre");
        meta.push((
            "tokenizer.ggml.model".into(),
            MetaValue::String("llama".into()),
        ));
        let scores = (0..256).map(|_| MetaValue::F32(f32::NAN)).collect();
        meta.push(("tokenizer.ggml.scores".into(), MetaValue::Array(scores)));
    });
    let spm = write(dir.path(), "spm.gguf", &spm);
    generate(&spm, "score is not a finite number");
}

/// Issue 52: config.json's RoPE scaling and token ids are read as written or refused: a
/// `rope_scaling` that is not an object, a null `rope_parameters` beside a `rope_scaling` that
/// names an unsupported scaling, a `rope_scaling` (Phi-3's LongRoPE) beside `rope_parameters`,
/// and an end-of-generation id past 2^32 (it was truncated to token 0).
#[test]
fn config_json_rope_and_ids_are_read_as_written() {
    type Edit = fn(&mut Value, &mut Value);
    let cases: [(&str, Edit); 4] = [
        ("rope_scaling", |c, _| c["rope_scaling"] = "big".into()),
        ("yarn", |c, _| {
            c["rope_parameters"] = Value::Null;
            c["rope_scaling"] = serde_json::json!({"rope_type": "yarn", "factor": 4.0});
        }),
        ("longrope", |c, _| {
            c["rope_scaling"] = serde_json::json!({"type": "longrope", "long_factor": [1.0],
                                                   "short_factor": [1.0]});
        }),
        ("outside the tokenizer", |c, g| {
            c["eos_token_id"] = (1u64 << 40).into();
            g["eos_token_id"] = (1u64 << 40).into();
        }),
    ];
    for (needle, edit) in cases {
        let d = hf_copy("llama-silu", |c, g, _| edit(c, g));
        generate(d.path(), needle);
    }
}
