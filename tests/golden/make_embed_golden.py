#!/usr/bin/env python3
"""Writes tests/golden/embed_golden.json: llama.cpp's pooled, L2-normalised embeddings of a few
prompts on the default model (SmolLM2-135M-Instruct Q4_1) and on Gemma 3 270M (Q4_K_M), the
reference for tests/unit/test_embed.c (and the cosine check of tests/integration/
test_embeddings.py).

What llama.cpp calls an embedding of a decoder model: the final hidden state after the output
norm (before the LM head), pooled over the prompt's positions, `last` (the last position's
vector; what vLLM does for decoder models) or `mean` (the average over every position), then
L2-normalised (llama-embedding's default --embd-normalize 2). Each prompt is tokenized by
llama.cpp (the model's own BOS rule, no special-token parsing) and evaluated alone in one pass
(n_batch = n_ubatch = n_ctx); the token ids are recorded so the test feeds Tandem the same ids.

llama.cpp is used through llama-cpp-python on the CPU as in make_engine_golden.py (flash
attention off, ggml's extra weight buffer types off, two threads). Pinned version:
llama-cpp-python==0.3.36. As a yardstick, each case is computed again with flash attention on
(another attention kernel of llama.cpp's, with its own rounding): `llama_cpp_self_cosine` is the
cosine between the two, and a model's `llama_cpp_self_min` the lowest (SmolLM2: 0.9995;
Gemma 3, whose hidden states carry a few very large channels: 0.9970), from which
tests/unit/test_embed.c sets its bound.

Usage: python3 tests/golden/make_embed_golden.py [-o OUT.json]
Models from $TANDEM_MODEL_DIR or ~/.cache/tandem/models.
"""

import argparse
import json
import os
from importlib import metadata
from pathlib import Path

PINNED = "0.3.36"
N_CTX = 1024
HERE = Path(__file__).resolve().parent

MODELS = [
    ("smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
    ("gemma3", "gemma-3-270m-q4_k_m.gguf"),
]

TEXTS = [
    ("short", "Hello world"),
    ("sentence", "The quick brown fox jumps over the lazy dog."),
    ("question", "What is the capital of France, and why is it famous?"),
    ("para", "Retrieval-augmented generation embeds every document chunk once, stores the vectors "
             "in an index, and at query time embeds the question and returns the chunks whose "
             "vectors have the highest cosine similarity. The language model then answers from "
             "those chunks. " * 3),
    ("french", "Le chat dort sur le canapé pendant que la pluie tombe."),
]

POOLINGS = [("last", 3), ("mean", 1)]  # llama_cpp.LLAMA_POOLING_TYPE_LAST / _MEAN


def open_llama(path, pooling_type, flash_attn=False):
    import llama_cpp
    import llama_cpp.llama_cpp as llama_c

    default_params = llama_c.llama_model_default_params

    def model_params():
        p = default_params()
        p.use_extra_bufts = False
        return p

    llama_c.llama_model_default_params = model_params
    try:
        return llama_cpp.Llama(model_path=str(path), n_ctx=N_CTX, n_batch=N_CTX, n_ubatch=N_CTX,
                               embedding=True, pooling_type=pooling_type, n_threads=2,
                               flash_attn=flash_attn,
                               n_threads_batch=2, seed=0, verbose=False)
    finally:
        llama_c.llama_model_default_params = default_params


def embed_tokens(llm, tokens):
    """Pooled embedding of one sequence (normalised by the caller)."""
    import llama_cpp

    llm._ctx.kv_cache_clear()
    llm._batch.reset()
    llm._batch.add_sequence(tokens, 0, False)
    llm._ctx.decode(llm._batch)
    ptr = llama_cpp.llama_get_embeddings_seq(llm._ctx.ctx, 0)
    return [float(v) for v in ptr[:llm.n_embd()]]


def cosine(a, b):
    import math

    return sum(x * y for x, y in zip(a, b)) / math.sqrt(sum(x * x for x in a) *
                                                         sum(y * y for y in b))


def l2(v):
    import math

    n = math.sqrt(sum(x * x for x in v))
    return [x / n for x in v] if n > 0 else v


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("-o", "--out", default=str(HERE / "embed_golden.json"))
    args = ap.parse_args()
    version = metadata.version("llama_cpp_python")
    if version != PINNED:
        print(f"warning: llama-cpp-python {version}, the golden file pins {PINNED}")
    model_dir = Path(os.environ.get("TANDEM_MODEL_DIR",
                                    Path.home() / ".cache/tandem/models"))
    doc = {"generator": "tests/golden/make_embed_golden.py",
           "llama_cpp_python": version, "normalize": "l2", "models": []}
    for name, file in MODELS:
        entry = {"name": name, "file": file, "cases": []}
        tokens_of = {}
        for pool_name, pool_type in POOLINGS:
            llm = open_llama(model_dir / file, pool_type)
            fa = open_llama(model_dir / file, pool_type, flash_attn=True)
            for case, text in TEXTS:
                if case not in tokens_of:
                    tokens_of[case] = llm.tokenize(text.encode("utf-8"), add_bos=True,
                                                   special=False)
                vec = l2(embed_tokens(llm, tokens_of[case]))
                self_cos = cosine(vec, l2(embed_tokens(fa, tokens_of[case])))
                entry["cases"].append({"name": case, "pooling": pool_name, "text": text,
                                       "tokens": tokens_of[case],
                                       "llama_cpp_self_cosine": round(self_cos, 6),
                                       "embedding": [round(x, 7) for x in vec]})
            del llm, fa
        entry["llama_cpp_self_min"] = min(c["llama_cpp_self_cosine"] for c in entry["cases"])
        doc["models"].append(entry)
    Path(args.out).write_text(json.dumps(doc, ensure_ascii=True) + "\n", encoding="ascii")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
