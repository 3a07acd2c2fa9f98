#!/usr/bin/env python3
"""Remake tests/reference/<model>.json: llama.cpp's outputs on the project's real models, the
independent reference the engine is tested against.

llama.cpp is built here from the sources that llama-cpp-python ships on the package registry (its
sdist vendors llama.cpp), so anyone can check the committed figures:

1. `pip download` the llama-cpp-python sdist (LLAMA_CPP_PYTHON below), extract it, and build the
   vendored llama.cpp with CMake (from pip, in a virtual environment of the work directory):
   llama-perplexity, llama-quantize and the shared libllama.
2. Per model (fetched with tools/fetch_models.py): `llama-quantize --allow-requantize ... F32`
   gives the weights dequantized to f32.
3. Perplexity as `llama-perplexity -c 512` on tools/eval_text.py's text: on the f32 weights with
   an f32 KV cache (`reference_f32_weights`), and on the quantized file as llama.cpp runs it by
   default (`reference_native_quant`: 8-bit quantized activations, f16 KV cache).
4. Greedy decoding on the f32 weights with an f32 KV cache, through llama-cpp-python's ctypes
   bindings over the libllama built in 1: per prompt, its ids (no special tokens added or parsed),
   then 32 greedy steps, each with the five largest logits.

Usage: llama_reference.py [--work DIR] [--threads N] [--out DIR] [MODEL ...]
       (default: every model of tools/fetch_models.py; DIR default ~/.cache/dejavu/llama-reference;
        --out default tests/reference). Takes 15-30 minutes on two cores, most of it the build.
"""
import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import tarfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import eval_text  # noqa: E402
import fetch_models  # noqa: E402

LLAMA_CPP_PYTHON = "0.3.36"
PROMPTS = ["The capital of France is", "Once upon a time,", "def fibonacci(n):"]
STEPS = 32
CTX = 512
GGML_TYPE_F32 = 0


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def run(cmd, **kw):
    log("+ " + " ".join(cmd))
    return subprocess.run(cmd, check=True, **kw)


def venv(work):
    """A virtual environment with CMake, Ninja and what the bindings import."""
    env_dir = os.path.join(work, "venv")
    py = os.path.join(env_dir, "bin", "python")
    if not os.path.exists(py):
        run([sys.executable, "-m", "venv", env_dir])
        run([py, "-m", "pip", "install", "-q", "cmake", "ninja", "numpy", "typing_extensions",
             "diskcache", "jinja2"])
    return env_dir


def build_llama(work, env_dir, threads):
    """Build the vendored llama.cpp; returns (sdist source dir, build bin dir)."""
    src = os.path.join(work, f"llama_cpp_python-{LLAMA_CPP_PYTHON}")
    if not os.path.isdir(src):
        dl = os.path.join(work, "sdist")
        os.makedirs(dl, exist_ok=True)
        run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary",
             "llama-cpp-python", "-d", dl, f"llama-cpp-python=={LLAMA_CPP_PYTHON}"])
        archive = os.path.join(dl, f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz")
        with tarfile.open(archive) as t:
            t.extractall(work, filter="data")
    llama = os.path.join(src, "vendor", "llama.cpp")
    build = os.path.join(llama, "build")
    binp = os.path.join(env_dir, "bin")
    env = dict(os.environ, PATH=binp + os.pathsep + os.environ["PATH"])
    run(["cmake", "-S", llama, "-B", build, "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
         "-DBUILD_SHARED_LIBS=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
         "-DLLAMA_BUILD_SERVER=OFF"], env=env, stdout=subprocess.DEVNULL)
    run(["cmake", "--build", build, "-j", str(threads), "--target", "llama-perplexity",
         "llama-quantize", "llama"], env=env)
    return src, os.path.join(build, "bin")


def perplexity(bindir, model, text_path, threads, f32_kv):
    cmd = [os.path.join(bindir, "llama-perplexity"), "-m", model, "-f", text_path, "-c", str(CTX),
           "-b", str(CTX), "-t", str(threads)]
    if f32_kv:
        cmd += ["-ctk", "f32", "-ctv", "f32"]
    log("+ " + " ".join(cmd))
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if r.returncode != 0:
        raise SystemExit(f"error: llama-perplexity failed:\n{r.stdout[-2000:]}")
    ppl = re.search(r"Final estimate: PPL = ([0-9.]+)", r.stdout)
    chunks = re.search(r"calculating perplexity over (\d+) chunks", r.stdout)
    if not ppl or not chunks:
        raise SystemExit(f"error: no estimate in llama-perplexity's output:\n{r.stdout[-2000:]}")
    return float(ppl.group(1)), int(chunks.group(1))


GREEDY = r'''
import ctypes, json, sys
import llama_cpp as L
model_path, threads, steps, prompts = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4])
L.llama_backend_init()
mp = L.llama_model_default_params()
model = L.llama_model_load_from_file(model_path.encode(), mp)
vocab = L.llama_model_get_vocab(model)
n_vocab = L.llama_vocab_n_tokens(vocab)
cases = []
for prompt in prompts:
    cp = L.llama_context_default_params()
    cp.n_ctx = 512; cp.n_batch = 512; cp.n_ubatch = 512
    cp.n_threads = threads; cp.n_threads_batch = threads
    cp.type_k = 0; cp.type_v = 0   # f32 KV cache
    ctx = L.llama_init_from_model(model, cp)
    raw = prompt.encode()
    buf = (L.llama_token * 512)()
    n = L.llama_tokenize(vocab, raw, len(raw), buf, 512, False, False)
    assert n > 0, n
    ids = list(buf[:n])
    feed, greedy, out = ids, [], []
    for _ in range(steps):
        arr = (L.llama_token * len(feed))(*feed)
        assert L.llama_decode(ctx, L.llama_batch_get_one(arr, len(feed))) == 0
        logits = L.llama_get_logits_ith(ctx, -1)
        row = [logits[i] for i in range(n_vocab)]
        top = sorted(range(n_vocab), key=lambda i: (-row[i], i))[:5]
        out.append({"top5": [[i, round(row[i], 5)] for i in top]})
        greedy.append(top[0])
        feed = [top[0]]
    L.llama_free(ctx)
    cases.append({"prompt": prompt, "prompt_ids": ids, "greedy_ids": greedy, "steps": out})
print(json.dumps(cases))
'''


def greedy(env_dir, src, bindir, model, threads):
    env = dict(os.environ, LLAMA_CPP_LIB_PATH=bindir, PYTHONPATH=src)
    py = os.path.join(env_dir, "bin", "python")
    r = subprocess.run([py, "-c", GREEDY, model, str(threads), str(STEPS), json.dumps(PROMPTS)],
                       env=env, stdout=subprocess.PIPE, check=True, text=True)
    return json.loads(r.stdout)


def reference(name, work, env_dir, src, bindir, text_path, threads):
    m = fetch_models.MODELS[name]
    path = fetch_models.fetch(name)
    f32 = os.path.join(work, f"{name}.f32.gguf")
    if not os.path.exists(f32):
        tmp = f"{f32}.{os.getpid()}.tmp"  # unique to this run; renamed once whole
        run([os.path.join(bindir, "llama-quantize"), "--allow-requantize", path, tmp, "F32"],
            stdout=subprocess.DEVNULL)
        os.replace(tmp, f32)
    ppl_f32, chunks = perplexity(bindir, f32, text_path, threads, f32_kv=True)
    ppl_native, chunks2 = perplexity(bindir, path, text_path, threads, f32_kv=False)
    assert chunks == chunks2
    log(f"{name}: ppl f32 {ppl_f32} native {ppl_native} over {chunks} chunks")
    return {
        "model": {"name": name, "file": m["file"], "sha256": m["sha256"], "bytes": m["bytes"]},
        "engine": f"llama.cpp vendored in llama-cpp-python {LLAMA_CPP_PYTHON} (sdist), CPU",
        "perplexity": {
            "text": "tools/eval_text.py",
            "text_sha256": eval_text.SHA256,
            "ctx": CTX,
            "chunks": chunks,
            "reference_f32_weights": ppl_f32,
            "reference_native_quant": ppl_native,
            "note": "f32 = weights dequantized to f32 (llama-quantize F32), f32 KV cache; "
                    "native = the quantized file as llama.cpp runs it by default (8-bit "
                    "quantized activations, f16 KV cache)",
        },
        "greedy": {"weights": "f32", "kv_cache": "f32",
                   "cases": greedy(env_dir, src, bindir, f32, threads)},
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="*", default=list(fetch_models.MODELS))
    ap.add_argument("--work", default=os.path.join(
        os.path.dirname(fetch_models.cache_dir()), "llama-reference"))
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--out", default=os.path.join(ROOT, "tests", "reference"))
    a = ap.parse_args()
    os.makedirs(a.work, exist_ok=True)
    os.makedirs(a.out, exist_ok=True)
    env_dir = venv(a.work)
    src, bindir = build_llama(a.work, env_dir, a.threads)
    text = eval_text.build()
    if hashlib.sha256(text).hexdigest() != eval_text.SHA256:
        raise SystemExit("error: the evaluation text does not match its pinned SHA-256")
    text_path = os.path.join(a.work, "eval.txt")
    eval_text.write_atomic(text_path, text)
    for name in a.models:
        if name not in fetch_models.MODELS:
            raise SystemExit(f"error: unknown model `{name}`")
        doc = reference(name, a.work, env_dir, src, bindir, text_path, a.threads)
        out = os.path.join(a.out, f"{name}.json")
        eval_text.write_atomic(out, (json.dumps(doc, indent=1) + "\n").encode())
        log(f"wrote {out}")


if __name__ == "__main__":
    main()
