#!/usr/bin/env python3
"""Tiny Hugging Face checkpoints with golden outputs from Hugging Face's own code.

Two steps:

  make_hf_fixtures.py corpus CORPUS.txt.gz EVAL.txt
      (here, no dependencies) Gathers the training corpus from text installed on this machine:
      Python standard-library sources and Debian package documentation, sorted, every tenth
      document held out. Writes the training text gzipped and a held-out evaluation text.

  make_hf_fixtures.py build CORPUS.txt.gz EVAL.txt OUTDIR [--scale 1.0] [--only NAME,...]
      (on the device machine: torch, transformers, tokenizers) Trains a byte-level BPE of 8192
      tokens on the corpus, then trains each fixture model for a few minutes and saves it as a
      Hugging Face directory (fp16 or bf16 safetensors, some sharded) with `reference.json`:
      - perplexity the llama.cpp way (chunks of `ctx` tokens, BOS in place of each chunk's first
        token where the tokenizer adds one, the second half scored) in fp32;
      - for a few prompts: the tokenizer's ids, 32 greedy tokens, and each step's top-5 logits
        (teacher forced), in fp32.
      References are computed on the CPU in fp32 from the saved 16-bit weights, with eager
      attention, so they are Hugging Face's implementation on exactly the weights we load.

Fixtures (see tests/hf_reference.rs):
  opt-relu        OPT, pre-LN, hidden 384, 6 layers, ffn 1536, 6 heads; fp16, sharded. The ReLU
                  model whose sparsity the next issue exploits.
  opt-postln-proj OPT, post-LN (do_layer_norm_before false, as opt-350m), word_embed_proj_dim <
                  hidden (project_in/project_out); fp16.
  opt-noaffine    OPT without LayerNorm gains/biases (layer_norm_elementwise_affine false),
                  without the final LayerNorm (_remove_final_layer_norm) and without biases
                  (enable_bias false); fp16.
  llama-relu      LlamaForCausalLM, hidden_act relu (gated ReLU), GQA, untied head; fp16,
                  `torch_dtype` (the older key).
  llama-silu      LlamaForCausalLM, SwiGLU, tied head; bf16.
  qwen2           Qwen2ForCausalLM, QKV bias, tied head, ChatML template; fp16.
  llama3-rope     LlamaForCausalLM with Llama 3's RoPE scaling (factor 8, low/high frequency
                  factors 1/4, original context 64: with head_dim 16 its pairs fall in all three
                  regimes, kept, interpolated and slowed); bf16, hidden 64.
  qwen3           Qwen3ForCausalLM: per-head RMSNorm on Q and K, head_dim 32 with hidden 64 and
                  4 heads (not hidden / heads), no biases, tied head; bf16. Small (hidden 64) so
                  the tree stays small.

`build ... --tokenizer DIR` reuses DIR's tokenizer.json (a committed fixture's) instead of
training one, so a fixture added later shares the others' vocabulary.
"""
import gzip
import json
import math
import os
import sys
import sysconfig
import time

SPECIALS = ["<s>", "<pad>", "</s>", "<unk>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
PROMPTS = [
    "def read_config(path):\n",
    "The package provides",
    "import os\nimport sys\n\nclass ",
]


def gather_corpus(corpus_path, eval_path):
    root = sysconfig.get_paths()["stdlib"]
    docs = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("test", "tests", "site-packages", "idlelib"))
        for f in sorted(filenames):
            if f.endswith(".py"):
                docs.append(os.path.join(dirpath, f))
    doc_root = "/usr/share/doc"
    if os.path.isdir(doc_root):
        for dirpath, dirnames, filenames in os.walk(doc_root):
            dirnames.sort()
            for f in sorted(filenames):
                low = f.lower()
                if low.startswith(("readme", "changelog", "news")) or low.endswith(".txt"):
                    docs.append(os.path.join(dirpath, f))
    train, held = [], []
    for i, path in enumerate(docs):
        try:
            raw = gzip.open(path).read() if path.endswith(".gz") else open(path, "rb").read()
            text = raw.decode("utf-8")
        except (OSError, UnicodeDecodeError, EOFError):
            continue
        text = text[:200000]
        (held if i % 10 == 0 else train).append(text)
    body = "\n\n".join(train)[:40_000_000]
    with gzip.open(corpus_path, "wt", encoding="utf-8") as f:
        f.write(body)
    # Held-out evaluation text: code and prose, about 24 KB.
    code = [t for t in held if "def " in t][:40]
    prose = [t for t in held if "def " not in t][:40]
    ev, n = [], 0
    for c, p in zip(code, prose):
        for t in (c[:1500], p[:1500]):
            ev.append(t)
            n += len(t)
        if n > 24000:
            break
    with open(eval_path, "w", encoding="utf-8") as f:
        f.write("\n\n".join(ev))
    print(f"corpus {len(body)} chars from {len(train)} documents; eval {n} chars")


# ---------------------------------------------------------------------------------------------
# Device side


def train_tokenizer(text, out):
    from tokenizers import ByteLevelBPETokenizer

    tok = ByteLevelBPETokenizer(add_prefix_space=False)
    tok.train_from_iterator([text[i : i + 100000] for i in range(0, len(text), 100000)],
                            vocab_size=8192, min_frequency=2, special_tokens=SPECIALS)
    os.makedirs(out, exist_ok=True)
    tok.save_model(out)
    tok.save(os.path.join(out, "tokenizer.json"))
    return tok


def write_tokenizer(kind, tok_dir, out):
    """Write the tokenizer files a checkpoint of `kind` ships."""
    import shutil
    from tokenizers import Tokenizer
    from tokenizers.processors import TemplateProcessing

    os.makedirs(out, exist_ok=True)
    if kind == "opt":
        # facebook/opt-*: GPT-2 files, BOS `</s>` prepended by the slow tokenizer's add_bos_token.
        for f in ("vocab.json", "merges.txt"):
            shutil.copy(os.path.join(tok_dir, f), out)
        cfg = {"tokenizer_class": "GPT2Tokenizer", "add_bos_token": True, "bos_token": "</s>",
               "eos_token": "</s>", "unk_token": "</s>", "pad_token": "<pad>",
               "model_max_length": 512, "errors": "replace"}
    else:
        t = Tokenizer.from_file(os.path.join(tok_dir, "tokenizer.json"))
        if kind not in ("qwen2", "qwen3"):
            # Llama-style: BOS `<s>` prepended (Llama, Mistral, Phi-3 and Gemma checkpoints all
            # add a BOS token).
            t.post_processor = TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                  special_tokens=[("<s>", 0)])
            cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>",
                   "eos_token": "</s>", "pad_token": "<pad>", "add_bos_token": True,
                   "chat_template": CHATML, "model_max_length": 512}
        else:
            # As Qwen2 checkpoints ship it (and as transformers' Qwen2Tokenizer builds it): NFC,
            # Qwen's split pattern, then byte-level without the GPT-2 regex.
            from tokenizers import Regex, normalizers, pre_tokenizers
            t.normalizer = normalizers.NFC()
            t.pre_tokenizer = pre_tokenizers.Sequence([
                pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ])
            cfg = {"tokenizer_class": "Qwen2Tokenizer", "eos_token": "<|im_end|>",
                   "pad_token": "<pad>", "bos_token": None, "add_bos_token": False,
                   "chat_template": CHATML, "model_max_length": 512}
        t.save(os.path.join(out, "tokenizer.json"))
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f, indent=1)


FIXTURES = [
    # name, kind, seconds, lr, dtype, shard, config
    ("opt-relu", "opt", 150, 2e-3, "float16", "12MB",
     dict(hidden_size=384, num_hidden_layers=6, ffn_dim=1536, num_attention_heads=6,
          word_embed_proj_dim=384, do_layer_norm_before=True)),
    ("opt-postln-proj", "opt", 50, 5e-4, "float16", None,
     dict(hidden_size=192, num_hidden_layers=2, ffn_dim=768, num_attention_heads=3,
          word_embed_proj_dim=96, do_layer_norm_before=False)),
    ("opt-noaffine", "opt", 20, 2e-3, "float16", None,
     dict(hidden_size=64, num_hidden_layers=2, ffn_dim=256, num_attention_heads=2,
          word_embed_proj_dim=64, do_layer_norm_before=True, layer_norm_elementwise_affine=False,
          _remove_final_layer_norm=True, enable_bias=False)),
    ("llama-relu", "llama", 45, 2e-3, "float16", None,
     dict(hidden_size=128, num_hidden_layers=2, intermediate_size=384, num_attention_heads=4,
          num_key_value_heads=2, hidden_act="relu", tie_word_embeddings=False)),
    ("llama-silu", "llama", 45, 2e-3, "bfloat16", None,
     dict(hidden_size=128, num_hidden_layers=2, intermediate_size=384, num_attention_heads=4,
          num_key_value_heads=2, hidden_act="silu", tie_word_embeddings=True)),
    ("qwen2", "qwen2", 45, 2e-3, "float16", None,
     dict(hidden_size=128, num_hidden_layers=2, intermediate_size=384, num_attention_heads=4,
          num_key_value_heads=2, tie_word_embeddings=True, rope_theta=1e6)),
    ("llama3-rope", "llama", 45, 2e-3, "bfloat16", None,
     dict(hidden_size=64, num_hidden_layers=2, intermediate_size=192, num_attention_heads=4,
          num_key_value_heads=2, hidden_act="silu", tie_word_embeddings=True,
          rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                        "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    ("mistral-swa", "mistral", 45, 2e-3, "bfloat16", None,
     dict(hidden_size=64, num_hidden_layers=2, intermediate_size=192, num_attention_heads=4,
          num_key_value_heads=2, sliding_window=24, tie_word_embeddings=False)),
    ("phi3", "phi3", 45, 2e-3, "bfloat16", None,
     dict(hidden_size=64, num_hidden_layers=2, intermediate_size=192, num_attention_heads=4,
          num_key_value_heads=2, sliding_window=32, tie_word_embeddings=False)),
    ("gemma2", "gemma2", 45, 2e-3, "bfloat16", None,
     dict(hidden_size=64, num_hidden_layers=4, intermediate_size=192, num_attention_heads=4,
          num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24, sliding_window=24,
          attn_logit_softcapping=10.0, final_logit_softcapping=15.0)),
    ("gemma3", "gemma3", 45, 2e-3, "bfloat16", None,
     dict(hidden_size=64, num_hidden_layers=4, intermediate_size=192, num_attention_heads=4,
          num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16, sliding_window=24,
          layer_types=["sliding_attention", "sliding_attention", "full_attention",
                       "sliding_attention"])),
    # Saved as PyTorch pickle shards (torch.save), keys without `model.` and no lm_head, as the
    # facebook/opt-* checkpoints ship.
    ("opt-torch", "opt", 20, 2e-3, "float16", None,
     dict(hidden_size=32, num_hidden_layers=2, ffn_dim=128, num_attention_heads=2,
          word_embed_proj_dim=32, do_layer_norm_before=True)),
    ("qwen3", "qwen3", 45, 2e-3, "bfloat16", None,
     dict(hidden_size=64, num_hidden_layers=2, intermediate_size=192, num_attention_heads=4,
          num_key_value_heads=2, head_dim=32, tie_word_embeddings=True, rope_theta=1e6)),
]


def make_model(kind, cfg):
    import transformers as tf

    if kind == "opt":
        c = tf.OPTConfig(vocab_size=8192, max_position_embeddings=512, pad_token_id=1,
                         bos_token_id=2, eos_token_id=2, dropout=0.1, attention_dropout=0.0,
                         activation_function="relu", **cfg)
        return tf.OPTForCausalLM(c)
    common = dict(vocab_size=8192, max_position_embeddings=512, rms_norm_eps=1e-5,
                  attention_dropout=0.0, pad_token_id=1)
    if kind == "llama":
        c = tf.LlamaConfig(bos_token_id=0, eos_token_id=2, **common, **cfg)
        return tf.LlamaForCausalLM(c)
    if kind == "mistral":
        c = tf.MistralConfig(bos_token_id=0, eos_token_id=2, **common, **cfg)
        return tf.MistralForCausalLM(c)
    if kind == "phi3":
        c = tf.Phi3Config(bos_token_id=0, eos_token_id=2, resid_pdrop=0.0, embd_pdrop=0.0,
                          **common, **cfg)
        return tf.Phi3ForCausalLM(c)
    if kind in ("gemma2", "gemma3"):
        # Gemma: GeGLU (tanh GELU), RMSNorm with (1 + w), embeddings scaled by sqrt(d).
        g = dict(common, rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=2,
                 hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True)
        if kind == "gemma2":
            return tf.Gemma2ForCausalLM(tf.Gemma2Config(**g, **cfg))
        # Gemma 3: global layers at base 1e6 with linear scaling 2 (as the 4B+ models ship),
        # sliding layers at base 1e4; transformers 5 takes them per layer type.
        import inspect
        if "rope_parameters" in inspect.signature(tf.Gemma3TextConfig.__init__).parameters:
            rope = dict(rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
        else:
            rope = dict(rope_theta=1e6, rope_local_base_freq=1e4,
                        rope_scaling={"rope_type": "linear", "factor": 2.0})
        return tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(**g, **rope, **cfg))
    if kind == "qwen3":
        c = tf.Qwen3Config(bos_token_id=None, eos_token_id=5, **common, **cfg)
        return tf.Qwen3ForCausalLM(c)
    c = tf.Qwen2Config(bos_token_id=None, eos_token_id=5, **common, **cfg)
    return tf.Qwen2ForCausalLM(c)


def train(model, ids, seconds, lr, device):
    import torch

    model.to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.05)
    data = torch.tensor(ids, dtype=torch.long)
    seq, batch, warm = 256, 48, 200
    g = torch.Generator().manual_seed(0)
    t0, step, loss_avg = time.time(), 0, None
    est_steps = None
    while True:
        el = time.time() - t0
        if el > seconds:
            break
        if step == 50:
            est_steps = int(seconds / (el / 50))
        total = est_steps or 100000
        f = min(1.0, (step + 1) / warm) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, step / total))))
        for pg in opt.param_groups:
            pg["lr"] = lr * f
        starts = torch.randint(0, len(data) - seq - 1, (batch,), generator=g)
        x = torch.stack([data[s : s + seq + 1] for s in starts]).to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(input_ids=x[:, :-1], labels=x[:, :-1].clone())
        # labels are shifted inside the model: predicting x[1:] from x[:-1]
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        l = out.loss.item() if step % 50 == 0 else None
        if l is not None:
            loss_avg = l if loss_avg is None else 0.9 * loss_avg + 0.1 * l
        step += 1
    print(f"  {step} steps, loss ~{loss_avg:.3f}", flush=True)
    return model.cpu().eval()


def reference(dirpath, kind, eval_text, bos, add_bos):
    import torch
    import transformers as tf

    torch.set_num_threads(16)
    model = tf.AutoModelForCausalLM.from_pretrained(dirpath, dtype=torch.float32,
                                                    attn_implementation="eager").eval()
    tok = tf.AutoTokenizer.from_pretrained(dirpath)
    ctx = 512
    ids = tok(eval_text, add_special_tokens=False)["input_ids"]
    tj = os.path.join(dirpath, "tokenizer.json")
    if os.path.exists(tj):
        from tokenizers import Tokenizer
        own = Tokenizer.from_file(tj).encode(eval_text, add_special_tokens=False).ids
        print(f"  tokenizer.json agrees with transformers' tokenizer: {own == ids}", flush=True)
    if add_bos:
        ids = [bos] + ids
    n_chunks = len(ids) // ctx
    nll, n = 0.0, 0
    with torch.no_grad():
        for c in range(n_chunks):
            chunk = list(ids[c * ctx : (c + 1) * ctx])
            if add_bos:
                chunk[0] = bos
            logits = model(input_ids=torch.tensor([chunk])).logits[0].double()
            lp = torch.log_softmax(logits, dim=-1)
            for j in range(ctx // 2, ctx - 1):
                nll -= lp[j, chunk[j + 1]].item()
                n += 1
    ppl = math.exp(nll / n)
    cases = []
    with torch.no_grad():
        for prompt in PROMPTS:
            pids = tok(prompt)["input_ids"]
            added = add_bos and (not pids or pids[0] != bos)
            if added:
                pids = [bos] + pids
            seq = list(pids)
            steps, greedy = [], []
            for _ in range(32):
                lg = model(input_ids=torch.tensor([seq])).logits[0, -1]
                top = torch.topk(lg, 5)
                steps.append({"top5": [[int(i), round(float(v), 5)] for v, i in zip(top.values, top.indices)]})
                nxt = int(top.indices[0])
                greedy.append(nxt)
                seq.append(nxt)
            cases.append({"prompt": prompt, "prompt_ids": pids, "greedy_ids": greedy,
                          "greedy_text": tok.decode(greedy), "steps": steps,
                          "bos_added_by_script": added})
    zeros = None
    if kind == "opt":
        zeros = relu_zeros(model, ids[:ctx])
    return {
        "model": {"dir": os.path.basename(dirpath), "transformers": tf.__version__,
                  "torch": torch.__version__},
        "perplexity": {"text": "eval.txt", "ctx": ctx, "chunks": n_chunks, "scored": n,
                       "add_bos": add_bos, "reference_f32_weights": round(ppl, 5),
                       "reference_native_quant": round(ppl, 5),
                       "note": "Hugging Face transformers, fp32 on the saved 16-bit weights, eager attention"},
        "greedy": {"note": "fp32, greedy, top5 teacher forced", "cases": cases},
        "relu_zero_fraction": zeros,
    }


def relu_zeros(model, ids):
    """Per layer, the fraction of fc1 outputs that ReLU makes exactly zero."""
    import torch

    fracs = []
    hooks = []
    for layer in model.model.decoder.layers:
        def hook(_m, _i, out, acc=fracs):
            acc.append(round(float((out <= 0).float().mean()), 4))
        hooks.append(layer.fc1.register_forward_hook(hook))
    with torch.no_grad():
        model(input_ids=torch.tensor([ids]))
    for h in hooks:
        h.remove()
    return fracs


def build(corpus_path, eval_path, outdir, scale, only=None, tokenizer=None):
    import torch

    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = True
    text = gzip.open(corpus_path, "rt", encoding="utf-8").read()
    eval_text = open(eval_path, encoding="utf-8").read()
    tok_dir = os.path.join(outdir, "_tokenizer")
    if tokenizer and not os.path.exists(os.path.join(tokenizer, "tokenizer.json")):
        # An OPT fixture's GPT-2 files: the same byte-level BPE.
        import shutil
        from tokenizers import ByteLevelBPETokenizer
        os.makedirs(tok_dir, exist_ok=True)
        for f in ("vocab.json", "merges.txt"):
            shutil.copy(os.path.join(tokenizer, f), tok_dir)
        tok = ByteLevelBPETokenizer(os.path.join(tok_dir, "vocab.json"),
                                    os.path.join(tok_dir, "merges.txt"), add_prefix_space=False)
        tok.save(os.path.join(tok_dir, "tokenizer.json"))
    elif tokenizer:
        from tokenizers import Tokenizer
        os.makedirs(tok_dir, exist_ok=True)
        tok = Tokenizer.from_file(os.path.join(tokenizer, "tokenizer.json"))
        tok.save(os.path.join(tok_dir, "tokenizer.json"))
    else:
        tok = train_tokenizer(text, tok_dir)
    ids = tok.encode(text).ids
    print(f"corpus: {len(text)} chars, {len(ids)} tokens", flush=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for name, kind, secs, lr, dtype, shard, cfg in FIXTURES:
        if only and name not in only:
            continue
        try:
            build_one(name, kind, secs * scale, lr, dtype, shard, cfg, ids, tok_dir, outdir,
                      eval_text, device)
        except Exception:  # one fixture's failure is reported, the others still build
            import traceback
            traceback.print_exc()


def build_one(name, kind, secs, lr, dtype, shard, cfg, ids, tok_dir, outdir, eval_text, device):
    import torch

    print(f"{name}: training {secs:.0f}s", flush=True)
    torch.manual_seed(0)
    model = make_model(kind, cfg)
    model = train(model, ids, secs, lr, device)
    d = os.path.join(outdir, name)
    model.to(getattr(torch, dtype))
    kw = {"max_shard_size": shard} if shard else {"max_shard_size": "1GB"}
    model.save_pretrained(d, safe_serialization=True, **kw)
    write_tokenizer(kind, tok_dir, d)
    if name == "llama-relu":  # the older dtype key
        p = os.path.join(d, "config.json")
        c = json.load(open(p))
        if "dtype" in c:
            c["torch_dtype"] = c.pop("dtype")
        json.dump(c, open(p, "w"), indent=2)
    bos = {"opt": 2, "qwen2": None, "qwen3": None}.get(kind, 0)
    ref = reference(d, kind, eval_text, bos, bos is not None)
    with open(os.path.join(d, "reference.json"), "w") as f:
        json.dump(ref, f)
    if name == "opt-torch":
        to_torch_shards(model, d)
    print(f"  ppl {ref['perplexity']['reference_f32_weights']:.3f} "
          f"zeros {ref['relu_zero_fraction']} files {sorted(os.listdir(d))}", flush=True)
    for c in ref["greedy"]["cases"][:1]:
        print("  ", repr(c["prompt"]), c["prompt_ids"][:6], repr(c["greedy_text"][:60]), c["bos_added_by_script"])


def to_torch_shards(model, d):
    """Replace the safetensors file with two `torch.save` pickle shards and their index, keys
    without `model.` and no `lm_head.weight` (tied), as facebook/opt-* ship."""
    import torch

    sd = {k.removeprefix("model."): v.contiguous() for k, v in model.state_dict().items()
          if k != "lm_head.weight"}
    keys = sorted(sd)
    shards = [keys[: len(keys) // 2], keys[len(keys) // 2 :]]
    weight_map = {}
    for i, ks in enumerate(shards):
        fname = f"pytorch_model-{i + 1:05d}-of-{len(shards):05d}.bin"
        torch.save({k: sd[k] for k in ks}, os.path.join(d, fname))
        back = torch.load(os.path.join(d, fname), weights_only=True)
        assert all(torch.equal(back[k], sd[k]) for k in ks)
        weight_map.update({k: fname for k in ks})
    total = sum(v.numel() * v.element_size() for v in sd.values())
    with open(os.path.join(d, "pytorch_model.bin.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
    os.remove(os.path.join(d, "model.safetensors"))


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "corpus":
        gather_corpus(sys.argv[2], sys.argv[3])
    elif len(sys.argv) >= 5 and sys.argv[1] == "build":
        # Options after OUTDIR: --scale S (training time factor), --only NAME[,NAME...],
        # --tokenizer DIR (reuse DIR's tokenizer.json).
        opts = dict(zip(sys.argv[5::2], sys.argv[6::2]))
        only = opts["--only"].split(",") if "--only" in opts else None
        build(sys.argv[2], sys.argv[3], sys.argv[4], float(opts.get("--scale", 1.0)), only,
              opts.get("--tokenizer"))
    else:
        sys.exit(__doc__)
