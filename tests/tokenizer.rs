//! The GGUF-built tokenizers: reference prompt ids (also checked in model_reference), round trips,
//! special tokens, and the chat templates stored in the files.
mod common;
use common::*;
use dejavu::model::tokenizer::Tokenizer;
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
