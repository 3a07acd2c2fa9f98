#!/usr/bin/env python3
"""Convert the Hugging Face fixtures with llama.cpp's own converter, convert_hf_to_gguf.py.

    python3 tools/llama_convert.py --llama-cpp DIR --out DIR [FIXTURE ...]

DIR is a llama.cpp source tree (convert_hf_to_gguf.py, conversion/, gguf-py/; e.g. the one in
llama-cpp-python's sdist: `pip download --no-deps --no-binary llama-cpp-python
llama-cpp-python==0.3.36`). The converter needs llama.cpp's Python requirements (torch,
transformers, numpy, safetensors): run this where they are installed (the device machine has
them). Writes OUT/<fixture>.gguf (`--outtype auto`: the checkpoint's own 16-bit type) and
OUT/convert.json (per fixture: ok, or the converter's error). tests/llama_converted.rs then
checks that the engine loads each file and that its logits match the engine's load of the
Hugging Face directory.

Two adjustments to the converter, both outside the weights and the model metadata, made in the
converter's process before it runs (the script's files are not modified):
- the fixtures' tokenizers are our own 8k-token BPEs, whose pre-tokenizer hash llama.cpp's table
  cannot know: `get_vocab_base_pre` answers `qwen2` for the Qwen-style split and `gpt2` for the
  byte-level one instead of refusing;
- Gemma 2 and Phi-3 read only SentencePiece vocabularies (`tokenizer.model`), which the fixtures
  do not have: without that file they write the BPE vocabulary as the other families do.
"""
import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures" / "hf"
# One fixture per family, and the variants whose conversion differs (ReLU MLPs, OPT's layouts,
# llama3 RoPE scaling, PyTorch shards; opt-relu is opt-noaffine's layout at 27 MB).
DEFAULT = ["llama-silu", "llama-relu", "llama3-rope", "mistral-swa", "qwen2", "qwen3", "gemma2",
           "gemma3", "phi3", "opt-noaffine", "opt-postln-proj", "opt-torch"]

RUNNER = r"""
import json, runpy, sys
from pathlib import Path
llama, model, out = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
sys.path.insert(0, str(llama / "gguf-py"))
sys.path.insert(0, str(llama))
import conversion.base as base

def pre(self):
    t = json.loads((Path(self.dir_model) / "tokenizer.json").read_text())
    return "qwen2" if "Sequence" in json.dumps(t.get("pre_tokenizer")) else "gpt2"

base.TextModel.get_vocab_base_pre = pre
import conversion.gemma as gemma, conversion.phi as phi

def bpe_unless_spm(original):
    def set_vocab(self):
        if (Path(self.dir_model) / "tokenizer.model").is_file():
            return original(self)
        self._set_vocab_gpt2()
    return set_vocab

gemma.Gemma2Model.set_vocab = bpe_unless_spm(gemma.Gemma2Model.set_vocab)
phi.Phi3MiniModel.set_vocab = bpe_unless_spm(phi.Phi3MiniModel.set_vocab)
sys.argv = ["convert_hf_to_gguf.py", model, "--outfile", out, "--outtype", "auto"]
runpy.run_path(str(llama / "convert_hf_to_gguf.py"), run_name="__main__")
"""


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--llama-cpp", required=True, type=Path)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("fixtures", nargs="*", default=DEFAULT)
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    report = {}
    for name in a.fixtures:
        out = a.out / f"{name}.gguf"
        p = subprocess.run([sys.executable, "-c", RUNNER, str(a.llama_cpp.resolve()),
                            str(FIXTURES / name), str(out)], capture_output=True, text=True)
        ok = p.returncode == 0 and out.is_file()
        report[name] = {"ok": ok, "log": (p.stdout + p.stderr)[-3000:]}
        print(f"{name}: {'ok' if ok else 'FAILED'}", flush=True)
        if not ok:
            print(report[name]["log"][-1500:], flush=True)
    (a.out / "convert.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
