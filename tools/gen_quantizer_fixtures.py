#!/usr/bin/env python3
"""Generate tests/fixtures/quantizers.gguf: what ggml's own quantizers (llama-quantize's code,
`ggml_quantize_chunk`) write for fixed rows, with and without an importance matrix, so that
`dejavu quantize`'s ports can be checked against them (tests/quantizers.rs).

ggml is not on PyPI: build it from llama-cpp-python's sdist (`pip download --no-deps --no-binary
llama-cpp-python llama-cpp-python==0.3.36`, then in vendor/llama.cpp `cmake -B build && cmake
--build build --target ggml-base`) and pass the library:

  pip install gguf numpy && python3 tools/gen_quantizer_fixtures.py build/bin/libggml-base.so

Contents: `x` (ROWS x COLS f32 rows: Gaussian with per-row scales and a few outliers), `imatrix`
(COLS positive importances), and for each type T: `T` (ggml's bytes without an importance matrix)
and `T.imatrix` (with it).
"""
import ctypes
import os
import sys

import gguf
import numpy as np

ROWS, COLS = 6, 512
TYPES = {"Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q2_K": 10, "Q3_K": 11, "Q4_K": 12,
         "Q5_K": 13, "Q6_K": 14, "IQ4_NL": 20, "IQ4_XS": 23}

lib = ctypes.CDLL(sys.argv[1])
lib.ggml_quantize_chunk.restype = ctypes.c_size_t
lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                    ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
lib.ggml_row_size.restype = ctypes.c_size_t
lib.ggml_row_size.argtypes = [ctypes.c_int, ctypes.c_int64]

rng = np.random.default_rng(2026)
x = (rng.standard_normal((ROWS, COLS)) * rng.uniform(0.01, 0.2, size=(ROWS, 1))).astype(np.float32)
x[rng.integers(0, ROWS, 12), rng.integers(0, COLS, 12)] *= 8.0  # outliers
x[1, :64] = 0.0  # an all-zero super-block's worth
imatrix = np.exp(rng.standard_normal(COLS)).astype(np.float32)

out = os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "quantizers.gguf")
w = gguf.GGUFWriter(out, arch="fixture")
w.add_tensor("x", x)
w.add_tensor("imatrix", imatrix)
for name, t in TYPES.items():
    for suffix, im in [("", None), (".imatrix", imatrix)]:
        size = lib.ggml_row_size(t, COLS) * ROWS
        dst = np.zeros(size, dtype=np.uint8)
        n = lib.ggml_quantize_chunk(t, x.ctypes.data, dst.ctypes.data, 0, ROWS, COLS,
                                    None if im is None else im.ctypes.data)
        assert n == size, (name, n, size)
        w.add_tensor(f"{name}{suffix}", dst, raw_shape=(size,), raw_dtype=gguf.GGMLQuantizationType.I8)
w.write_header_to_file()
w.write_kv_data_to_file()
w.write_tensors_to_file()
w.close()
print(out, os.path.getsize(out), "bytes")
