#!/usr/bin/env python3
"""Writes tests/golden/kquant_dequant.json: llama.cpp's own dequantization of Q2_K and Q3_K
blocks, the reference tests/unit/test_quant.c holds tdm_ggml_dequantize_row to bit for bit.

For each type the file holds 16 super-blocks: 8 of random bytes (every quant, scale and hmask
bit random; the f16 d and dmin finite, in [2^-10, 2^-3)) and 8 written by llama.cpp's
quantize_row_q2_K_ref / quantize_row_q3_K_ref from Gaussian rows (so real-looking scales and
mins are covered as well), and for each block the 256 f32 values of dequantize_row_q2_K /
dequantize_row_q3_K, as the little-endian bytes in hex (exact). The functions are called
through ctypes in the libggml-base.so that llama-cpp-python ships (the golden venv).

Usage: /root/.cache/tandem/golden-venv/bin/python tests/golden/make_kquant_golden.py
Pinned version: llama-cpp-python==0.3.36 (others print a warning).
"""

import ctypes
import json
import random
import struct
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
PINNED = "0.3.36"
TYPES = {"Q2_K": (84, (80, 82)), "Q3_K": (110, (108,))}  # bytes per block, f16 offsets
N_RANDOM, N_QUANT = 8, 8


def libggml():
    import llama_cpp

    if llama_cpp.__version__ != PINNED:
        print(f"warning: llama-cpp-python {llama_cpp.__version__}, pinned {PINNED}",
              file=sys.stderr)
    lib = ctypes.CDLL(str(Path(llama_cpp.__file__).parent / "lib" / "libggml-base.so"))
    for name in ("dequantize_row_q2_K", "dequantize_row_q3_K", "quantize_row_q2_K_ref",
                 "quantize_row_q3_K_ref"):
        getattr(lib, name).argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
        getattr(lib, name).restype = None
    return lib, llama_cpp.__version__


def random_block(rng, size, f16_offsets):
    b = bytearray(rng.getrandbits(8) for _ in range(size))
    for off in f16_offsets:
        b[off:off + 2] = np.float16(rng.uniform(2**-10, 2**-3)).tobytes()
    return bytes(b)


def main():
    lib, version = libggml()
    rng = random.Random(20261205)
    nprng = np.random.default_rng(20261205)
    out = {"source": f"llama.cpp dequantize_row_q2_K / q3_K (llama-cpp-python {version}, "
                     "libggml-base.so via ctypes)",
           "generator": "tests/golden/make_kquant_golden.py", "types": []}
    for name, (size, f16_offsets) in TYPES.items():
        quant = getattr(lib, f"quantize_row_{name.lower()[:2]}_K_ref")
        dequant = getattr(lib, f"dequantize_row_{name.lower()[:2]}_K")
        blocks = [random_block(rng, size, f16_offsets) for _ in range(N_RANDOM)]
        x = (nprng.standard_normal(256 * N_QUANT) * 0.02).astype(np.float32)
        q = ctypes.create_string_buffer(size * N_QUANT)
        quant(x.ctypes.data, q, 256 * N_QUANT)
        blocks += [q.raw[i * size:(i + 1) * size] for i in range(N_QUANT)]
        cases = []
        for blk in blocks:
            y = np.zeros(256, dtype=np.float32)
            src = ctypes.create_string_buffer(blk, size)
            dequant(src, y.ctypes.data, 256)
            cases.append({"block": blk.hex(), "values_f32le": y.tobytes().hex()})
        out["types"].append({"type": name, "block_bytes": size, "cases": cases})
    path = HERE / "kquant_dequant.json"
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {path}: {sum(len(t['cases']) for t in out['types'])} blocks")


if __name__ == "__main__":
    main()
