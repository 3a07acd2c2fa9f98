#!/usr/bin/env python3
"""Generate tests/fixtures/quants.gguf: expected dequantizations and dot products for every weight
type the engine supports, produced by an independent implementation (the `gguf` Python package,
ggml's own reference code), written by gguf's own GGUFWriter (so it also checks our GGUF reader).

Run once and commit the output:  pip install gguf numpy && python3 tools/gen_quant_fixtures.py
Contents, for each type T in F32 F16 BF16 Q8_0 Q4_0 Q4_1 Q5_0 Q5_1 Q4_K Q6_K Q2_K Q3_K Q5_K
IQ4_NL IQ4_XS:
  T.q    the raw tensor, ROWS x COLS elements of type T
  T.deq  F32 ROWS x COLS, gguf.quants.dequantize(T.q)
  T.dot  F32 ROWS, T.deq @ x computed in float64
  x      F32 COLS, the activation vector
plus metadata of every GGUF value type (checked by tests/gguf_reader.rs).
"""
import os
import numpy as np
import gguf
from gguf import GGMLQuantizationType as Q

ROWS, COLS = 3, 512
rng = np.random.default_rng(1234)
out = os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "quants.gguf")

w = gguf.GGUFWriter(out, arch="fixture")
w.add_uint8("fx.u8", 200)
w.add_int8("fx.i8", -100)
w.add_uint16("fx.u16", 60000)
w.add_int16("fx.i16", -30000)
w.add_uint32("fx.u32", 4000000000)
w.add_int32("fx.i32", -2000000000)
w.add_float32("fx.f32", 1.5)
w.add_bool("fx.bool", True)
w.add_string("fx.string", "héllo wörld")
w.add_array("fx.strings", ["a", "bc", ""])
w.add_array("fx.nested", [[1, 2], [3]])
w.add_uint64("fx.u64", 2**63 + 5)
w.add_int64("fx.i64", -(2**62))
w.add_float64("fx.f64", -2.25)

x = rng.standard_normal(COLS).astype(np.float32)
w.add_tensor("x", x)
dense = (rng.standard_normal((ROWS, COLS)) * 0.5).astype(np.float32)


# Byte offsets of each block's f16 scales (d, and dmin where the type has one).
SCALES = {Q.Q4_K: [0, 2], Q.Q5_K: [0, 2], Q.Q6_K: [208], Q.Q2_K: [80, 82], Q.Q3_K: [108],
          Q.IQ4_NL: [0], Q.IQ4_XS: [0]}


def random_blocks(qtype):
    """Random blocks with well-scaled f16 scales (every other byte random): gguf can dequantize
    these types but not quantize them."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    n_blocks = ROWS * COLS // block
    raw = rng.integers(0, 256, size=(n_blocks, size), dtype=np.uint8)
    for o in SCALES[qtype]:
        d = rng.uniform(0.001, 0.02, size=n_blocks).astype(np.float16).view(np.uint8).reshape(n_blocks, 2)
        raw[:, o:o + 2] = d
    return raw.reshape(ROWS, -1)


for name, qtype in [("F32", Q.F32), ("F16", Q.F16), ("BF16", Q.BF16), ("Q8_0", Q.Q8_0), ("Q4_0", Q.Q4_0),
                    ("Q4_1", Q.Q4_1), ("Q5_0", Q.Q5_0), ("Q5_1", Q.Q5_1), ("Q4_K", Q.Q4_K), ("Q6_K", Q.Q6_K),
                    ("Q2_K", Q.Q2_K), ("Q3_K", Q.Q3_K), ("Q5_K", Q.Q5_K), ("IQ4_NL", Q.IQ4_NL),
                    ("IQ4_XS", Q.IQ4_XS)]:
    if qtype in SCALES:
        raw = random_blocks(qtype)
    elif qtype == Q.F32:
        raw = dense.view(np.uint8)
    elif qtype == Q.F16:
        raw = dense.astype(np.float16).view(np.uint8)
    else:
        raw = gguf.quants.quantize(dense, qtype)
    deq = gguf.quants.dequantize(raw, qtype).reshape(ROWS, COLS).astype(np.float32)
    w.add_tensor(f"{name}.q", raw, raw_dtype=qtype)
    w.add_tensor(f"{name}.deq", deq)
    w.add_tensor(f"{name}.dot", (deq.astype(np.float64) @ x.astype(np.float64)).astype(np.float32))

w.write_header_to_file()
w.write_kv_data_to_file()
w.write_tensors_to_file()
w.close()
print(out, os.path.getsize(out), "bytes")
