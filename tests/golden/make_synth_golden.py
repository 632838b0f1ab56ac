#!/usr/bin/env python3
"""Writes tests/golden/<arch>_synth_<type>.json: llama.cpp's logits and greedy continuations on
small synthetic files of the architectures Tandem reads beyond the default model's plain Llama
block, with SmolLM2's vocabulary (the default model, so nothing else is downloaded):

* `qwen3-tiny` (general.architecture qwen3: QK-norm, NeoX RoPE, no q/k/v biases; 4 layers,
  n_embd 128, head_dim 64, 4 heads over 2 KV heads, theta 1e6) -> qwen3_synth_<type>.json;
* `llama3-tiny` (llama with Llama 3's rope_freqs.weight: RoPE frequency factors 8 / smooth / 1,
  theta 500000, head_dim 32) -> llama3_synth_<type>.json;
* `phi3-tiny` (general.architecture phi3: fused attn_qkv and gate/up ffn_up, NeoX RoPE with
  LongRoPE's rope_factors_long/short and attention factor, original context 1024 against the
  n_ctx 2048 used here, so llama.cpp takes the long factors (recorded in the JSON's
  "rope_factors"), a 64-token sliding window that llama.cpp ignores; 4 layers, n_embd 128,
  head_dim 32, 4 heads over 2 KV heads) -> phi3_synth_<type>.json;
* `qwen3moe-tiny` (qwen3moe: qwen3-tiny's attention, 8 experts of hidden size 128, 2 per token)
  -> qwen3moe_synth_<type>.json;
* `mixtral-tiny` (llama with experts as Mixtral: 8 experts of hidden size 256, 2 per token,
  head_dim 32, theta 1e6, an output matrix) -> mixtral_synth_<type>.json.

The procedure is make_engine_golden.py's (SmolLM2's prompts, tokenized without BOS as SmolLM2
is; greedy continuation to EOS or 64 tokens; one-pass top-5 per position; llama.cpp against
itself one token per pass as the yardstick that sets the bounds). The model files are not
committed: the JSON's "synth" object is the recipe that tests/golden/synth_model.cmake runs
(and checks the SHA-256 of) before test_golden compares Tandem with the file.

Usage: python3 tests/golden/make_synth_golden.py [--tandem BUILD/client/tandem]
       [--vocab SMOLLM2.gguf] [--shapes qwen3-tiny,llama3-tiny] [--types Q8_0]
Pinned version: llama-cpp-python==0.3.36 (others print a warning).
"""

import argparse
import hashlib
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import make_engine_golden as base  # noqa: E402

# shape -> the golden file's prefix and the seed of each projection type
SHAPES = {
    "qwen3-tiny": ("qwen3_synth", {"Q8_0": 1, "Q4_0": 2, "F16": 3}),
    "llama3-tiny": ("llama3_synth", {"Q8_0": 1, "Q4_0": 2, "F16": 3}),
    "phi3-tiny": ("phi3_synth", {"Q8_0": 1, "Q4_0": 2, "F16": 3}),
    "qwen3moe-tiny": ("qwen3moe_synth", {"Q8_0": 1, "Q4_0": 2, "F16": 3}),
    "mixtral-tiny": ("mixtral_synth", {"Q8_0": 1, "Q4_0": 2, "F16": 3}),
}
VOCAB_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
N_CTX = 2048

# the short prompts and one long one (the long essay, 470 tokens, takes RoPE's low-frequency
# pairs, which Llama 3's factors scale, well past a few radians)
CASES = [c for c in base.CASES if not c[0].startswith("long_")] + [
    c for c in base.CASES if c[0] == "long_essay"]


def synth_args(shape, typ, seed, vocab, out):
    return ["model", "synth", "--shape", shape, "--type", typ, "--seed", str(seed),
            "--vocab", str(vocab), "-o", str(out)]


def synth_golden(tandem, shape, typ, seed, vocab, vocab_sha, out_json, evaluate, generator,
                 reference):
    """Makes the synth file of (shape, typ, seed) with vocab's tokenizer in a temporary folder,
    runs evaluate(llm) -> (cases, selfcheck, extra keys) with llama.cpp on it and writes
    out_json with the extra keys and the "synth" recipe that tests/golden/synth_model.cmake
    makes the file again from. Shared with make_gemma3_synth_golden.py."""
    vocab = Path(vocab)
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / f"{out_json.stem}.gguf"
        subprocess.run([str(tandem)] + synth_args(shape, typ, seed, vocab, model), check=True)
        sha = hashlib.sha256(model.read_bytes()).hexdigest()
        llm = base.open_llama(model, N_CTX)
        cases, selfcheck, extra = evaluate(llm)
        orig = llm.metadata.get("phi3.rope.scaling.original_context_length")
        if orig is not None:
            # llama_model::get_rope_factors: rope_long when n_ctx_seq (= n_ctx, one sequence)
            # exceeds hparams.n_ctx_orig_yarn, else rope_short
            extra["rope_factors"] = {
                "n_ctx": N_CTX, "original_context_length": int(orig),
                "attn_factor": float(llm.metadata.get("phi3.rope.scaling.attn_factor", 1.0)),
                "chosen": "long" if N_CTX > int(orig) else "short"}
        extra["synth"] = {
            "shape": shape, "type": typ, "seed": seed,
            "vocab": vocab.name, "vocab_sha256": vocab_sha,
            "command": "tandem " + " ".join(synth_args(shape, typ, seed, "MODELS/" + vocab.name,
                                                       model.name)),
        }
        base.write_doc(out_json, model, sha, llm, generator, reference, llm.token_eos(),
                       selfcheck, cases, extra)
        del llm


REFERENCE = ("llama.cpp (llama-cpp-python) CPU, f16 KV, no flash attention, no extra buffer "
             f"types (AMX/repack), n_ctx {N_CTX}, n_threads 2; tokens add_bos=False "
             f"special=True; greedy (argmax) continuation of up to {base.MAX_NEW} tokens, EOS "
             "kept; logits of prompt+continuation in one pass")


def evaluate_smollm2_prompts(llm):
    """CASES as make_engine_golden.py runs SmolLM2's (no BOS, stop at EOS)."""
    eos = llm.token_eos()
    cases, selfcheck = [], base.SelfCheck()
    for name, text in CASES:
        prompt = llm.tokenize(text.encode("utf-8"), add_bos=False, special=True)
        cases.append(base.run_case(llm, name, text, prompt, eos, selfcheck, N_CTX))
    n_clear = sum(1 for c in cases for p in c["positions"] if p[0][1] - p[1][1] >= 0.25)
    return cases, selfcheck, {"clear_positions": n_clear}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tandem", default=str(HERE.parent.parent / "build/client/tandem"))
    ap.add_argument("--vocab", default=str(Path.home() / ".cache/tandem/models" / VOCAB_FILE))
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--types", default="Q8_0")
    ap.add_argument("-o", "--outdir", default=str(HERE))
    args = ap.parse_args()

    base.check_versions()
    vocab = Path(args.vocab)
    if not vocab.exists():
        sys.exit(f"{vocab}: not found (run scripts/setup)")
    vocab_sha = base.model_sha256(vocab, base.MODEL_SHA256)
    for shape in args.shapes.split(","):
        prefix, seeds = SHAPES[shape]
        for typ in args.types.split(","):
            synth_golden(args.tandem, shape, typ, seeds[typ], vocab, vocab_sha,
                         Path(args.outdir) / f"{prefix}_{typ.lower()}.json",
                         evaluate_smollm2_prompts, "tests/golden/make_synth_golden.py",
                         REFERENCE)


if __name__ == "__main__":
    main()
