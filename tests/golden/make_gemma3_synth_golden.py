#!/usr/bin/env python3
"""Writes tests/golden/gemma3_synth_<type>.json: llama.cpp's logits and greedy continuations on
small synthetic Gemma 3 files (`tandem model synth --shape gemma3-tiny`: 6 layers, n_embd 128,
layers 0-4 local with a 32-token sliding window, layer 5 global, Gemma 3 270M's vocabulary),
the references for tests/unit/test_golden.c's runs of the scalar kernel family (the 270M model
is too slow through it for CI).

The procedure is make_engine_golden.py's (greedy continuation, one-pass top-5 per position,
llama.cpp against itself one token per pass as the yardstick). The model file is not
committed (43 MB, nearly all of it the 262,144-row embedding): the JSON's "synth" object says
how to make it again (shape, type, seed, the vocabulary's source file and its SHA-256, and the
command), and tests/golden/synth_model.cmake, run by ctest before the comparison, does so with
the same `tandem model synth` and checks that the file's SHA-256 is the JSON's model_sha256.
synth's output depends only on its arguments and the vocabulary file (not on the thread count),
so a change to its weight generator shows up there, as a clear failure, before any logit does.

Every prompt is longer than the 32-token window once the 64-token continuation is added, and
the two of about 150 tokens run the local layers far past it.

Usage: python3 tests/golden/make_gemma3_synth_golden.py [--tandem BUILD/client/tandem]
       [--vocab GEMMA.gguf] [--types Q8_0,Q4_0]
The vocabulary defaults to ~/.cache/tandem/models/gemma-3-270m-q4_k_m.gguf (scripts/setup
--model gemma3-270m). Pinned version: llama-cpp-python==0.3.36 (others print a warning).
"""

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import make_engine_golden as base  # noqa: E402
import make_gemma3_engine_golden as gemma  # noqa: E402
import make_synth_golden as synth  # noqa: E402

SHAPE = "gemma3-tiny"
SEEDS = {"Q8_0": 1, "Q4_0": 2, "F16": 3}
VOCAB_FILE = "gemma-3-270m-q4_k_m.gguf"
VOCAB_SHA256 = gemma.MODEL_SHA256
N_CTX = 2048

# Five of make_gemma3_engine_golden.py's short prompts and two of about 150 tokens (the first
# paragraphs of its long essay and code): few, as llama.cpp's one-token-per-pass runs over a
# 262,144-token vocabulary are slow and every position qualifies anyway (see README.md).
CASES = [c for c in gemma.CASES if c[0] in (
    "plain_capital", "plain_story", "plain_code_fib", "chat_capital", "chat_chinese_german")] + [
    ("essay_paragraph", base.LONG_ESSAY.split("\n\n")[0] + "\n\n"),
    ("code_head", base.LONG_CODE[:base.LONG_CODE.index("class OutOfStock")]),
]


def evaluate(llm):
    cases, stops, selfcheck, n_clear = gemma.run_cases(llm, CASES)
    return cases, selfcheck, {"stop_tokens": sorted(stops), "clear_positions": n_clear}


def make_one(tandem, vocab, vocab_sha, typ, out_json):
    synth.synth_golden(tandem, SHAPE, typ, SEEDS[typ], vocab, vocab_sha, out_json, evaluate,
                       "tests/golden/make_gemma3_synth_golden.py", gemma.REFERENCE)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tandem", default=str(HERE.parent.parent / "build/client/tandem"))
    ap.add_argument("--vocab", default=str(Path.home() / ".cache/tandem/models" / VOCAB_FILE))
    ap.add_argument("--types", default=",".join(SEEDS))
    ap.add_argument("-o", "--outdir", default=str(HERE))
    args = ap.parse_args()

    base.check_versions()
    vocab = Path(args.vocab)
    if not vocab.exists():
        sys.exit(f"{vocab}: not found (run scripts/setup --model gemma3-270m)")
    vocab_sha = base.model_sha256(vocab, VOCAB_SHA256)
    for typ in args.types.split(","):
        make_one(args.tandem, vocab, vocab_sha, typ,
                 Path(args.outdir) / f"gemma3_synth_{typ.lower()}.json")


if __name__ == "__main__":
    main()
