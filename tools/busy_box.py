#!/usr/bin/env python3
"""The thread pool on a busy machine, side by side in one run (issue 23's figures).

Measures, alternating the runs that are compared so a noisy machine hits both alike:
1. idle: decode (tg) and prefill (pp) at the default threads, this build against `--baseline`
   (another dejavu binary, e.g. one built from an earlier commit), as ratios;
2. one core busy with an ordinary-priority loop (`sh -c 'while :; do :; done'`): decode at the
   default threads over decode at `-t 1`, for dejavu and (with `--llama-bench`) llama.cpp;
3. two `dejavu bench` processes at the default threads at once: each one's decode over its solo
   speed;
4. an idle `dejavu serve`: its CPU use over a few seconds (percent of one core).

Usage: busy_box.py [--dejavu BIN] [--baseline BIN] [--llama-bench BIN] [--models M,...]
                   [--rounds 3] [--json OUT]
Prints a Markdown table per part and, with --json, writes the figures (through a unique
temporary file renamed into place).
"""
import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import eval_text  # noqa: E402
import fetch_models  # noqa: E402


def dejavu_tps(binary, model, threads, test, n=64, reps=3):
    """Median tok/s of one `dejavu bench` test ("tg" or "pp")."""
    p, g = (n, 0) if test == "pp" else (0, n)
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "b.json")
        subprocess.run([binary, "bench", "-m", model, "-t", str(threads), "-p", str(p), "-n",
                        str(g), "-r", str(reps), "--json", out],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        rows = json.load(open(out))
    return rows[0]["tok_per_s_median"]


def llama_tps(binary, gguf, threads, n=64, reps=3):
    r = subprocess.run([binary, "-m", gguf, "-p", "0", "-n", str(n), "-t", str(threads), "-r",
                        str(reps), "-o", "json"], check=True, stdout=subprocess.PIPE,
                       stderr=subprocess.DEVNULL, text=True)
    rows = json.loads(r.stdout)
    return rows[0]["avg_ts"]


class Busy:
    """An ordinary-priority busy loop on one core while in the `with` block."""

    def __enter__(self):
        self.p = subprocess.Popen(["sh", "-c", "while :; do :; done"])
        time.sleep(0.5)
        return self

    def __exit__(self, *exc):
        self.p.kill()
        self.p.wait()


def alternate(rounds, fns):
    """Run each of `fns` once per round, in turn; the median of each."""
    got = [[] for _ in fns]
    for _ in range(rounds):
        for i, f in enumerate(fns):
            got[i].append(f())
    return [statistics.median(g) for g in got]


def idle_serve_cpu(binary, model, seconds=5.0):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    p = subprocess.Popen([binary, "serve", "-m", model, "--port", str(port)],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(8)  # load
        ticks = os.sysconf("SC_CLK_TCK")

        def cpu():
            f = open(f"/proc/{p.pid}/stat").read().rsplit(")", 1)[1].split()
            return (int(f[11]) + int(f[12])) / ticks

        c0, t0 = cpu(), time.time()
        time.sleep(seconds)
        return 100.0 * (cpu() - c0) / (time.time() - t0)
    finally:
        p.send_signal(signal.SIGTERM)
        p.wait()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dejavu", default=os.path.join(ROOT, "target", "release", "dejavu"))
    ap.add_argument("--baseline")
    ap.add_argument("--llama-bench")
    ap.add_argument("--models", default="smollm2-135m-instruct,qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json")
    a = ap.parse_args()
    cores = os.cpu_count() or 1
    out = {"cores": cores, "idle": [], "busy": [], "two": [], "serve_idle_cpu_percent": None}
    for name in a.models.split(","):
        gguf = fetch_models.fetch(name)
        if a.baseline:
            for test in ["tg", "pp"]:
                new, old = alternate(a.rounds, [
                    lambda: dejavu_tps(a.dejavu, gguf, cores, test),
                    lambda: dejavu_tps(a.baseline, gguf, cores, test)])
                out["idle"].append({"model": name, "test": test, "new": new, "baseline": old,
                                    "ratio": new / old})
        with Busy():
            fns = [lambda: dejavu_tps(a.dejavu, gguf, cores, "tg"),
                   lambda: dejavu_tps(a.dejavu, gguf, 1, "tg")]
            if a.llama_bench:
                fns += [lambda: llama_tps(a.llama_bench, gguf, cores),
                        lambda: llama_tps(a.llama_bench, gguf, 1)]
            r = alternate(a.rounds, fns)
        row = {"model": name, "dejavu_default": r[0], "dejavu_t1": r[1],
               "dejavu_ratio": r[0] / r[1]}
        if a.llama_bench:
            row.update({"llama_default": r[2], "llama_t1": r[3], "llama_ratio": r[2] / r[3]})
        out["busy"].append(row)
        solo = dejavu_tps(a.dejavu, gguf, cores, "tg")
        with tempfile.TemporaryDirectory() as d:
            procs = []
            for i in range(2):
                j = os.path.join(d, f"{i}.json")
                procs.append((j, subprocess.Popen(
                    [a.dejavu, "bench", "-m", gguf, "-t", str(cores), "-p", "0", "-n", "64", "-r",
                     "3", "--json", j], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)))
            pair = []
            for j, p in procs:
                p.wait()
                pair.append(json.load(open(j))[0]["tok_per_s_median"])
        out["two"].append({"model": name, "solo": solo, "each": pair,
                           "ratios": [x / solo for x in pair]})
    out["serve_idle_cpu_percent"] = idle_serve_cpu(a.dejavu, fetch_models.fetch(
        a.models.split(",")[0]))

    print(f"cores: {cores}")
    if out["idle"]:
        print("\n| model | test | this build tok/s | baseline tok/s | ratio |\n|---|---|---:|---:|---:|")
        for r in out["idle"]:
            print(f"| {r['model']} | {r['test']} | {r['new']:.1f} | {r['baseline']:.1f} | {r['ratio']:.3f} |")
    print("\n| model (one core busy) | dejavu -t default | dejavu -t 1 | ratio | llama.cpp -t default | llama.cpp -t 1 | ratio |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in out["busy"]:
        ll = (f"{r['llama_default']:.1f} | {r['llama_t1']:.1f} | {r['llama_ratio']:.2f}"
              if "llama_ratio" in r else "- | - | -")
        print(f"| {r['model']} | {r['dejavu_default']:.1f} | {r['dejavu_t1']:.1f} | {r['dejavu_ratio']:.2f} | {ll} |")
    print("\n| model (two processes) | solo tok/s | each tok/s | each / solo |\n|---|---:|---|---|")
    for r in out["two"]:
        print(f"| {r['model']} | {r['solo']:.1f} | {', '.join(f'{x:.1f}' for x in r['each'])} | "
              f"{', '.join(f'{x:.2f}' for x in r['ratios'])} |")
    print(f"\nidle `dejavu serve`: {out['serve_idle_cpu_percent']:.2f}% of a core")
    if a.json:
        eval_text.write_atomic(a.json, json.dumps(out, indent=1).encode())


if __name__ == "__main__":
    main()
