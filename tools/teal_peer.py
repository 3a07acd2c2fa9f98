#!/usr/bin/env python3
"""TEAL's own sparse GEMV (its Triton kernel) against cuBLAS's dense GEMV, at one model's shapes.

The peer of `dejavu bench --backend cuda --sparsity dense,teal:S` (issue 53): for each
projection of one decoder layer (Llama-3-8B's by default: q, k, v, o, gate, up, down), the time
of one f16 matrix-vector product with the input thresholded to sparsity S by TEAL's kernel
(`splitk_sparse_gemv`, weights stored input-major as TEAL requires) and densely by
`torch.matmul`, each the median of `--reps` CUDA-event timings with the L2 cache flushed before
every one (a 256 MB write, outside the timing); with --graph, as `profile_layer` times ours: 20
launches recorded in one CUDA graph, replayed, no flush (a matrix that fits the L2 cache is
flattered, on both sides alike). Prints a Markdown table, the layer's sum, and
the layer's speed-up; with --json, the figures too (written through a temporary file renamed
into place).

TEAL is not part of this repository: fetch FasterDecoding/TEAL and pass its
`kernels/sparse_gemv.py` (it needs PyTorch and Triton, as on the GPU machine).

    python3 tools/teal_peer.py --teal /scratch/TEAL/kernels/sparse_gemv.py --sparsity 0.5
"""
import argparse
import json
import os
import statistics
import sys
import tempfile
import types

# Llama-3-8B: d_model 4096, 32 query and 8 KV heads of 128, ffn 14336. (rows out, columns in).
LLAMA3_8B = {
    "q": (4096, 4096),
    "k": (1024, 4096),
    "v": (1024, 4096),
    "o": (4096, 4096),
    "gate": (14336, 4096),
    "up": (14336, 4096),
    "down": (4096, 14336),
}


def load_teal(path):
    """TEAL's kernel module: the source up to its torch.compile wrappers (which import its
    `compile_wrapper`, and through it `msgspec`); the Triton kernels and their launchers come
    before them."""
    with open(path) as f:
        src = f.read()
    cut = src.find("\nfrom compile_wrapper import")
    if cut > 0:
        src = src[:cut]
    mod = types.ModuleType("teal_sparse_gemv")
    mod.__file__ = os.path.abspath(path)  # Triton reads the kernels' source through it
    exec(compile(src, mod.__file__, "exec"), mod.__dict__)
    return mod


def median_ms(torch, fn, reps):
    flush = torch.empty(64 << 20, dtype=torch.int32, device="cuda")
    fn()  # compile and autotune
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        flush.zero_()
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def graph_ms(torch, fn, reps, launches=20):
    """Milliseconds a launch: `launches` launches of `fn` recorded in one CUDA graph, the
    median over `reps // 10` replays (after autotuning and one replay outside the timing)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()  # compile and autotune outside the capture
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(launches):
            fn()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(max(reps // 10, 5)):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / launches)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--teal", required=True, help="TEAL's kernels/sparse_gemv.py")
    ap.add_argument("--sparsity", type=float, default=0.5)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--graph", action="store_true",
                    help="time 20 launches in one CUDA graph, no L2 flush (as profile_layer)")
    ap.add_argument("--json", help="also write the figures here")
    a = ap.parse_args()
    if not 0.0 <= a.sparsity < 1.0:
        sys.exit("error: --sparsity is in [0, 1)")
    import torch

    teal = load_teal(a.teal)
    torch.manual_seed(0)
    rows, total = [], {"dense": 0.0, "teal": 0.0}
    for name, (n_out, n_in) in LLAMA3_8B.items():
        w_in_major = (torch.randn(n_in, n_out, device="cuda") * 0.02).half()
        weight = w_in_major.t()  # [n_out, n_in], column-major: TEAL's layout
        dense_w = weight.contiguous()
        x = torch.randn(1, 1, n_in, device="cuda").half()
        threshold = torch.quantile(x.abs().float(), a.sparsity).item()
        bin_ = int(a.sparsity // 0.05)
        y_teal = teal.splitk_sparse_gemv(x, weight, threshold, bin_)
        xs = torch.where(x.abs() > threshold, x, torch.zeros_like(x))
        y_ref = xs.float().view(1, n_in) @ weight.float().t()
        err = (y_teal.float().view(-1) - y_ref.view(-1)).abs().max().item()
        x2 = x.view(1, n_in)
        timer = graph_ms if a.graph else median_ms
        t_dense = timer(torch, lambda: torch.matmul(x2, dense_w.t()), a.reps)
        t_teal = timer(
            torch, lambda: teal.splitk_sparse_gemv(x, weight, threshold, bin_), a.reps
        )
        total["dense"] += t_dense
        total["teal"] += t_teal
        rows.append(
            {"name": name, "shape": [n_out, n_in], "dense_ms": t_dense, "teal_ms": t_teal,
             "max_abs_err": err}
        )
    how = "20 launches in one CUDA graph" if a.graph else "one launch, L2 flushed"
    print(f"TEAL splitk_sparse_gemv at sparsity {a.sparsity}, f16, {torch.cuda.get_device_name()}, {how}")
    print("| projection | out x in | cuBLAS dense ms | TEAL ms | speed-up | max abs error |")
    print("|---|---|---:|---:|---:|---:|")
    for r in rows:
        n_out, n_in = r["shape"]
        print(
            f"| {r['name']} | {n_out} x {n_in} | {r['dense_ms']:.4f} | {r['teal_ms']:.4f} | "
            f"{r['dense_ms'] / r['teal_ms']:.2f}x | {r['max_abs_err']:.2e} |"
        )
    layer = total["dense"] / total["teal"]
    print(
        f"| layer | | {total['dense']:.4f} | {total['teal']:.4f} | {layer:.2f}x | |"
    )
    if a.json:
        out = {"sparsity": a.sparsity, "graph": a.graph, "device": torch.cuda.get_device_name(), "rows": rows}
        d = os.path.dirname(os.path.abspath(a.json))
        fd, tmp = tempfile.mkstemp(prefix=".dejavu-", suffix=".tmp", dir=d)
        with os.fdopen(fd, "w") as f:
            json.dump(out, f, indent=1)
        os.replace(tmp, a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
