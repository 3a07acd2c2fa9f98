//! Bad input gets a clear message and a non-zero exit, never a panic: crafted model files, missing
//! files, prompts longer than the context. Checked through the `dejavu` binary.
mod common;
use common::*;
use dejavu_formats::gguf::MetaValue;
use std::process::Command;

fn generate_on(bytes: &[u8], needle: &str) {
    let f = temp_file(bytes);
    fails_with(
        &[
            "generate",
            "--model",
            f.path().to_str().unwrap(),
            "--prompt",
            "hi",
            "-n",
            "2",
        ],
        needle,
    );
}

#[test]
fn file_level_errors() {
    generate_on(b"", "empty");
    generate_on(b"GGML\x03\0\0\0\0\0\0\0", "not a GGUF file");
    let good = tiny_llama_gguf(|_, _| {});
    let mut v = good.clone();
    v[4] = 9;
    generate_on(&v, "unsupported GGUF version 9");
    generate_on(&good[..40], "truncated");
    generate_on(&good[..good.len() - 100], "past the end of the file");
    fails_with(
        &[
            "generate",
            "--model",
            "/nonexistent/model.gguf",
            "--prompt",
            "hi",
        ],
        "not found",
    );
    fails_with(
        &["inspect", "/nonexistent/model.gguf"],
        "model file not found",
    );
    fails_with(
        &[
            "perplexity",
            "--model",
            "/nonexistent/model.gguf",
            "--file",
            "/etc/hostname",
        ],
        "not found",
    );
}

#[test]
fn model_level_errors() {
    let set = |key: &'static str, val: MetaValue| {
        tiny_llama_gguf(move |meta, _| {
            meta.iter_mut()
                .filter(|(k, _)| k == key)
                .for_each(|(_, v)| *v = val.clone())
        })
    };
    generate_on(
        &set("general.architecture", MetaValue::String("mamba".into())),
        "unsupported architecture `mamba`",
    );
    generate_on(
        &set("llama.attention.head_count_kv", MetaValue::U32(3)),
        "kv heads",
    );
    generate_on(
        &set("tokenizer.ggml.pre", MetaValue::String("mystery".into())),
        "pre-tokenizer `mystery`",
    );
    generate_on(
        &tiny_llama_gguf(|meta, _| meta.retain(|(k, _)| k != "llama.block_count")),
        "llama.block_count` is missing",
    );
    generate_on(
        &tiny_llama_gguf(|_, t| t.retain(|(n, ..)| n != "blk.1.ffn_up.weight")),
        "tensor `blk.1.ffn_up.weight` is missing",
    );
    let wrong_shape = tiny_llama_gguf(|_, t| {
        let w = t
            .iter_mut()
            .find(|(n, ..)| n == "blk.0.attn_q.weight")
            .unwrap();
        w.1 = vec![32, 128];
    });
    generate_on(&wrong_shape, "blk.0.attn_q.weight` has shape [32, 128]");
    let unsupported = tiny_llama_gguf(|_, t| {
        let w = t
            .iter_mut()
            .find(|(n, ..)| n == "blk.0.ffn_down.weight")
            .unwrap();
        w.2 = dejavu_formats::GgmlType::Q8_1; // same 32-element blocks, 36 bytes: resize the data
        w.3 = vec![0; w.3.len() / 34 * 36];
    });
    generate_on(&unsupported, "unsupported weight type Q8_1");
}

#[test]
fn prompt_longer_than_context() {
    let f = temp_file(&tiny_llama_gguf(|_, _| {}));
    let path = f.path().to_str().unwrap();
    let long = "x".repeat(TINY.ctx + 10);
    fails_with(
        &["generate", "--model", path, "--prompt", &long],
        "does not fit the context window",
    );
    fails_with(
        &[
            "generate", "--model", path, "--prompt", "hello", "--ctx", "4",
        ],
        "does not fit the context window",
    );
    fails_with(
        &[
            "generate", "--model", path, "--prompt", "hi", "--ctx", "100000",
        ],
        "exceeds the model's",
    );
    fails_with(
        &["generate", "--model", path, "--prompt", ""],
        "prompt is empty",
    );
    fails_with(
        &[
            "generate", "--model", path, "--prompt", "hi", "--top-p", "2",
        ],
        "top-p 2 is out of range",
    );
    // And the tiny model does generate within its window; --verbose names the kernel tier.
    let out = Command::new(env!("CARGO_BIN_EXE_dejavu"))
        .args([
            "generate",
            "-v",
            "--model",
            path,
            "--prompt",
            "hello",
            "-n",
            "5",
            "--temperature",
            "0",
        ])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("kernels: "), "{stderr}");
    // A forced tier that is unknown is a clear error.
    let out = Command::new(env!("CARGO_BIN_EXE_dejavu"))
        .args(["generate", "--model", path, "--prompt", "hello", "-n", "2"])
        .env("DEJAVU_ISA", "mmx")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr.contains("DEJAVU_ISA=mmx: unknown tier"), "{stderr}");
}

#[test]
fn fetch_errors_are_clear() {
    fails_with(&["fetch", "no-such-model"], "unknown model `no-such-model`");
    let home = tempfile::tempdir().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_dejavu"))
        .args(["fetch", "smollm2-135m-instruct"])
        .env("PYTHON", "/nonexistent/python3")
        .env("DEJAVU_HOME", home.path())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        stderr.contains("install Python 3 with pip") && !stderr.contains("panicked"),
        "{stderr}"
    );
}

#[test]
fn unknown_quant_type_in_a_model_file() {
    let mut bytes = tiny_llama_gguf(|_, _| {});
    // Rewrite the type id (8 = Q8_0) of the first tensor entry, token_embd.weight, to 99.
    let name = b"token_embd.weight";
    let at = bytes.windows(name.len()).position(|w| w == name).unwrap() + name.len() + 4 + 2 * 8;
    assert_eq!(bytes[at..at + 4], 8u32.to_le_bytes());
    bytes[at..at + 4].copy_from_slice(&99u32.to_le_bytes());
    generate_on(&bytes, "ggml type id 99 (unknown) is not supported");
    // A type ggml has and we do not read is named.
    bytes[at..at + 4].copy_from_slice(&16u32.to_le_bytes());
    generate_on(&bytes, "ggml type IQ2_XXS (id 16) is not supported");
}

/// A GGUF may set `general.alignment` to 1: a tensor whose data then starts at an odd offset
/// cannot be read as blocks in place, and is refused at load (not a panic in a kernel).
#[test]
fn misaligned_tensor_data_is_refused() {
    let misaligned = (0..64)
        .find_map(|pad| {
            let mut bytes = tiny_llama_gguf(|meta, _| {
                meta.push(("general.alignment".into(), MetaValue::U32(1)));
                meta.push(("pad".into(), MetaValue::String("x".repeat(pad))));
            });
            // The writer pads data to 32 bytes; read with alignment 1 it starts earlier, so
            // keep the last tensor inside the file.
            bytes.extend([0u8; 64]);
            let h = dejavu_formats::gguf::parse(&bytes).ok()?;
            (h.data_start % 2 == 1).then_some(bytes)
        })
        .expect("some padding puts the data at an odd offset");
    generate_on(&misaligned, "not aligned");
}
