#!/usr/bin/env python3
"""Checks `tandem tokenizer export` with Hugging Face `tokenizers` (and transformers'
AutoTokenizer when it is installed): the exported folder must give exactly Tandem's token ids.

  1. a tiny GGUF written here (llama-bpe pre-tokenizer, BOS added, control and user-defined
     tokens, a chat template): ids equal to `tandem tokenize` with and without --special/--bos;
  2. llama.cpp's vectors of every byte-level BPE vocabulary in ../shared/testdata/tokenizer/ and
     in scripts/setup's cache (deepseek-llm, mpt, command-r): ids equal to the .out files (which
     Tandem matches 46/46, test_tokenizer.c) and to `tandem tokenize`; the SPM one is refused;
  3. the default model (skipped, with the reason, when absent): the 110 SmolLM2 cases of
     tests/golden/smollm2_tokenizer.json (Hugging Face's ids, equal to Tandem's:
     test_tokenizer_smollm2.c), both with special tokens matched and not, and the config files.

Usage: tokenizer_export_check.py TANDEM SHARED_DIR SOURCE_DIR. Prints one line per check; exit 0
when all pass, 1 on a failure, 77 when `tokenizers` is missing.
"""
import json
import os
import struct
import subprocess
import sys
import tempfile

try:
    from tokenizers import Tokenizer
except ImportError:
    print("SKIP: the python package tokenizers is not installed (run scripts/setup)")
    sys.exit(77)

TANDEM, SHARED, SOURCE = sys.argv[1:4]
SEP = "\n__ggml_vocab_test__\n"
failures = []


def check(cond, what):
    print(("ok   " if cond else "FAIL ") + what)
    if not cond:
        failures.append(what)


def bytes_to_unicode():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def gguf_bytes(kvs):
    """A metadata-only GGUF v3 file: kvs is a list of (key, kind, value) with kind one of
    'u32', 'bool', 'str', 'strs', 'i32s'."""
    def s(x):
        b = x.encode("utf-8")
        return struct.pack("<Q", len(b)) + b
    out = b"GGUF" + struct.pack("<IQQ", 3, 0, len(kvs))
    for key, kind, v in kvs:
        out += s(key)
        if kind == "u32":
            out += struct.pack("<II", 4, v)
        elif kind == "bool":
            out += struct.pack("<IB", 7, 1 if v else 0)
        elif kind == "str":
            out += struct.pack("<I", 8) + s(v)
        elif kind == "strs":
            out += struct.pack("<IIQ", 9, 8, len(v)) + b"".join(s(x) for x in v)
        elif kind == "i32s":
            out += struct.pack("<IIQ", 9, 5, len(v)) + b"".join(struct.pack("<i", x) for x in v)
    return out


def tiny_gguf(path):
    b2u = bytes_to_unicode()
    tokens = [b2u[b] for b in range(256)]
    types = [1 for _ in tokens]
    merges = ["h e", "l l", "he ll", "hell o", "Ġ t", "Ġt he", "Ġ w", "o r", "Ġw or", "Ġwor l",
              "Ġworl d", "1 2", "12 3", "u s", "us e", "use r"]
    for m in merges:
        tokens.append(m.replace(" ", ""))
        types.append(1)
    tokens.append("Ġthe")  # a duplicate piece: the export must use the id Tandem looks up
    types.append(1)
    for t, ty in (("<s>", 3), ("</s>", 3), ("<|im_start|>", 3), ("<|im_end|>", 3), ("<think>", 4),
                  ("</think>", 4)):
        tokens.append(t)
        types.append(ty)
    bos = tokens.index("<s>")
    template = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    kvs = [("general.architecture", "str", "llama"), ("llama.context_length", "u32", 2048),
           ("tokenizer.ggml.model", "str", "gpt2"), ("tokenizer.ggml.pre", "str", "llama-bpe"),
           ("tokenizer.ggml.tokens", "strs", tokens), ("tokenizer.ggml.token_type", "i32s", types),
           ("tokenizer.ggml.merges", "strs", merges), ("tokenizer.ggml.bos_token_id", "u32", bos),
           ("tokenizer.ggml.eos_token_id", "u32", bos + 3),
           ("tokenizer.ggml.add_bos_token", "bool", True),
           ("tokenizer.chat_template", "str", template)]
    with open(path, "wb") as f:
        f.write(gguf_bytes(kvs))
    return template


def tandem_ids(model, text, special=False, bos=False):
    argv = [TANDEM, "tokenize", "-m", model, "-f", "-"] + (["--special"] if special else []) + \
        (["--bos"] if bos else [])
    r = subprocess.run(argv, input=text.encode("utf-8"), capture_output=True, check=True)
    return [int(x) for x in r.stdout.split()]


def export(model, out):
    r = subprocess.run([TANDEM, "tokenizer", "export", model, out], capture_output=True, text=True)
    check(r.returncode == 0, f"export {os.path.basename(model)} (status {r.returncode}: {r.stderr.strip()})")
    return r.returncode == 0


def hf_ids(tok, text, special, bos=False):
    tok.encode_special_tokens = not special
    return tok.encode(text, add_special_tokens=bos).ids


def check_tiny(tmp):
    model = os.path.join(tmp, "tiny.gguf")
    template = tiny_gguf(model)
    out = os.path.join(tmp, "tiny")
    if not export(model, out):
        return
    tok = Tokenizer.from_file(os.path.join(out, "tokenizer.json"))
    texts = ["hello the world", " the<|im_start|>user\nhello<|im_end|>", "<think>12345</think> x",
             "\n\n  the  hello\t123 1234567", "I'm \u4f60\u597d \U0001f600!", ""]
    n = 0
    for t in texts:
        for special in (False, True):
            for bos in (False, True):
                n += hf_ids(tok, t, special, bos) == tandem_ids(model, t, special, bos)
    check(n == 4 * len(texts), f"tiny vocabulary: {n}/{4 * len(texts)} encodings equal Tandem's")
    check(tok.decode(tandem_ids(model, "hello the world")) == "hello the world", "tiny: decode")
    cfg = json.load(open(os.path.join(out, "tokenizer_config.json"), encoding="utf-8"))
    check(cfg.get("chat_template") == template and cfg.get("bos_token") == "<s>" and
          cfg.get("eos_token") == "<|im_end|>" and cfg.get("model_max_length") == 2048 and
          cfg.get("add_bos_token") is True, "tiny: tokenizer_config.json fields")
    special = json.load(open(os.path.join(out, "special_tokens_map.json"), encoding="utf-8"))
    check(special == {"bos_token": "<s>", "eos_token": "<|im_end|>"}, f"tiny: special map {special}")
    added = {a["content"]: a["special"] for a in
             json.load(open(os.path.join(out, "tokenizer.json"), encoding="utf-8"))["added_tokens"]}
    check(added.get("<think>") is False and added.get("<|im_start|>") is True,
          "tiny: user-defined tokens are non-special added tokens")
    check_transformers(out, model, texts)


def check_transformers(out, model, texts):
    try:
        from transformers import AutoTokenizer
    except ImportError:
        print("skip transformers.AutoTokenizer: transformers is not installed")
        return
    tok = AutoTokenizer.from_pretrained(out)
    cfg = json.load(open(os.path.join(out, "tokenizer_config.json"), encoding="utf-8"))
    bos = cfg["add_bos_token"]  # `tandem tokenize --bos` adds BOS even where the model does not
    same = all(tok(t, add_special_tokens=True)["input_ids"] ==
               tandem_ids(model, t, special=True, bos=bos) for t in texts)
    check(same, f"transformers.AutoTokenizer on {os.path.basename(out)}")


def vector_dirs():
    cache = os.environ.get("TDM_VOCAB_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.environ.get("HOME", "/"), ".cache"),
        "tandem", "vocab")
    yield from ((os.path.join(SHARED, "testdata", "tokenizer"), n)
                for n in ("gpt-2", "starcoder", "deepseek-coder", "falcon"))
    yield from ((cache, n) for n in ("deepseek-llm", "mpt", "command-r"))


def check_vectors(tmp):
    for d, name in vector_dirs():
        model = os.path.join(d, f"ggml-vocab-{name}.gguf")
        if not os.path.exists(model + ".out"):
            print(f"skip {name}: no vectors in {d} (run scripts/setup)")
            continue
        out = os.path.join(tmp, name)
        if not export(model, out):
            continue
        tok = Tokenizer.from_file(os.path.join(out, "tokenizer.json"))
        texts = open(model + ".inp", encoding="utf-8").read().split(SEP)[:-1]
        want = [[int(x) for x in line.split()] for line in
                open(model + ".out", encoding="utf-8").read().split("\n")[:len(texts)]]
        n_ref = sum(hf_ids(tok, t, False) == w for t, w in zip(texts, want))
        # Tandem's own ids on every 5th text (it matches all 46: test_tokenizer.c; a process
        # per text makes all 46 slow for the 256k-token vocabulary)
        some = texts[::5]
        n_tdm = sum(hf_ids(tok, t, False) == tandem_ids(model, t) for t in some)
        check(n_ref == len(texts) and n_tdm == len(some) and len(texts) == 46,
              f"{name}: {n_ref}/{len(texts)} equal llama.cpp's vectors, {n_tdm}/{len(some)} "
              "equal Tandem's")
    spm = os.path.join(SHARED, "testdata", "tokenizer", "ggml-vocab-llama-spm.gguf")
    r = subprocess.run([TANDEM, "tokenizer", "export", spm, os.path.join(tmp, "spm")],
                       capture_output=True, text=True)
    check(r.returncode == 1 and "SentencePiece" in r.stderr, f"llama-spm refused: {r.stderr.strip()}")


def default_model():
    if os.environ.get("TANDEM_MODEL"):
        return os.environ["TANDEM_MODEL"]
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.environ.get("HOME", "/"), ".cache")
    return os.path.join(cache, "tandem", "models", "SmolLM2-135M-Instruct.Q4_1.gguf")


def check_default_model(tmp):
    model = default_model()
    if not os.path.exists(model):
        print(f"skip the default model: {model} is absent (run scripts/setup)")
        return
    out = os.path.join(tmp, "smollm2")
    if not export(model, out):
        return
    tok = Tokenizer.from_file(os.path.join(out, "tokenizer.json"))
    golden = json.load(open(os.path.join(SOURCE, "tests", "golden", "smollm2_tokenizer.json"),
                            encoding="utf-8"))
    cases = golden["cases"]
    n = sum(hf_ids(tok, c["text"], c["parse_special"]) == c["ids"] for c in cases)
    check(n == len(cases) and n >= 100, f"SmolLM2: {n}/{len(cases)} golden cases equal")
    chats = [c for c in golden["chat"] if c["source"] == "gguf"]
    n = sum(hf_ids(tok, c["text"], True) == c["ids"] for c in chats)
    check(n == len(chats), f"SmolLM2: {n}/{len(chats)} chat renderings' ids equal")
    cfg = json.load(open(os.path.join(out, "tokenizer_config.json"), encoding="utf-8"))
    check("<|im_start|>" in cfg.get("chat_template", "") and cfg.get("eos_token") == "<|im_end|>"
          and cfg.get("model_max_length") == 8192, "SmolLM2: tokenizer_config.json fields")
    check_transformers(out, model, [c["text"] for c in cases[:20]])


def main():
    with tempfile.TemporaryDirectory() as tmp:
        check_tiny(tmp)
        check_vectors(tmp)
        check_default_model(tmp)
    print(f"{len(failures)} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
