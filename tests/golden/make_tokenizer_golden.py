#!/usr/bin/env python3
"""Writes tests/golden/smollm2_tokenizer.json: SmolLM2's token ids and chat-template renderings
made by reference implementations independent of Tandem's C code.

Token ids come from Hugging Face `tokenizers`, configured exactly as SmolLM2's own
tokenizer.json (HuggingFaceTB/SmolLM2-135M-Instruct): a BPE model over the GGUF's
tokenizer.ggml.tokens / tokenizer.ggml.merges, no normalizer, the pre-tokenizer
Sequence[Digits(individual_digits=True), ByteLevel(add_prefix_space=False, use_regex=True)],
and the GGUF's control tokens (token_type 3) as special added tokens. Each text is encoded
without adding BOS/EOS, once with special tokens matched in the text (parse_special = true) and
once with them tokenized as plain text (`encode_special_tokens = True`, parse_special = false).

Why not `AutoTokenizer.from_pretrained(dir, gguf_file=...)`: in transformers 5.24 the GGUF
loader imports torch (transformers/integrations/gguf/reader.py), and its converter does not know
the `smollm` pre-tokenizer: it falls back to the plain GPT-2 ByteLevel split, without SmolLM2's
digit splitting, so "12345" would come out wrong. Building the tokenizer from the same GGUF
arrays with the right pre-tokenizer is what the HF hub's tokenizer.json holds. As a check of
that construction, the script first reproduces llama.cpp's published vectors for the StarCoder
vocabulary (same pre-tokenizer: digits, then the GPT-2 regex) from
$TDM_SHARED_DIR/testdata/tokenizer/ggml-vocab-starcoder.gguf{,.inp,.out} when present.

Chat renderings come from transformers' render_jinja_template (the sandboxed Jinja environment
that apply_chat_template uses: trim_blocks, lstrip_blocks) on:
  - the GGUF's own tokenizer.chat_template (ChatML; these also get token ids, parse_special),
  - Meta-Llama-3-8B-Instruct's template (bos_token "<|begin_of_text|>"),
  - Llama-2-7b-chat-hf's template (bos_token "<s>", eos_token "</s>"),
the last two copied below from the models' tokenizer_config.json.

Pinned versions (what smollm2_tokenizer.json was made with; others print a warning):
    tokenizers==0.23.3  transformers==5.24.0  Jinja2==3.1.6  gguf==0.19.0  numpy==2.4.6
    (pip install --no-deps 'tokenizers==0.23.3' 'transformers==5.24.0' 'Jinja2==3.1.6'
     'gguf==0.19.0'; no torch needed)

Usage: python3 tests/golden/make_tokenizer_golden.py [MODEL.gguf] [-o OUT.json]
MODEL defaults to $TANDEM_MODEL or ~/.cache/tandem/models/SmolLM2-135M-Instruct.Q4_1.gguf.
"""

import argparse
import hashlib
import json
import os
import sys
from importlib import metadata
from pathlib import Path

PINNED = {
    "tokenizers": "0.23.3",
    "transformers": "5.24.0",
    "Jinja2": "3.1.6",
    "gguf": "0.19.0",
    "numpy": "2.4.6",
}

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent

# Meta-Llama-3-8B-Instruct, tokenizer_config.json "chat_template".
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{% endif %}"
)

# Llama-2-7b-chat-hf, tokenizer_config.json "chat_template".
LLAMA2_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}{% else %}"
    "{% set loop_messages = messages %}{% set system_message = false %}{% endif %}"
    "{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}"
    "{% endif %}{% endfor %}"
)

TEXTS = [
    "",
    "Hello world",
    " Hello world",
    "Hello, World! How are you today?",
    "I'm sure they'll say it's fine, don't you think? We've seen it. I'd go.",
    "CAN'T WON'T SHE'S I'M YOU'RE",
    "1234567890",
    "12345678901234567890123456789012345678901234567890",
    "3.14159 and 1,000,000 and -42 and 0x1F and 1e-5",
    "Version 2.0.1-rc3, 100km/h, 50%, $9.99, \u20ac5, 3:45pm",
    "\u0660\u0661\u0662\u0663 \u096a\u096b\u096c \u216b \u00bd x\u00b2",
    "  multiple   internal    spaces  ",
    "   ",
    "          indented",
    "end with spaces   ",
    "\t\ttabs\tand\nnewlines\r\nmixed\n\n\n",
    "\n",
    "\n\n \n\t\n",
    "\r\n\r\n",
    'int main(void) {\n    printf("%d\\n", 42);\n    return 0;\n}\n',
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    'fn main() {\n    let v: Vec<u32> = (0..10).map(|x| x * x).collect();\n    println!("{:?}", v);\n}',
    "const f = async (x) => { await fetch(`/api/${x}`); return x ?? null; };",
    "SELECT id, name FROM users WHERE age >= 18 ORDER BY name DESC;",
    '<div class="main"><p>Hello &amp; welcome</p></div>',
    '{"key": [1, 2.5, true, null], "nested": {"a": "b"}}',
    "# Title\n\n- item 1\n- item 2\n\n```python\nprint('x')\n```\n",
    "I \u2764\ufe0f emoji \U0001f600\U0001f44d\U0001f3fd\U0001f389",
    "\U0001f468\u200d\U0001f469\u200d\U0001f467\u200d\U0001f466 family, "
    "\U0001f3f3\ufe0f\u200d\U0001f308 flag, \U0001f469\U0001f3fd\u200d\U0001f4bb coder",
    "\U0001f1fa\U0001f1f8\U0001f1ef\U0001f1f5\U0001f1e9\U0001f1ea",
    "\u4f60\u597d\uff0c\u4e16\u754c\uff01\u8fd9\u662f\u4e00\u4e2a\u6d4b\u8bd5\u3002",
    "\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8\u3068\u30ab\u30bf\u30ab\u30ca\u3001"
    "\u3072\u3089\u304c\u306a\u3002",
    "\ud55c\uad6d\uc5b4 \ud14d\uc2a4\ud2b8\uc785\ub2c8\ub2e4",
    "\u0645\u0631\u062d\u0628\u0627 \u0628\u0627\u0644\u0639\u0627\u0644\u0645\u060c "
    "\u0643\u064a\u0641 \u062d\u0627\u0644\u0643\u061f",
    "\u05e9\u05dc\u05d5\u05dd \u05e2\u05d5\u05dc\u05dd",
    "\u041f\u0440\u0438\u0432\u0435\u0442, \u043c\u0438\u0440! \u0420\u043e\u0441\u0441\u0438"
    "\u044f \u0438 \u0423\u043a\u0440\u0430\u0457\u043d\u0430",
    "\u0928\u092e\u0938\u094d\u0924\u0947 \u0926\u0941\u0928\u093f\u092f\u093e",
    "\u0e20\u0e32\u0e29\u0e32\u0e44\u0e17\u0e22 \u1781\u17d2\u1798\u17c2\u179a",
    "Caf\u00e9 na\u00efve r\u00e9sum\u00e9 fa\u00e7ade \u00c5ngstr\u00f6m jalape\u00f1o",
    "e\u0301 combining acute, n\u0303 tilde",
    "\u2200x \u2208 \u211d: x\u00b2 \u2265 0, \u2211\u1d62 a\u1d62 = \u03c0 \u2248 3.14",
    "a\u00a0b\u200bc\u2009d\u3000e",
    "\u00ff\u0100 byte-level edges \u0080\u00ad",
    "https://example.com/path/to/page?query=1&lang=en#section-2",
    "contact: john.doe+test@example.org",
    "Hello\u4e16\u754c123abc!@#",
    "!!! ??? ... --- (((parens))) [[[ ]]] {{{ }}} ***",
    "pneumonoultramicroscopicsilicovolcanoconiosis"
    + "supercalifragilisticexpialidocious" * 3,
    "a" * 300,
    "<|im_start|>user\nHi<|im_end|>",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
    "<|im_start|>assistant\n",
    "<|endoftext|><|endoftext|>text<|im_end|> after",
    "<|im_start user <|im_end| <|endoftext <im_start>",
    "<file_sep>main.py<gh_stars>100<jupyter_code>print(1)",
    " <|im_start|> spaced <|im_end|> ",
]

CHATS = [
    # (template, messages, add_generation_prompt)
    ("chatml", [("user", "Hi")], True),
    ("chatml", [("user", "Hi")], False),
    ("chatml", [("system", "You are a pirate."), ("user", "Hello!")], True),
    ("chatml", [("user", "What is 2+2?"), ("assistant", "4"), ("user", "And 3+3?")], True),
    ("chatml", [("system", "  spaced  "), ("user", "  keep whitespace \n")], True),
    ("chatml", [("user", "\u4f60\u597d \U0001f44b\U0001f3fd, 12345")], True),
    ("chatml", [], True),
    ("llama3", [("system", "You are helpful."), ("user", "  Hi there \n")], True),
    ("llama3", [("user", "Hello")], True),
    ("llama3", [("user", "Q1"), ("assistant", " A1 "), ("user", "Q2")], False),
    ("llama3", [("user", "\u3000 text \u00a0\n")], True),
    ("llama2", [("system", "Be brief."), ("user", "Hi")], True),
    ("llama2", [("user", " Hello ")], False),
    ("llama2", [("user", "Q1"), ("assistant", "A1"), ("user", "Q2 ")], True),
    ("llama2", [("system", "S"), ("user", "")], False),
    ("llama2", [("system", "  padded system  "), ("user", "q")], False),
]


def check_versions():
    for name, want in PINNED.items():
        try:
            have = metadata.version(name)
        except metadata.PackageNotFoundError:
            have = None
        if have != want:
            print(f"warning: {name} {have} installed, the golden file was made with {want}",
                  file=sys.stderr)


def read_vocab(path):
    """(tokens, merges, token_types, chat_template) from a GGUF's tokenizer metadata."""
    from gguf import GGUFReader

    r = GGUFReader(str(path))
    f = r.fields
    tokens = f["tokenizer.ggml.tokens"].contents()
    merges = f["tokenizer.ggml.merges"].contents()
    types = f["tokenizer.ggml.token_type"].contents()
    tpl = f["tokenizer.chat_template"].contents() if "tokenizer.chat_template" in f else None
    return tokens, merges, types, tpl


def build_tokenizer(tokens, merges, types):
    """SmolLM2's tokenizer.json, rebuilt from the GGUF arrays."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate(tokens)}
    bpe = models.BPE(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges],
                     fuse_unk=False, byte_fallback=False)
    tok = Tokenizer(bpe)
    tok.normalizer = None
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    special = [AddedToken(t, special=True, normalized=False)
               for t, ty in zip(tokens, types) if ty == 3]
    tok.add_special_tokens(special)
    for t in special:
        assert tok.token_to_id(t.content) == vocab[t.content]
    return tok


def encode(tok, text, parse_special):
    tok.encode_special_tokens = not parse_special
    return tok.encode(text, add_special_tokens=False).ids


def self_check_starcoder():
    """Reproduces llama.cpp's StarCoder vectors with the same construction (same pre-tokenizer)."""
    shared = Path(os.environ.get("TDM_SHARED_DIR", REPO.parent / "shared"))
    base = shared / "testdata" / "tokenizer" / "ggml-vocab-starcoder.gguf"
    if not base.exists():
        print(f"note: {base} not found; skipping the construction self-check", file=sys.stderr)
        return
    tokens, merges, types, _ = read_vocab(base)
    tok = build_tokenizer(tokens, merges, types)
    inputs = Path(str(base) + ".inp").read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")
    outputs = Path(str(base) + ".out").read_text(encoding="utf-8").split("\n")
    for i, text in enumerate(inputs[:-1]):
        want = [int(x) for x in outputs[i].split()]
        got = encode(tok, text, parse_special=False)
        if got != want:
            sys.exit(f"self-check failed on starcoder vector {i} {text!r}: {got} != {want}")
    print(f"self-check: {len(inputs) - 1} starcoder vectors reproduced", file=sys.stderr)


def render(template_src, messages, add_generation_prompt, **special):
    from transformers.utils.chat_template_utils import render_jinja_template

    conv = [{"role": r, "content": c} for r, c in messages]
    rendered, _ = render_jinja_template(conversations=[conv], chat_template=template_src,
                                        add_generation_prompt=add_generation_prompt, **special)
    return rendered[0]


def chatml_default_system(template_src):
    """The system message the template inserts when the chat has none."""
    with_default = render(template_src, [("user", "x")], False)
    prefix, end = "<|im_start|>system\n", "<|im_end|>\n<|im_start|>user\nx<|im_end|>\n"
    if not with_default.startswith(prefix):
        return ""
    assert with_default.endswith(end), with_default
    return with_default[len(prefix):-len(end)]


def dump(doc, path):
    """JSON with one case per line (ids on the same line), ASCII-only so that invisible
    characters stay visible as \\u escapes."""
    lines = ["{"]
    keys = [k for k in doc if k not in ("cases", "chat")]
    for k in keys:
        lines.append(f"  {json.dumps(k)}: {json.dumps(doc[k])},")
    for name in ("cases", "chat"):
        lines.append(f"  {json.dumps(name)}: [")
        items = [f"    {json.dumps(c)}" for c in doc[name]]
        lines.append(",\n".join(items))
        lines.append("  ]," if name == "cases" else "  ]")
    lines.append("}")
    path.write_text("\n".join(lines) + "\n", encoding="ascii")


def main():
    default_model = os.environ.get("TANDEM_MODEL") or str(
        Path.home() / ".cache/tandem/models/SmolLM2-135M-Instruct.Q4_1.gguf")
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", nargs="?", default=default_model)
    ap.add_argument("-o", "--output", default=str(HERE / "smollm2_tokenizer.json"))
    args = ap.parse_args()

    check_versions()
    self_check_starcoder()

    model = Path(args.model)
    if not model.exists():
        sys.exit(f"{model}: not found (run scripts/setup to download the default model)")
    sha = hashlib.sha256(model.read_bytes()).hexdigest()
    tokens, merges, types, template_src = read_vocab(model)
    tok = build_tokenizer(tokens, merges, types)

    cases = []
    for text in TEXTS:
        for parse_special in (False, True):
            cases.append({"text": text, "parse_special": parse_special,
                          "ids": encode(tok, text, parse_special)})
        # decoding gives the text back (byte-level BPE is lossless)
        assert tok.decode(cases[-2]["ids"], skip_special_tokens=False) == text, text

    default_system = chatml_default_system(template_src)
    chats = []
    for name, messages, gen in CHATS:
        if name == "chatml":
            text = render(template_src, messages, gen)
        elif name == "llama3":
            text = render(LLAMA3_TEMPLATE, messages, gen, bos_token="<|begin_of_text|>",
                          eos_token="<|end_of_text|>")
        else:
            text = render(LLAMA2_TEMPLATE, messages, gen, bos_token="<s>", eos_token="</s>")
        case = {"template": name,
                "source": {"chatml": "gguf", "llama3": "Meta-Llama-3-8B-Instruct",
                           "llama2": "Llama-2-7b-chat-hf"}[name],
                "messages": [{"role": r, "content": c} for r, c in messages],
                "add_generation_prompt": gen, "text": text}
        if name == "chatml":
            case["ids"] = encode(tok, text, parse_special=True)
        chats.append(case)

    doc = {
        "model": model.name,
        "model_sha256": sha,
        "model_bytes": model.stat().st_size,
        "generator": "tests/golden/make_tokenizer_golden.py",
        "versions": {k: metadata.version(k) for k in PINNED},
        "reference": "HF tokenizers BPE + Sequence[Digits(individual), ByteLevel] (SmolLM2's "
                     "tokenizer.json) over the GGUF vocabulary; no BOS/EOS added; "
                     "chat text by transformers' render_jinja_template",
        "n_vocab": len(tokens),
        "default_system": default_system,
        "cases": cases,
        "chat": chats,
    }
    out = Path(args.output)
    dump(doc, out)
    json.loads(out.read_text(encoding="ascii"))  # well-formed
    print(f"wrote {out}: {len(cases)} cases, {len(chats)} chat renderings, model sha256 {sha}",
          file=sys.stderr)


if __name__ == "__main__":
    main()
