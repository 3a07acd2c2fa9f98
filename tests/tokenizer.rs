//! The GGUF-built tokenizers: reference prompt ids (also checked in model_reference), round trips,
//! special tokens, and the chat templates stored in the files.
mod common;
use common::*;
use dejavu::model::tokenizer::{render_chat_template, Tokenizer};
use dejavu::model::weights::Model;

fn tokenizer(name: &str) -> Tokenizer {
    let m = Model::load(model_path(name)).unwrap();
    Tokenizer::from_gguf(m.gguf_header().unwrap()).unwrap()
}

#[test]
fn reference_prompts_and_round_trips() {
    let samples = [
        "Hello, world! 12345 tokens: naïve café, 東京, emoji 🦀.\n\n\tindented\r\n  two  spaces",
        "fn main() { let x = vec![1, 2, 3]; println!(\"{x:?}\"); } // it's done",
        "",
    ];
    for name in [SMOLLM2, QWEN] {
        let tok = tokenizer(name);
        for case in &reference(name).greedy.cases {
            assert_eq!(
                tok.encode(&case.prompt).unwrap(),
                case.prompt_ids,
                "{name}: {:?}",
                case.prompt
            );
        }
        for s in samples {
            let ids = tok.encode(s).unwrap();
            assert_eq!(tok.decode(&ids).unwrap(), s, "{name}: round trip");
        }
    }
    // SmolLM2 splits digits one by one; Qwen2 too (`\p{N}` alone), both without a BOS.
    let smol = tokenizer(SMOLLM2);
    assert_eq!(smol.encode("12345").unwrap().len(), 5);
}

#[test]
fn chat_templates_render_and_special_tokens_are_atomic() {
    let user = [("user".to_string(), "Hi".to_string())];
    let smol = tokenizer(SMOLLM2);
    let text = smol.apply_chat_template(&user).unwrap();
    assert_eq!(
        text,
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n\
         <|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    );
    let ids = smol.encode(&text).unwrap();
    assert_eq!(ids[0], 1, "<|im_start|> is one token");
    assert!(
        smol.end_of_generation.contains(&2),
        "<|im_end|> ends generation"
    );
    assert_eq!(
        smol.decode(&ids[..1]).unwrap(),
        "",
        "special tokens are skipped when decoding"
    );

    let qwen = tokenizer(QWEN);
    let with_system = [
        ("system".to_string(), "Be brief.".to_string()),
        user[0].clone(),
    ];
    let text = qwen.apply_chat_template(&with_system).unwrap();
    assert_eq!(text, "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
    let ids = qwen.encode(&text).unwrap();
    assert_eq!(ids[0], 151644);
    assert!(qwen.end_of_generation.contains(&151645));
}

/// llama.cpp's tokenizer test vocabularies (`ggml-vocab-NAME.gguf`, written by its converter
/// from each model's Hugging Face tokenizer) and its test strings (`.inp`: multilingual text,
/// code, emoji, runs of spaces and newlines, leading spaces) with the ids Hugging Face's
/// tokenizer gives them (`.out`), as llama.cpp's `test-tokenizer-0` checks them. Every id must
/// match, and decode back to the string.
#[test]
fn gguf_vocabularies_tokenize_as_hugging_face() {
    let dir = common::model_path("llama.cpp-vocab");
    // (vocabulary, its tokenizer): SentencePiece (Llama 2, Phi-3) and byte-level BPE with the
    // pre-tokenizers of Llama 3, Qwen2 and GPT-2.
    for name in ["llama-spm", "phi-3", "llama-bpe", "qwen2", "gpt-2"] {
        let path = dir.join(format!("ggml-vocab-{name}.gguf"));
        let file = dejavu_formats::GgufFile::open(&path).unwrap();
        let tok = Tokenizer::from_gguf(&file.header).unwrap();
        let inp = std::fs::read_to_string(path.with_extension("gguf.inp")).unwrap();
        let out = std::fs::read_to_string(path.with_extension("gguf.out")).unwrap();
        let texts: Vec<&str> = inp.split("\n__ggml_vocab_test__\n").collect();
        let want: Vec<&str> = out.split('\n').collect();
        assert_eq!(
            texts.len(),
            want.len(),
            "{name}: test and expectation counts"
        );
        let mut checked = 0;
        for (text, want) in texts.iter().zip(&want).filter(|(t, _)| !t.is_empty()) {
            let want: Vec<u32> = want
                .split_whitespace()
                .map(|i| i.parse().unwrap())
                .collect();
            let got = tok.encode_plain(text).unwrap();
            assert_eq!(got, want, "{name}: {text:?}");
            assert_eq!(tok.decode(&got).unwrap(), *text, "{name}: round trip");
            checked += 1;
        }
        assert!(checked > 40, "{name}: {checked} strings");
        eprintln!("{name}: {checked} strings tokenize as Hugging Face's tokenizer");
    }
    // A pre-tokenizer we do not build is refused by name.
    let path = dir.join("ggml-vocab-falcon.gguf");
    let file = dejavu_formats::GgufFile::open(&path).unwrap();
    let err = Tokenizer::from_gguf(&file.header)
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("`falcon`"), "{err}");
}

/// The chat templates the families ship (as llama.cpp's tests keep them) render a system turn,
/// a user turn, an assistant reply and a second user turn in order, each family's markers around
/// each message, ending with the assistant's turn opened; Gemma's, which has no system role,
/// refuses one by its own `raise_exception`. Llama 3.2's puts today's date in (`strftime_now`).
#[test]
fn families_chat_templates_render() {
    let dir = common::model_path("llama.cpp-vocab").join("templates");
    let m = |r: &str, c: &str| (r.to_string(), c.to_string());
    let chat = [
        m("system", "Be brief."),
        m("user", "Hi there"),
        m("assistant", "Hello!"),
        m("user", "What is 2+2?"),
    ];
    // (template, BOS, EOS, what the rendering contains in order, how it ends)
    let cases: [(&str, &str, &str, [&str; 4], &str); 8] = [
        (
            "meta-llama-Llama-3.1-8B-Instruct",
            "<|begin_of_text|>",
            "<|eot_id|>",
            [
                "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n",
                "Be brief.<|eot_id|>",
                "<|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|>",
                "<|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|>",
            ],
            "What is 2+2?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n",
        ),
        (
            "meta-llama-Llama-3.2-3B-Instruct",
            "<|begin_of_text|>",
            "<|eot_id|>",
            [
                "Cutting Knowledge Date: December 2023\nToday Date: ",
                "Be brief.<|eot_id|>",
                "user<|end_header_id|>\n\nHi there<|eot_id|>",
                "assistant<|end_header_id|>\n\nHello!",
            ],
            "What is 2+2?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n",
        ),
        (
            "meta-llama-Llama-3.3-70B-Instruct",
            "<|begin_of_text|>",
            "<|eot_id|>",
            [
                "system<|end_header_id|>",
                "Be brief.<|eot_id|>",
                "Hi there<|eot_id|>",
                "Hello!<|eot_id|>",
            ],
            "What is 2+2?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n",
        ),
        (
            "microsoft-Phi-3.5-mini-instruct",
            "<s>",
            "<|endoftext|>",
            [
                "<|system|>\nBe brief.<|end|>\n",
                "<|user|>\nHi there<|end|>\n",
                "<|assistant|>\nHello!<|end|>\n",
                "<|user|>\nWhat is 2+2?<|end|>\n",
            ],
            "<|assistant|>\n",
        ),
        (
            "mistralai-Mistral-Nemo-Instruct-2407",
            "<s>",
            "</s>",
            [
                "<s>",
                "[INST]Hi there[/INST]",
                "Hello!</s>",
                "[INST]Be brief.\n\nWhat is 2+2?[/INST]",
            ],
            "[/INST]",
        ),
        (
            "Qwen-Qwen2.5-7B-Instruct",
            "",
            "<|im_end|>",
            [
                "<|im_start|>system\nBe brief.<|im_end|>\n",
                "<|im_start|>user\nHi there<|im_end|>\n",
                "<|im_start|>assistant\nHello!<|im_end|>\n",
                "<|im_start|>user\nWhat is 2+2?<|im_end|>\n",
            ],
            "<|im_start|>assistant\n",
        ),
        (
            "Qwen-Qwen3-0.6B",
            "",
            "<|im_end|>",
            [
                "<|im_start|>system\nBe brief.<|im_end|>\n",
                "<|im_start|>user\nHi there<|im_end|>\n",
                "<|im_start|>assistant\nHello!<|im_end|>\n",
                "<|im_start|>user\nWhat is 2+2?<|im_end|>\n",
            ],
            "<|im_start|>assistant\n",
        ),
        (
            "google-gemma-2-2b-it",
            "<bos>",
            "<eos>",
            [
                "<bos>",
                "<start_of_turn>user\nHi there<end_of_turn>\n",
                "<start_of_turn>model\nHello!<end_of_turn>\n",
                "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n",
            ],
            "<start_of_turn>model\n",
        ),
    ];
    for (name, bos, eos, parts, end) in cases {
        let tpl = std::fs::read_to_string(dir.join(format!("{name}.jinja"))).unwrap();
        let messages = match name.contains("gemma") {
            true => {
                let err = render_chat_template(&tpl, &chat, bos, eos)
                    .unwrap_err()
                    .to_string();
                assert!(err.contains("System role not supported"), "{name}: {err}");
                &chat[1..]
            }
            false => &chat[..],
        };
        let text = render_chat_template(&tpl, messages, bos, eos)
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        let mut at = 0;
        for p in parts {
            let found = text[at..]
                .find(p)
                .unwrap_or_else(|| panic!("{name}: {p:?} in {text:?}"));
            at += found + p.len();
        }
        assert!(text.ends_with(end), "{name}: {text:?}");
        if name.contains("3.2") {
            let date = text
                .split("Today Date: ")
                .nth(1)
                .unwrap()
                .split('\n')
                .next()
                .unwrap();
            let today = chrono::Local::now().format("%d %b %Y").to_string();
            assert_eq!(date, today, "{name}: today's date");
        }
    }
}

/// Issue 52: a model file's chat template is a stranger's program. Templates that aborted the
/// process (a chain of 100,000 filters; `tojson` of a list nested 100,000 deep) or took
/// gigabytes (`'%1000000000d'|format`, `indent(1e9)`, endless output) are errors, each within
/// a second; an ordinary template still renders.
#[test]
fn hostile_chat_templates_are_errors_not_aborts() {
    let chat = [("user".to_string(), "hi".to_string())];
    let nested = "{% set ns = namespace(x=[]) %}{% for i in range(100000) %}\
                  {% set ns.x = [ns.x] %}{% endfor %}{{ ns.x|tojson }}";
    let cases = [
        (
            "a chain of 100,000 filters",
            format!("{{{{ 'a'{} }}}}", "|upper".repeat(100_000)),
            "bytes",
        ),
        (
            "a chain of 15,000 filters",
            format!("{{{{ 'a'{} }}}}", "|upper".repeat(15_000)),
            "",
        ),
        ("tojson of a deep list", nested.to_string(), ""),
        (
            "a huge format width",
            "{{ '%1000000000d'|format(1) }}".to_string(),
            "width",
        ),
        (
            "a huge indent",
            "{{ 'a\nb'|indent(1000000000) }}".to_string(),
            "width",
        ),
        (
            "endless output",
            "{% for i in range(1000000) %}{{ 'x' * 1000 }}{% endfor %}".to_string(),
            "",
        ),
    ];
    for (what, tpl, needle) in cases {
        let t0 = std::time::Instant::now();
        match render_chat_template(&tpl, &chat, "<s>", "</s>") {
            Ok(text) => assert!(text.len() <= 16 << 20, "{what}: {} bytes", text.len()),
            Err(e) => assert!(e.to_string().contains(needle), "{what}: {e}"),
        }
        assert!(t0.elapsed().as_secs() < 10, "{what}: {:?}", t0.elapsed());
    }
    let ok = "{% for m in messages %}<|{{ m.role }}|>{{ m.content|indent(2) }}{% endfor %}";
    assert_eq!(
        render_chat_template(ok, &chat, "", "").unwrap(),
        "<|user|>hi"
    );
}
