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
  do not have: without that file they write the BPE vocabulary as the other families do;
- the Qwen fixtures name `Qwen2Tokenizer`, which transformers 5 extends with `<|endoftext|>` past
  the fixtures' 8192 ids (the converter then stops on its `max id < vocab_size` check): they are
  converted from a copy whose tokenizer_config.json names `PreTrainedTokenizerFast`, the same
  tokenizer.json without that addition (qwen3 then converts; qwen2 still stops on that check,
  measured on the device with transformers 5.17 and not investigated further).
OPT is left out: llama.cpp has no OPT architecture ("Model OPTForCausalLM is not supported").
"""
import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures" / "hf"
# Every fixture family but OPT, which llama.cpp does not support ("Model OPTForCausalLM is not
# supported"), and the llama variants (ReLU MLP, llama3 RoPE scaling).
DEFAULT = ["llama-silu", "llama-relu", "llama3-rope", "mistral-swa", "qwen2", "qwen3", "gemma2",
           "gemma3", "phi3"]

RUNNER = r"""
import json, runpy, sys
from pathlib import Path
llama, model, out = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
sys.path.insert(0, str(llama / "gguf-py"))
sys.path.insert(0, str(llama))
import conversion.base as base

def pre(self, tokenizer):
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
    tmp = tempfile.TemporaryDirectory()
    for name in a.fixtures:
        out, src = a.out / f"{name}.gguf", FIXTURES / name
        cfg = json.loads((src / "tokenizer_config.json").read_text())
        if cfg.get("tokenizer_class") == "Qwen2Tokenizer":
            src = Path(shutil.copytree(src, Path(tmp.name) / name))
            cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
            (src / "tokenizer_config.json").write_text(json.dumps(cfg))
        p = subprocess.run([sys.executable, "-c", RUNNER, str(a.llama_cpp.resolve()), str(src),
                            str(out)], capture_output=True, text=True)
        ok = p.returncode == 0 and out.is_file()
        report[name] = {"ok": ok, "log": (p.stdout + p.stderr)[-3000:]}
        print(f"{name}: {'ok' if ok else 'FAILED'}", flush=True)
        if not ok:
            print(report[name]["log"][-1500:], flush=True)
    (a.out / "convert.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
