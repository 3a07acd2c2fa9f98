#!/usr/bin/env python3
"""Write the project's evaluation text: the same bytes on every machine that has built the project.

The text is assembled from files of crates that Cargo.lock pins (by version and SHA-256 checksum),
so any machine that has run `cargo build` or `cargo test` holds the very same bytes in its cargo
registry, and no copied text lives in the repository:

- rayon's FAQ.md (technical prose with Rust snippets),
- rayon's LICENSE-APACHE (the Apache License 2.0: legal prose),
- anyhow's src/context.rs (Rust source with doc comments).

It is never used for calibration (tools/calibration_text.py draws on other files). The reference
figures in tests/reference/*.json were measured by llama.cpp on exactly this text; its SHA-256 is
pinned below and checked, so a changed dependency is a clear error, not a silent new text (then
remake the references with tools/llama_reference.py).

Usage: eval_text.py [OUT]      (default: stdout). OUT is written through a unique temporary file
that is renamed into place.
"""
import argparse
import hashlib
import os
import re
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

# (crate, file inside the crate). The version comes from Cargo.lock.
PIECES = [
    ("rayon", "FAQ.md"),
    ("rayon", "LICENSE-APACHE"),
    ("anyhow", "src/context.rs"),
]
SHA256 = "879a91e5a09ed9e47a0f353b033aac58679ddb8a3671b3233cdb9ecdc71bcf06"


def locked_versions():
    """crate name -> version, for registry crates in Cargo.lock."""
    with open(os.path.join(ROOT, "Cargo.lock"), encoding="utf-8") as f:
        lock = f.read()
    out = {}
    for block in lock.split("[[package]]"):
        name = re.search(r'^name = "([^"]+)"', block, re.M)
        version = re.search(r'^version = "([^"]+)"', block, re.M)
        if name and version and "source = \"registry+" in block:
            out.setdefault(name.group(1), version.group(1))
    return out


def registry_dirs():
    home = os.environ.get("CARGO_HOME") or os.path.join(os.path.expanduser("~"), ".cargo")
    src = os.path.join(home, "registry", "src")
    if not os.path.isdir(src):
        return []
    return [os.path.join(src, d) for d in sorted(os.listdir(src))]


def find(crate, version, rel):
    for d in registry_dirs():
        path = os.path.join(d, f"{crate}-{version}", rel)
        if os.path.isfile(path):
            return path
    return None


def build():
    versions = locked_versions()
    parts = []
    for crate, rel in PIECES:
        if crate not in versions:
            raise SystemExit(f"error: crate `{crate}` is not in Cargo.lock")
        path = find(crate, versions[crate], rel)
        if path is None:
            # Not downloaded yet: let cargo fetch what the lock file pins, then look again.
            cargo = os.environ.get("CARGO", "cargo")
            subprocess.run([cargo, "fetch", "--locked"], cwd=ROOT, check=False,
                           stdout=subprocess.DEVNULL)
            path = find(crate, versions[crate], rel)
        if path is None:
            raise SystemExit(
                f"error: {crate}-{versions[crate]}/{rel} is not in the cargo registry "
                "(run `cargo fetch` in the checkout)")
        with open(path, "rb") as f:
            parts.append(f.read().replace(b"\r\n", b"\n").strip(b"\n"))
    return b"\n\n".join(parts) + b"\n"


def write_atomic(path, data):
    """`data` (bytes) to `path` through a unique temporary file in its directory, fsynced, then
    renamed over it: a reader sees the old file or the whole new one."""
    path = os.path.abspath(path)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".dejavu-", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def main():
    ap = argparse.ArgumentParser(description="Write the evaluation text (see this file's docstring).")
    ap.add_argument("out", nargs="?", help="output file (default: stdout), written atomically")
    args = ap.parse_args()
    text = build()
    digest = hashlib.sha256(text).hexdigest()
    if os.environ.get("EVAL_TEXT_PRINT_SHA"):
        print(digest)
        return
    if digest != SHA256:
        raise SystemExit(
            f"error: the evaluation text's SHA-256 is {digest}, not the pinned {SHA256}: a "
            "dependency's files changed (Cargo.lock). Remake the references with "
            "tools/llama_reference.py and pin the new digest here.")
    if args.out:
        write_atomic(args.out, text)
    else:
        sys.stdout.buffer.write(text)


if __name__ == "__main__":
    main()
