#!/usr/bin/env python3
"""Writes tests/golden/gemma3_tokenizer.json: Gemma 3 270M's token ids made by llama.cpp and
chat renderings made by Jinja from Gemma 3's chat template, the reference for
tests/unit/test_tokenizer_gemma3.c (ids, decoding) and tests/unit/test_chat.c (renderings).

Token ids come from llama.cpp through llama-cpp-python, the model opened with vocab_only=True
(no weights are loaded). Gemma 3's tokenizer is SentencePiece (tokenizer.ggml.model "llama",
262,144 tokens, add_space_prefix false, runs of spaces, tabs and newlines and some HTML tags
as user-defined tokens, <start_of_turn>/<end_of_turn> as control tokens). Each text is
tokenized without BOS (add_bos=False), once with parse_special off (control tokens' texts are
plain text; user-defined tokens still match, as in llama.cpp) and once with it on. The texts
are those of make_tokenizer_golden.py (code, whitespace runs, CR/LF, digits, emoji, CJK,
Arabic, Devanagari, accents, the empty string, very long words, chat markup) plus Gemma's own
markers and whitespace tokens. `decoded` is stored for a case whose llama.cpp detokenization
(special tokens rendered) is not the text itself.

Chat renderings come from Jinja (the sandboxed environment transformers' apply_chat_template
uses: trim_blocks, lstrip_blocks, raise_exception) on Gemma 3's chat template, copied below from
google/gemma-3-*-it's tokenizer_config.json (image parts included; the chats here are text),
with bos_token "<bos>". Each rendering also gets llama.cpp's ids (parse_special on, no BOS
added: the rendering starts with "<bos>" itself).

Pinned versions (what gemma3_tokenizer.json was made with; others print a warning):
    llama_cpp_python==0.3.36  Jinja2==3.1.6
    (pip install 'llama-cpp-python==0.3.36': it compiles llama.cpp, about 30 minutes on two
     cores; Jinja2 comes with it)

Usage: python3 tests/golden/make_gemma3_tokenizer_golden.py [MODEL.gguf] [-o OUT.json]
MODEL defaults to ~/.cache/tandem/models/gemma-3-270m-q4_k_m.gguf (scripts/setup --model
gemma3-270m installs it).
"""

import argparse
import hashlib
import json
import os
import sys
from importlib import metadata
from pathlib import Path

PINNED = {"llama_cpp_python": "0.3.36", "Jinja2": "3.1.6"}
MODEL_FILE = "gemma-3-270m-q4_k_m.gguf"
MODEL_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from make_tokenizer_golden import TEXTS as COMMON_TEXTS  # noqa: E402

# google/gemma-3-1b-it (and the other gemma-3 -it models), tokenizer_config.json "chat_template".
GEMMA3_TEMPLATE = (
    "{{ bos_token }}\n"
    "{%- if messages[0]['role'] == 'system' -%}\n"
    "    {%- if messages[0]['content'] is string -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}\n"
    "    {%- else -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}\n"
    "    {%- endif -%}\n"
    "    {%- set loop_messages = messages[1:] -%}\n"
    "{%- else -%}\n"
    "    {%- set first_user_prefix = \"\" -%}\n"
    "    {%- set loop_messages = messages -%}\n"
    "{%- endif -%}\n"
    "{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    "        {{ raise_exception(\"Conversation roles must alternate "
    "user/assistant/user/assistant/...\") }}\n"
    "    {%- endif -%}\n"
    "    {%- if (message['role'] == 'assistant') -%}\n"
    "        {%- set role = \"model\" -%}\n"
    "    {%- else -%}\n"
    "        {%- set role = message['role'] -%}\n"
    "    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {%- if message['content'] is string -%}\n"
    "        {{ message['content'] | trim }}\n"
    "    {%- elif message['content'] is iterable -%}\n"
    "        {%- for item in message['content'] -%}\n"
    "            {%- if item['type'] == 'image' -%}\n"
    "                {{ '<start_of_image>' }}\n"
    "            {%- elif item['type'] == 'text' -%}\n"
    "                {{ item['text'] | trim }}\n"
    "            {%- endif -%}\n"
    "        {%- endfor -%}\n"
    "    {%- else -%}\n"
    "        {{ raise_exception(\"Invalid content type\") }}\n"
    "    {%- endif -%}\n"
    "    {{ '<end_of_turn>\n' }}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "    {{'<start_of_turn>model\n'}}\n"
    "{%- endif -%}\n"
)

GEMMA_TEXTS = [
    "<start_of_turn>user\nWhat is the capital of France?<end_of_turn>\n<start_of_turn>model\n",
    "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\nHello!<end_of_turn>\n",
    "<end_of_turn><end_of_turn>text<start_of_turn> after",
    " <start_of_turn> spaced <end_of_turn> ",
    "<start_of_turn <end_of_turn <start_of_turn>> <<end_of_turn>",
    "<bos><eos><pad><unk><mask>[multimodal]<start_of_image><end_of_image>",
    "<unused0><unused1><unused10><unused6241><unused6242>",
    "<table><tr><td>1</td><td>two</td></tr></table>",
    "<h1>Title</h1><p>para <strong>bold</strong> <em>em</em> <b>b</b><i>i</i><u>u</u></p>",
    "<div class=\"x\"><span>a</span><ul><li>one</li></ul><code>x = 1</code></div>",
    "<blockquote>q</blockquote><sub>2</sub><sup>3</sup><s>strike</s><a>link</a>",
    "<html><body><img><iframe></iframe><footer></footer></body></html><bbox>",
    "a  b   c    d" + " " * 31 + "e" + " " * 32 + "f" + " " * 70 + "g",
    "\t\t\tx" + "\t" * 31 + "y" + "\t" * 40,
    "\n" * 31 + "z" + "\n" * 33 + "w" + "\n" * 70,
    " \n \t \r\n\t\n  \n\n\t\t  \r\r\n",
    "line one\r\nline two\r\n\r\nline four\rline five",
    "if (x) {\n\treturn y;\n}\n\n\n\tint z = 3;\n    // four spaces\n        eight\n",
    "12345678901234567890 3.14159e-10 0x7FFF_FFFF 1,234,567.89 +44 (0)20 7946 0958",
    "\u2581 literal U+2581 \u2581\u2581 and <0x41> <0xFF> <0x0A> text",
    "\u00a0\u00a0non-breaking\u2003em-space\u3000ideographic\ufeffbom",
    "\U0001f600\U0001f601\U0001f602\U0001f923\U0001f970\U0001f60d\U0001f929 \U0001faf6\U0001f3fb "
    "\U0001f9d1\u200d\U0001f91d\u200d\U0001f9d1 \u2764\ufe0f\u200d\U0001f525 \U00010348 \U0001d11e",
    "\u4e2d\u6587\u5206\u8bcd\u6d4b\u8bd5\uff1a\u6211\u7231\u5317\u4eac\u5929\u5b89\u95e8\u3002"
    "\u6f22\u5b57\u3068\u4eee\u540d\u6df7\u3058\u308a\u6587\u3002\ud55c\uad6d\uc5b4\ub3c4.",
    "\u0627\u0644\u0644\u063a\u0629 \u0627\u0644\u0639\u0631\u0628\u064a\u0629 \u062c\u0645\u064a"
    "\u0644\u0629\u060c \u0623\u0644\u064a\u0633 \u0643\u0630\u0644\u0643\u061f 123 \u0661\u0662"
    "\u0663",
    "\u0939\u093f\u0928\u094d\u0926\u0940 \u092d\u093e\u0937\u093e \u0915\u093e \u090f\u0915 "
    "\u0909\u0926\u093e\u0939\u0930\u0923 \u0939\u0948\u0964 \u0915\u094d\u0937\u0924\u094d\u0930"
    "\u093f\u092f",
    "na\u00efve co\u00f6perate \u00e9l\u00e8ve \u0141\u00f3d\u017a \u00df\u1e9e \u0130stanbul "
    "\u01c4\u01c5\u01c6 \ufb01 \u212b A\u030a",
    "Antidisestablishmentarianism" * 8,
    "x" * 1000,
    "\u00e9" * 200 + "\u4e00" * 100,
    "_" * 64 + "=" * 64 + "-" * 64 + "*" * 64,
    "The quick brown fox jumps over the lazy dog. " * 12,
    "@user #hashtag $VAR %PATH% ^caret &amp; ~tilde `tick` |pipe| \\back/slash",
]

# No chat without messages: the template reads messages[0], which Jinja refuses for [].
CHATS = [
    # (messages, add_generation_prompt)
    ([("user", "Hi")], True),
    ([("user", "Hi")], False),
    ([("system", "You are a pirate."), ("user", "Hello!")], True),
    ([("user", "What is 2+2?"), ("assistant", "4"), ("user", "And 3+3?")], True),
    ([("system", "  spaced system  "), ("user", "  keep whitespace \n")], True),
    ([("user", "\u4f60\u597d \U0001f44b\U0001f3fd, 12345")], True),
    ([("system", "Only a system message.")], True),
    ([("system", ""), ("user", "empty system")], True),
    ([("user", "Q1"), ("assistant", " A1 \n"), ("user", "Q2"), ("assistant", "A2")], False),
    ([("system", "Be brief.\n"), ("user", "\u3000 text \u00a0\n"), ("assistant", "ok")], True),
    ([("user", "Write C:\n```c\nint main(void) { return 0; }\n```")], True),
    ([("user", "")], True),
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


def render(messages, add_generation_prompt):
    """Gemma 3's template as transformers' apply_chat_template renders it."""
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = raise_exception
    conv = [{"role": r, "content": c} for r, c in messages]
    return env.from_string(GEMMA3_TEMPLATE).render(
        messages=conv, add_generation_prompt=add_generation_prompt, bos_token="<bos>",
        eos_token="<eos>")


def tokenize(llm, text, parse_special):
    return llm.tokenize(text.encode("utf-8"), add_bos=False, special=parse_special)


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


def token_cases(llm):
    cases = []
    n_roundtrip = 0
    for text in COMMON_TEXTS + GEMMA_TEXTS:
        for parse_special in (False, True):
            ids = tokenize(llm, text, parse_special)
            case = {"text": text, "parse_special": parse_special, "ids": ids}
            decoded = llm.detokenize(ids, special=True).decode("utf-8", "surrogateescape")
            if decoded != text:
                case["decoded"] = decoded
            else:
                n_roundtrip += 1
            cases.append(case)
    return cases, n_roundtrip


def chat_cases(llm):
    chats = []
    for messages, gen in CHATS:
        text = render(messages, gen)
        chats.append({"template": "gemma", "source": "gemma-3-it",
                      "messages": [{"role": r, "content": c} for r, c in messages],
                      "add_generation_prompt": gen, "text": text,
                      "ids": tokenize(llm, text, True)})
    return chats


def main():
    default_model = str(Path.home() / ".cache/tandem/models" / MODEL_FILE)
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", nargs="?", default=default_model)
    ap.add_argument("-o", "--output", default=str(HERE / "gemma3_tokenizer.json"))
    args = ap.parse_args()

    check_versions()
    model = Path(args.model)
    if not model.exists():
        sys.exit(f"{model}: not found (scripts/setup --model gemma3-270m installs it)")
    sha = hashlib.sha256(model.read_bytes()).hexdigest()
    if sha != MODEL_SHA256:
        print(f"warning: {model} has SHA-256 {sha}, not Gemma 3 270M's {MODEL_SHA256}",
              file=sys.stderr)

    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(model), vocab_only=True, verbose=False)
    cases, n_roundtrip = token_cases(llm)
    chats = chat_cases(llm)
    special_ids = {t: tokenize(llm, t, True) for t in ("<bos>", "<eos>", "<start_of_turn>",
                                                        "<end_of_turn>")}
    doc = {
        "model": model.name,
        "model_sha256": sha,
        "model_bytes": model.stat().st_size,
        "generator": "tests/golden/make_gemma3_tokenizer_golden.py",
        "versions": {k: metadata.version(k) for k in PINNED},
        "reference": "llama.cpp (llama-cpp-python, vocab_only) tokenize, add_bos=False, special "
                     "= parse_special; detokenize(special=True); chat text by Jinja from "
                     "Gemma 3's chat template (bos_token <bos>)",
        "n_vocab": llm.n_vocab(),
        "bos": llm.token_bos(),
        "eos": llm.token_eos(),
        "special_ids": special_ids,
        "cases": cases,
        "chat": chats,
    }
    out = Path(args.output)
    dump(doc, out)
    json.loads(out.read_text(encoding="ascii"))  # well-formed
    print(f"wrote {out}: {len(cases)} cases ({n_roundtrip} decode to their text), "
          f"{len(chats)} chat renderings, model sha256 {sha}", file=sys.stderr)


if __name__ == "__main__":
    main()
