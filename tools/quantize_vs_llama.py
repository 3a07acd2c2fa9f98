#!/usr/bin/env python3
"""`dejavu quantize` against `llama-quantize`, both judged by llama.cpp's `llama-perplexity`.

For each file type, quantize one source GGUF with both tools (llama-quantize with
--allow-requantize when the source is already quantized), then measure both outputs with
llama-perplexity (-c 512) on the same text, and print a markdown table with the ratio. With
--imatrix-text, also compare importance-matrix quantization: llama-imatrix + llama-quantize
--imatrix against `dejavu quantize --imatrix`, on the same calibration text.

llama.cpp is built from llama-cpp-python's sdist (see the README); nothing here is committed.

  python3 tools/quantize_vs_llama.py --llama-bin LLAMA/build/bin --model M.gguf \\
      --text eval.txt [--imatrix-text calib.txt] [--types q4_k_m,q5_k_m] [--threads 2]
"""
import argparse
import os
import re
import subprocess
import sys
import tempfile

p = argparse.ArgumentParser()
p.add_argument("--llama-bin", required=True)
p.add_argument("--model", required=True)
p.add_argument("--text", required=True)
p.add_argument("--imatrix-text")
p.add_argument("--imatrix-types", default="q4_k_m,q2_k")
p.add_argument("--types", default="q8_0,q6_k,q5_k_m,q4_k_m,q4_k_s,iq4_xs,q3_k_m,q2_k")
p.add_argument("--dejavu", default=os.path.join(os.path.dirname(__file__), "..", "target", "release", "dejavu"))
p.add_argument("--threads", default="2")
p.add_argument("--dejavu-args", default="", help="more arguments of dejavu quantize, e.g. --search-scales")
a = p.parse_args()
tmp = tempfile.mkdtemp(prefix="qvl-")


def run(cmd):
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"failed ({r.returncode}): {' '.join(cmd)}\n{r.stderr[-2000:]}")
    return r.stdout + r.stderr


def ppl(path):
    out = run([os.path.join(a.llama_bin, "llama-perplexity"), "-m", path, "-f", a.text, "-c", "512",
               "-t", a.threads])
    return float(re.search(r"Final estimate: PPL = ([0-9.]+)", out).group(1))


def both(t, imatrix=None):
    lq, dj = os.path.join(tmp, f"lq-{t}.gguf"), os.path.join(tmp, f"dj-{t}.gguf")
    cmd = [os.path.join(a.llama_bin, "llama-quantize"), "--allow-requantize"]
    if imatrix:
        cmd += ["--imatrix", imatrix[0]]
    run(cmd + [a.model, lq, t.upper(), a.threads])
    cmd = [a.dejavu, "quantize", a.model, "--type", t, "-o", dj, "-t", a.threads] + a.dejavu_args.split()
    if imatrix:
        cmd += ["--imatrix", imatrix[1]]
    run(cmd)
    same, total = same_tensors(lq, dj)
    pl = ppl(lq)
    pd = pl if same == total else ppl(dj)  # identical tensors: the same file to llama.cpp
    row = (t + (" + imatrix" if imatrix else ""), pl, pd, pd / pl, os.path.getsize(lq) / 1e6,
           os.path.getsize(dj) / 1e6, same, total)
    for f in (lq, dj):
        os.remove(f)
    print("| %s | %.4f | %.4f | %.4f | %.1f | %.1f | %d/%d |" % row, flush=True)


def same_tensors(x, y):
    """Tensors of equal name, type and bytes in two GGUF files, and the count in the first."""
    import gguf
    rx, ry = gguf.GGUFReader(x), gguf.GGUFReader(y)
    ty = {t.name: t for t in ry.tensors}
    same = sum(1 for t in rx.tensors if t.name in ty and ty[t.name].tensor_type == t.tensor_type
               and bytes(ty[t.name].data.tobytes()) == bytes(t.data.tobytes()))
    return same, len(rx.tensors)


print(f"source {os.path.basename(a.model)}: llama-perplexity {ppl(a.model):.4f} on {os.path.basename(a.text)}")
print("| type | llama-quantize ppl | dejavu ppl | ratio | llama-quantize MB | dejavu MB | identical tensors |")
print("|---|---|---|---|---|---|---|", flush=True)
for t in a.types.split(","):
    both(t)
if a.imatrix_text:
    im = os.path.join(tmp, "imatrix.gguf")
    run([os.path.join(a.llama_bin, "llama-imatrix"), "-m", a.model, "-f", a.imatrix_text, "-c", "512",
         "-o", im, "-t", a.threads])
    for t in a.imatrix_types.split(","):
        both(t, (im, a.imatrix_text))
