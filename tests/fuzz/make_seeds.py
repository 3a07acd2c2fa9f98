#!/usr/bin/env python3
"""Write the fuzz targets' seed corpus (tests/fuzz/corpus/<target>/) from a tiny llama written
here with the standard library only: a Hugging Face directory (config.json, model.safetensors,
tokenizer.json, tokenizer_config.json with a chat template) left in tests/fuzz/tiny-llama/.
The GGUF and predictors seeds are made from it by the engine:

    dejavu quantize tests/fuzz/tiny-llama -t f16 -o tests/fuzz/corpus/gguf/tiny-f16.gguf
    dejavu quantize tests/fuzz/tiny-llama -t q8_0 -o tests/fuzz/corpus/gguf/tiny-q8_0.gguf
    dejavu calibrate -m tiny-q8_0.gguf --data TEXT --ctx 64 --sample-tokens 512 \
        --validation-tokens 256 --out tests/fuzz/corpus/predictors/calibrated

(TEXT: 3000 random words `w0`..`w28`; calibrate a copy of the GGUF, outside the corpus.)"""
import json
import os
import random
import struct

HERE = os.path.dirname(os.path.abspath(__file__))
D, FF, HEADS, KV, HD, VOCAB = 32, 64, 2, 1, 16, 32


def safetensors(tensors, metadata=None):
    """tensors: [(name, shape, [floats])] as F32."""
    header, blobs, off = {}, [], 0
    if metadata:
        header["__metadata__"] = metadata
    for name, shape, vals in tensors:
        b = struct.pack(f"<{len(vals)}f", *vals)
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    return struct.pack("<Q", len(h)) + h + b"".join(blobs)


def tiny_llama():
    rng = random.Random(7)
    w = lambda *shape: (list(shape), [rng.uniform(-0.2, 0.2) for _ in range(_n(shape))])
    ones = lambda n: ([n], [1.0] * n)
    p = "model.layers.0."
    t = {
        "model.embed_tokens.weight": w(VOCAB, D),
        p + "input_layernorm.weight": ones(D),
        p + "self_attn.q_proj.weight": w(HEADS * HD, D),
        p + "self_attn.k_proj.weight": w(KV * HD, D),
        p + "self_attn.v_proj.weight": w(KV * HD, D),
        p + "self_attn.o_proj.weight": w(D, HEADS * HD),
        p + "post_attention_layernorm.weight": ones(D),
        p + "mlp.gate_proj.weight": w(FF, D),
        p + "mlp.up_proj.weight": w(FF, D),
        p + "mlp.down_proj.weight": w(D, FF),
        "model.norm.weight": ones(D),
    }
    return [(k, s, v) for k, (s, v) in t.items()]


def _n(shape):
    n = 1
    for s in shape:
        n *= s
    return n


CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
    "hidden_size": D, "intermediate_size": FF, "num_attention_heads": HEADS,
    "num_key_value_heads": KV, "head_dim": HD, "num_hidden_layers": 1, "vocab_size": VOCAB,
    "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2,
}
WORDS = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(VOCAB - 3)]
TOKENIZER = {
    "version": "1.0", "truncation": None, "padding": None,
    "added_tokens": [{"id": i, "content": t, "single_word": False, "lstrip": False,
                      "rstrip": False, "normalized": False, "special": True}
                     for i, t in enumerate(WORDS[:3])],
    "normalizer": None, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": None,
    "decoder": None,
    "model": {"type": "WordLevel", "vocab": {t: i for i, t in enumerate(WORDS)}, "unk_token": "<unk>"},
}
TEMPLATES = {
    "chatml": "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}",
    "llama2": "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'].strip() + ' [/INST]' }}{% elif message['role'] == 'assistant' %}{{ ' '  + message['content'].strip() + ' ' + eos_token }}{% endif %}{% endfor %}",
    "system-first": "{%- if messages[0]['role'] == 'system' %}{%- set system = messages[0]['content'] %}{%- set rest = messages[1:] %}{%- else %}{%- set system = 'You are helpful.' %}{%- set rest = messages %}{%- endif %}<<{{ system | trim }}>>{%- for m in rest %}{{ m.role | upper }}: {{ m.content | replace('\\n', ' ') }}{{ '\\n' if not loop.last }}{%- endfor %}{% if add_generation_prompt %}ASSISTANT:{% endif %}",
}


def write(path, data):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data if isinstance(data, bytes) else data.encode())


def framed(*parts):
    """The hf target's input: each part but the last as u32 length + bytes, then the last."""
    out = b""
    for p in parts[:-1]:
        out += struct.pack("<I", len(p)) + p
    return out + parts[-1]


def main():
    st = safetensors(tiny_llama())
    config = json.dumps(CONFIG, indent=1).encode()
    tdir = os.path.join(HERE, "tiny-llama")
    write(os.path.join(tdir, "config.json"), config)
    write(os.path.join(tdir, "model.safetensors"), st)
    write(os.path.join(tdir, "tokenizer.json"), json.dumps(TOKENIZER))
    write(os.path.join(tdir, "tokenizer_config.json"), json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "chat_template": TEMPLATES["chatml"]}))
    c = os.path.join(HERE, "corpus")
    write(os.path.join(c, "hf", "single"), framed(config, b"", st))
    index = json.dumps({"metadata": {}, "weight_map": {n: "model-00001-of-00001.safetensors"
                                                      for n, _, _ in tiny_llama()}}).encode()
    write(os.path.join(c, "hf", "indexed"), framed(config, index, st))
    opt = dict(CONFIG, architectures=["OPTForCausalLM"], model_type="opt", ffn_dim=FF,
               activation_function="relu", do_layer_norm_before=True, word_embed_proj_dim=D)
    write(os.path.join(c, "hf", "opt-config"), framed(json.dumps(opt).encode(), b"", st))
    msgs = b"\0".join([b"system", b"Be brief.", b"user", b"Hi there", b"assistant", b"Hello!",
                       b"user", b"What is 2+2?"])
    for name, tpl in TEMPLATES.items():
        write(os.path.join(c, "chat_template", name), tpl.encode() + b"\0" + msgs)
    reqs = {
        "chat": {"model": "m", "messages": [{"role": "system", "content": "x"},
                 {"role": "user", "content": [{"type": "text", "text": "hi"}]}],
                 "max_tokens": 8, "temperature": 0.7, "top_p": 0.9, "top_k": 40, "seed": 3,
                 "stop": ["\n", "END"], "n": 1, "stream": True,
                 "stream_options": {"include_usage": True}},
        "completion": {"prompt": ["Once upon"], "max_completion_tokens": 4, "stop": "."},
    }
    for name, r in reqs.items():
        write(os.path.join(c, "request", name), json.dumps(r))


if __name__ == "__main__":
    main()
