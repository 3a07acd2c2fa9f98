#!/usr/bin/env python3
"""Side-by-side decode/prefill speed of dejavu and llama.cpp's llama-bench on one GGUF file.

The two engines alternate, round after round (each round: llama-bench then `dejavu bench`, both
with -r 3 at 1 and 2 threads), so slow phases of a shared machine hit both alike; we print each
round's tokens/s and the per-round ratio dejavu / llama.cpp with its median.

llama.cpp is not part of this repository: build llama-bench in a scratch folder (for example from
the source distribution of the `llama-cpp-python` package: `pip download llama-cpp-python
--no-deps`, unpack, `cmake -B build vendor/llama.cpp -DGGML_NATIVE=ON && cmake --build build
--target llama-bench`) and pass its path.

    python3 tools/side_by_side.py --llama-bench /scratch/llama-bench --model PATH.gguf --rounds 5
"""
import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-bench", required=True, help="path to a llama-bench binary")
    ap.add_argument("--model", required=True, help="GGUF file")
    ap.add_argument("--dejavu", default=str(ROOT / "target" / "release" / "dejavu"))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("-p", "--n-prompt", type=int, default=128)
    ap.add_argument("-n", "--n-gen", type=int, default=64)
    ap.add_argument("--threads", default="1,2")
    a = ap.parse_args()
    common = ["-t", a.threads, "-p", str(a.n_prompt), "-n", str(a.n_gen), "-r", "3"]
    res: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        out_json = Path(tmp) / "dejavu.json"
        for r in range(a.rounds):
            lb = subprocess.run([a.llama_bench, "-m", a.model, *common, "-o", "json"],
                                capture_output=True, text=True, check=True)
            for row in json.loads(lb.stdout):
                test = f"pp{row['n_prompt']}" if row["n_prompt"] else f"tg{row['n_gen']}"
                res.setdefault((test, row["n_threads"], "llama.cpp"), []).append(row["avg_ts"])
            subprocess.run([a.dejavu, "bench", "-m", a.model, *common, "--json", str(out_json)],
                           capture_output=True, check=True)
            for row in json.loads(out_json.read_text()):
                res.setdefault((row["test"], row["threads"], "dejavu"), []).append(
                    row["tok_per_s_median"])
            print(f"round {r + 1}/{a.rounds} done", file=sys.stderr)
    print("| test | threads | llama.cpp t/s (median of rounds) | dejavu t/s | ratio per round | median ratio |")
    print("|---|---:|---:|---:|---|---:|")
    for test, th in sorted({(k[0], k[1]) for k in res}):
        ll, dj = res[(test, th, "llama.cpp")], res[(test, th, "dejavu")]
        ratios = [d / l for l, d in zip(ll, dj)]
        print(f"| {test} | {th} | {statistics.median(ll):.1f} | {statistics.median(dj):.1f} | "
              f"{' '.join(f'{x:.2f}' for x in ratios)} | {statistics.median(ratios):.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
