#!/usr/bin/env python3
"""Serving throughput side by side: `dejavu serve` and, optionally, llama.cpp's `llama-server`.

Each round starts each server in turn (alternating, so slow phases of a shared machine hit
both alike) with `--parallel N` sequences at the given threads, warms it, then measures:
  - one client alone: --bursts greedy completions of --tokens tokens (ignore_eos) one after
    another, tok/s;
  - --bursts times N concurrent clients doing the same, each burst after the last has ended:
    aggregate tok/s (completion tokens / wall time);
  - time to first token of a long prompt (--long-prompt tokens, streamed, each one new) sent
    while N - 1 clients generate without a break, several times a round (p50 / p99 over every
    round).
It prints one line per round and server, then a table of medians and the ratios that the
serving targets name (N clients / one client; dejavu / llama-server).

llama.cpp is not part of this repository: build llama-server in a scratch folder (for example
from the source distribution of the `llama-cpp-python` package: `pip download llama-cpp-python
--no-deps --no-binary :all:`, unpack, `cmake -B build vendor/llama.cpp -DGGML_NATIVE=ON
-DLLAMA_CURL=OFF && cmake --build build --target llama-server`) and pass its path.

    python3 tools/serve_bench.py --model PATH.gguf --llama-server /scratch/llama-server --rounds 3

`--compare OLD` runs another dejavu binary in the same rounds (a change's A/B).
"""
import argparse
import json
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = [
    "The old harbour town woke up slowly, and",
    "My favourite recipe starts with",
    "In 1905, the young physicist",
    "The train left the station at",
    "def fibonacci(n):",
    "Dear customer, we are writing to",
    "The three main causes of the war were",
    "Step 1: open the box. Step 2:",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(base: str, body: dict, stream: bool = False):
    req = urllib.request.Request(base + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    return urllib.request.urlopen(req, timeout=600)


def complete(base: str, prompt: str, tokens: int) -> int:
    body = {"prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True}
    with post(base, body) as r:
        return json.load(r)["usage"]["completion_tokens"]


def first_token(base: str, prompt: str) -> float:
    """Seconds from sending a streamed request to its first token's chunk."""
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0, "stream": True}
    t0 = time.perf_counter()
    with post(base, body) as r:
        for line in r:
            line = line.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if chunk["choices"] and chunk["choices"][0].get("text"):
                    dt = time.perf_counter() - t0
                    for _ in r:
                        pass
                    return dt
    return time.perf_counter() - t0


class Server:
    def __init__(self, cmd: list, port: int):
        self.base = f"http://127.0.0.1:{port}"
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        t0 = time.time()
        while time.time() - t0 < 300:
            if self.proc.poll() is not None:
                sys.exit(f"{cmd[0]} exited: {self.proc.stderr.read().decode()[-2000:]}")
            try:
                with urllib.request.urlopen(self.base + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except Exception:
                time.sleep(0.3)
        sys.exit(f"{cmd[0]} did not come up")

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def measure(base: str, n: int, tokens: int, long_prompt: str, ttft_samples: int,
            bursts: int) -> dict:
    for p in PROMPTS[:2]:
        complete(base, p, 8)
    t0 = time.perf_counter()
    one = sum(complete(base, PROMPTS[k % len(PROMPTS)], tokens) for k in range(bursts))
    one_tps = one / (time.perf_counter() - t0)
    done = []
    lock = threading.Lock()

    def client(i: int):
        got = complete(base, PROMPTS[i % len(PROMPTS)], tokens)
        with lock:
            done.append(got)

    ttft = []
    stop = threading.Event()

    def loop_client(i: int):
        while not stop.is_set():
            complete(base, PROMPTS[i % len(PROMPTS)], tokens)

    t0 = time.perf_counter()
    for _ in range(bursts):
        threads = [threading.Thread(target=client, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    agg = sum(done) / (time.perf_counter() - t0)
    # TTFT mid-load: n - 1 clients generating without a break, and the long prompts (each
    # different from the start, so no server reuses a cached prefix) take the free sequence.
    threads = [threading.Thread(target=loop_client, args=(i,)) for i in range(n - 1)]
    for t in threads:
        t.start()
    for k in range(ttft_samples):
        time.sleep(0.5)
        ttft.append(first_token(base, f"Note {k} of {time.time()}. " + long_prompt))
    stop.set()
    for t in threads:
        t.join()
    return {"one": one_tps, "agg": agg, "ttft": ttft}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="GGUF file")
    ap.add_argument("--dejavu", default=str(ROOT / "target" / "release" / "dejavu"))
    ap.add_argument("--llama-server", help="path to a llama-server binary (optional)")
    ap.add_argument("--compare", help="another dejavu binary (a build before a change), run "
                    "in turn with --dejavu as `dejavu-compare`")
    ap.add_argument("--parallel", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--ctx", type=int, default=2048, help="context of each sequence")
    ap.add_argument("--long-prompt", type=int, default=512, help="tokens (about) of the TTFT prompt")
    ap.add_argument("--ttft-samples", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--bursts", type=int, default=3,
                    help="requests of one client, and bursts of N clients, a round")
    a = ap.parse_args()
    # About one token per word in these models' vocabularies; the server reports the count.
    long_prompt = " ".join(["The quick brown fox jumps over the lazy dog."] * (a.long_prompt // 10))
    def dejavu(binary):
        return lambda port: [binary, "serve", "-m", a.model, "--port", str(port), "--parallel",
                             str(a.parallel), "-t", str(a.threads), "--ctx", str(a.ctx),
                             "--no-prefix-reuse"]
    servers = {"dejavu": dejavu(a.dejavu)}
    if a.compare:
        servers["dejavu-compare"] = dejavu(a.compare)
    if a.llama_server:
        servers["llama-server"] = lambda port: [
            a.llama_server, "-m", a.model, "--port", str(port), "--parallel", str(a.parallel),
            "-cb", "-t", str(a.threads), "-c", str(a.ctx * a.parallel), "--no-warmup",
            "--cache-reuse", "0"]
    res: dict = {name: [] for name in servers}
    for r in range(a.rounds):
        for name, cmd in servers.items():
            port = free_port()
            s = Server(cmd(port), port)
            try:
                m = measure(s.base, a.parallel, a.tokens, long_prompt, a.ttft_samples, a.bursts)
            finally:
                s.stop()
            res[name].append(m)
            print(f"round {r + 1} {name}: one client {m['one']:.1f} tok/s, {a.parallel} clients "
                  f"{m['agg']:.1f} tok/s ({m['agg'] / m['one']:.2f}x), TTFT "
                  f"{' '.join(f'{t:.2f}' for t in m['ttft'])} s", file=sys.stderr)
    print(f"| server | one client tok/s | {a.parallel} clients tok/s | ratio | "
          f"TTFT p50 / p99 s ({a.long_prompt}-token prompt mid-load) |")
    print("|---|---:|---:|---:|---|")
    for name, ms in res.items():
        one = statistics.median(m["one"] for m in ms)
        agg = statistics.median(m["agg"] for m in ms)
        ttft = sorted(t for m in ms for t in m["ttft"])
        p99 = ttft[min(len(ttft) - 1, round(0.99 * (len(ttft) - 1)))]
        print(f"| {name} | {one:.1f} | {agg:.1f} | {agg / one:.2f}x | "
              f"{statistics.median(ttft):.2f} / {p99:.2f} |")
    for other in [n for n in res if n != "dejavu"]:
        ratios = [d["agg"] / o["agg"] for d, o in zip(res["dejavu"], res[other])]
        print(f"\ndejavu / {other} aggregate, per round: "
              f"{' '.join(f'{x:.2f}' for x in ratios)} (median {statistics.median(ratios):.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
