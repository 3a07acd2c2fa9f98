#!/usr/bin/env python3
"""Lossless speculation against dense decoding, side by side in one run (issue 26, item 4).

For each repetition the script runs `dejavu generate` greedily once dense and once per
(draft policy, K) with `--speculate K`, alternating, and reports per pair: the tokens each dense
pass produced, the share of drafts kept, the decode speed-up over the dense run of the same
repetition (median over repetitions), and whether the text is dense decoding's.

    python3 tools/speculate_bench.py --bin target/release/dejavu -m MODEL \
        --policies gate-first:0.3,dense --ks 2,4,8 [--threads 2] [--backend cuda]

Speeds on a shared machine are noisy: compare only the ratios of one run.
"""
import argparse
import re
import statistics
import subprocess
import sys

PROMPT = (
    "The history of the printing press begins in the fifteenth century, when Johannes "
    "Gutenberg combined movable metal type, oil-based ink and a screw press. Within fifty years"
)

DECODE = re.compile(r"decode: (\d+) tokens, ([\d.]+) tok/s")
SPEC = re.compile(
    r"speculation: (\d+) dense passes, ([\d.]+) tokens each \| drafts kept: (\d+) of (\d+)"
)


def run(args, extra):
    cmd = [args.bin, "generate", "-m", args.model, "-p", args.prompt, "-n", str(args.n),
           "--temperature", "0", "--ignore-eos"]
    if args.backend:
        cmd += ["--backend", args.backend]
    else:
        cmd += ["-t", str(args.threads)]
    cmd += extra
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{out.stderr}")
    m = DECODE.search(out.stderr)
    if not m:
        sys.exit(f"no decode speed in:\n{out.stderr}")
    s = SPEC.search(out.stderr)
    spec = None
    if s:
        spec = (int(s.group(1)), float(s.group(2)), int(s.group(3)), int(s.group(4)))
    return out.stdout, float(m.group(2)), spec


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bin", default="target/release/dejavu")
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--policies", default="gate-first:0.3")
    ap.add_argument("--ks", default="2,4,8")
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--backend")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--prompt", default=PROMPT)
    ap.add_argument("--label", help="the model's name in the table")
    args = ap.parse_args()
    pairs = [(p, int(k)) for p in args.policies.split(",") for k in args.ks.split(",")]
    ratios = {pk: [] for pk in pairs}
    info = {}
    drafts = {}
    dense_speeds = []
    for _ in range(args.reps):
        dense_text, dense, _ = run(args, [])
        dense_speeds.append(dense)
        for p, k in pairs:
            text, speed, spec = run(args, ["--sparsity", p, "--speculate", str(k)])
            ratios[(p, k)].append(speed / dense)
            info[(p, k)] = (spec, text == dense_text)
            if (p, "draft") not in drafts:
                _, dspeed, _ = run(args, ["--sparsity", p])
                drafts[(p, "draft")] = dspeed / dense
    label = args.label or args.model.rsplit("/", 1)[-1]
    where = args.backend or f"cpu, {args.threads} threads"
    print(f"{label} ({where}), {args.n} greedy tokens, dense "
          f"{statistics.median(dense_speeds):.1f} tok/s (median of {args.reps})\n")
    print("| draft | draft alone vs dense | K | tokens per dense pass | drafts kept "
          "| speculative vs dense | dense's text |")
    print("|---|---|---|---|---|---|---|")
    for p, k in pairs:
        spec, same = info[(p, k)]
        passes, per, kept, drafted = spec
        print(f"| `{p}` | {drafts[(p, 'draft')]:.2f}x | {k} | {per:.2f} | "
              f"{100 * kept / max(drafted, 1):.0f}% | "
              f"{statistics.median(ratios[(p, k)]):.2f}x | {'yes' if same else 'NO'} |")


if __name__ == "__main__":
    main()
