#!/usr/bin/env bash
# The aarch64 build and its tests under qemu-user (called by .ci/run; runs here too).
#
# Installs (as root, with apt) Debian's cross linker, the arm64 C library and qemu-user, and the
# Rust target; then builds the CLI for aarch64-unknown-linux-gnu and runs, under qemu:
# - the CPU backend's kernel tests (every tier against the scalar reference) on qemu's default
#   CPU (NEON with the dot product: tiers scalar, portable, neon, dotprod) and on a Cortex-A72
#   (NEON without it: the dotprod tier is detected as absent and not run);
# - the kernel paths on the gguf-py fixtures and the quantized models on every tier
#   (tests/quant_fixtures.rs, tests/quantize.rs `quantized_files_run_on_every_tier`), and
#   SmolLM2 (Q4_1, repacked) against llama.cpp's logits on every tier (tests/model_reference.rs;
#   it needs `python3 tools/fetch_models.py all` first, as .ci/run does);
# - `dejavu generate` on a fixture model.
# qemu emulates the instructions: its timings are not hardware timings.
set -euo pipefail
cd "$(dirname "$0")/.."
T=aarch64-unknown-linux-gnu

if ! command -v aarch64-linux-gnu-gcc >/dev/null || ! command -v qemu-aarch64 >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get update -q
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
      gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user
  else
    echo "ci_aarch64: needs gcc-aarch64-linux-gnu, libc6-dev-arm64-cross and qemu-user" >&2
    exit 1
  fi
fi
rustup target add "$T"
export CC_aarch64_unknown_linux_gnu=aarch64-linux-gnu-gcc

cargo build --release --target "$T" --bin dejavu
cargo test --release --target "$T" -p dejavu-backend-cpu
QEMU_CPU=cortex-a72 cargo test --release --target "$T" -p dejavu-backend-cpu
cargo test --release --target "$T" -p dejavu --test quant_fixtures
cargo test --release --target "$T" -p dejavu --test quantize -- quantized_files_run_on_every_tier
cargo test --release --target "$T" -p dejavu --test model_reference -- smollm2_matches_reference
qemu-aarch64 -L /usr/aarch64-linux-gnu "target/$T/release/dejavu" generate \
  --model tests/fixtures/hf/opt-relu --prompt "The capital of France is" --max-tokens 8
