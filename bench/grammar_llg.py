#!/usr/bin/env python3
"""bench/grammar_llg.py - the peer of bench/bench_grammar.c: llguidance (PyPI, pinned in
scripts/setup) on the same MaskBench files, the same vocabulary and the same token ids, which
bench_grammar writes with --dump-vocab FILE (the GGUF's token bytes, its end-of-sequence and
special tokens, and every instance's tokens). For each schema: compile it
(LLMatcher.grammar_from_json_schema + LLMatcher, timed), then per instance feed the tokens
one by one, computing the mask before each (timed: unsafe_compute_mask_ptr into a buffer
allocated once), checking the token is allowed, and at the end that the end-of-sequence token
is allowed exactly when the instance is valid. Prints the same table as bench_grammar and
writes the same JSON (--json FILE), which bench_grammar --peer FILE turns into ratios.
One core: RAYON_NUM_THREADS=1 (run it under `taskset -c N` too on a shared machine).

usage: grammar_llg.py --vocab DUMP.json --dir MASKBENCH_DIR [--json FILE] [--verbose]
"""
import argparse
import ctypes
import json
import os
import re
import sys
import time

os.environ.setdefault("RAYON_NUM_THREADS", "1")
import llguidance  # noqa: E402


def hf_tokenizer(dump):
    """The model's own tokenizer, rebuilt with Hugging Face `tokenizers` from the GGUF's
    tokens and merges as tests/golden/make_tokenizer_golden.py does (SmolLM2's tokenizer.json:
    digits split, then GPT-2 byte-level BPE); None for other pre-tokenizers or without the
    package."""
    try:
        from tokenizers import Tokenizer, models, pre_tokenizers
    except ImportError:
        return None
    if dump.get("pre") != "smollm" or "merges" not in dump:
        return None
    pieces = [bytes.fromhex(h).decode("utf-8") for h in dump["pieces"]]
    merges = [tuple(bytes.fromhex(h).decode("utf-8").split(" ", 1)) for h in dump["merges"]]
    bpe = models.BPE(vocab={t: i for i, t in enumerate(pieces)}, merges=merges, fuse_unk=False,
                     byte_fallback=False)
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    return tok


class Vocab:
    """What llguidance's TokenizerWrapper needs, from the dumped GGUF vocabulary. llguidance
    lets through only the canonical tokenization of text the grammar forces, so the encoder
    must be the model's: the rebuilt tokenizer when possible, else greedy longest match (then
    forced text tokenized otherwise by the model shows up as validation errors)."""

    def __init__(self, dump):
        self.hf = hf_tokenizer(dump)
        if self.hf is None:
            print("grammar_llg: warning: no exact tokenizer for pre-tokenizer %r (pip install "
                  "tokenizers); using greedy longest match" % dump.get("pre"), file=sys.stderr)
        self.tokens = [bytes.fromhex(h) for h in dump["tokens"]]
        self.eos_token_id = dump["eos"]
        self.bos_token_id = None
        self.special_token_ids = list(dump["special"])
        self._by_bytes = {}
        for i, t in enumerate(self.tokens):
            if t and i not in set(self.special_token_ids):
                self._by_bytes.setdefault(t, i)
        self._longest = max(len(t) for t in self._by_bytes)

    def __call__(self, text):
        """Tokenizes forced text (llguidance calls it for nothing else)."""
        if isinstance(text, str):
            text = text.encode("utf-8")
        if self.hf is not None:
            return self.hf.encode(text.decode("utf-8", errors="replace"), add_special_tokens=False).ids
        out, i = [], 0
        while i < len(text):
            for n in range(min(self._longest, len(text) - i), 0, -1):
                t = self._by_bytes.get(text[i : i + n])
                if t is not None:
                    out.append(t)
                    i += n
                    break
            else:
                i += 1
        return out


def quantile(v, p):
    return v[int(p * (len(v) - 1) + 0.5)] if v else 0.0


def refusal_keyword(msg):
    m = re.search(r'[Uu]nimplemented keys?:?\s*\[?"?([A-Za-z$_-]+)', msg) or re.search(r'"([A-Za-z$_-]+)"', msg)
    return m.group(1) if m else msg.split(":")[0][:40]


def run(args):
    with open(args.vocab, encoding="utf-8") as f:
        dump = json.load(f)
    vocab = Vocab(dump)
    tok = llguidance.LLTokenizer(llguidance.TokenizerWrapper(vocab))
    n_vocab, eos = len(vocab.tokens), dump["eos"]
    n_words = (tok.vocab_size + 31) // 32
    mask = (ctypes.c_uint32 * n_words)()
    by_file = {}
    for inst in dump["instances"]:
        by_file.setdefault(inst["file"], []).append(inst)
    st = dict(files=0, compiled=0, refused=0, passing=0, instances=0, right=0,
              validation_errors=0, invalidation_errors=0, tokens=0)
    kw, compile_s, mask_s = {}, [], []

    def allowed(m, t):
        t0 = time.perf_counter()
        m.unsafe_compute_mask_ptr(ctypes.addressof(mask), 4 * n_words)
        mask_s.append(time.perf_counter() - t0)
        return t < 32 * n_words and (mask[t >> 5] >> (t & 31)) & 1

    for name in dump.get("files", sorted(by_file)):
        st["files"] += 1
        with open(os.path.join(args.dir, name), encoding="utf-8") as f:
            schema = json.load(f)["schema"]
        t0 = time.perf_counter()
        try:
            g = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema))
            m = llguidance.LLMatcher(tok, g, log_level=0)
            err = m.get_error() if m.is_error() else None
        except Exception as e:  # noqa: BLE001 - llguidance raises ValueError and others
            err = str(e)
        dt = time.perf_counter() - t0
        if err:
            st["refused"] += 1
            k = refusal_keyword(err)
            kw[k] = kw.get(k, 0) + 1
            continue
        compile_s.append(dt)
        st["compiled"] += 1
        all_right = True
        for inst in by_file.get(name, []):
            m.reset()
            ok = True
            for t in inst["ids"]:
                if not allowed(m, t) or not m.consume_token(t):
                    ok = False
                    break
                st["tokens"] += 1
            acc = ok and bool(allowed(m, eos))
            st["instances"] += 1
            if acc == inst["valid"]:
                st["right"] += 1
                continue
            all_right = False
            st["validation_errors" if inst["valid"] else "invalidation_errors"] += 1
            if args.verbose:
                print("llg: %s test %d: %s instance %s%s" % (
                    name, inst["test"], "valid" if inst["valid"] else "invalid",
                    "accepted" if acc else "rejected", (": " + m.get_error()[:300]) if m.is_error() else ""),
                    file=sys.stderr)
        st["passing"] += all_right
    compile_s.sort()
    mask_s.sort()
    return st, kw, compile_s, mask_s, n_vocab


def main():
    ap = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    ap.add_argument("--vocab", required=True)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--json")
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args()
    st, kw, compile_s, mask_s, n_vocab = run(args)
    pct = lambda a, b: 100.0 * a / b if b else 0.0  # noqa: E731
    kws = sorted(kw.items(), key=lambda x: (-x[1], x[0]))
    e = sys.stderr
    print("grammar bench (llguidance %s): %d MaskBench files of %s, 1 thread"
          % (llguidance.__version__ if hasattr(llguidance, "__version__") else "?", st["files"], args.dir), file=e)
    print("%-34s %8d (%.1f %%)" % ("schemas compiled", st["compiled"], pct(st["compiled"], st["files"])), file=e)
    print("%-34s %8d  (%s)" % ("schemas refused", st["refused"], ", ".join("%s %d" % x for x in kws[:12])), file=e)
    print("%-34s %8d (%.1f %% of all schemas)" % ("schemas passing", st["passing"], pct(st["passing"], st["files"])), file=e)
    print("%-34s %8d / %d" % ("instances judged right", st["right"], st["instances"]), file=e)
    print("%-34s %8d" % ("validation errors (valid rejected)", st["validation_errors"]), file=e)
    print("%-34s %8d" % ("invalidation errors (invalid acc.)", st["invalidation_errors"]), file=e)
    print("%-34s %8.2f / %.2f / %.2f / %.2f ms" % (
        "compile time p50/p90/p95/p99", quantile(compile_s, 0.5) * 1e3,
        quantile(compile_s, 0.9) * 1e3, quantile(compile_s, 0.95) * 1e3,
        quantile(compile_s, 0.99) * 1e3), file=e)
    print("%-34s %8.1f / %.1f / %.1f / %.1f / %.1f us  (%d masks)" % (
        "mask time p50/p75/p95/p99/max", quantile(mask_s, 0.5) * 1e6, quantile(mask_s, 0.75) * 1e6,
        quantile(mask_s, 0.95) * 1e6, quantile(mask_s, 0.99) * 1e6, quantile(mask_s, 1.0) * 1e6,
        len(mask_s)), file=e)
    mean_s = sum(mask_s) / len(mask_s) if mask_s else 0.0
    print("%-34s %8.2f us" % ("mask time mean", mean_s * 1e6), file=e)
    doc = dict(engine="llguidance", threads=1, n_vocab=n_vocab, refused_by_keyword=dict(kws),
               passing_pct=round(pct(st["passing"], st["files"]), 2),
               compile_s=dict(p50=quantile(compile_s, 0.5), p90=quantile(compile_s, 0.9),
                              p95=quantile(compile_s, 0.95), p99=quantile(compile_s, 0.99)),
               mask_s=dict(p50=quantile(mask_s, 0.5), p75=quantile(mask_s, 0.75),
                           p95=quantile(mask_s, 0.95), p99=quantile(mask_s, 0.99), max=quantile(mask_s, 1.0),
                           mean=mean_s, n=len(mask_s)),
               **st)
    text = json.dumps(doc, indent=1)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
