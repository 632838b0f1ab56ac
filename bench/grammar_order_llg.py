#!/usr/bin/env python3
"""bench/grammar_order_llg.py - property order after merges, Tandem against llguidance.

Seeded schemas whose `properties` meet another schema's (a sibling `anyOf`, `oneOf`, `allOf`
or `$ref`), with and without `additionalProperties`, `type` and `required` beside them, their
keywords in shuffled document order and five to seven names in all; every order of the
names is fed to both engines as compact JSON, byte by byte (llguidance 1.9.1 with a
one-token-per-byte vocabulary; Tandem through `tandem grammar check --schema --instance`).
An order llguidance accepts and Tandem rejects is a valid instance Tandem blocks where
llguidance does not (docs/structured-output.md, property order); each is printed. Orders
Tandem accepts beyond llguidance's are counted (JSON Schema allows every order).

usage: grammar_order_llg.py TANDEM [SCHEMAS]   (exit 1 when an order only llguidance takes)
"""
import itertools
import json
import os
import random
import subprocess
import sys
import tempfile

os.environ.setdefault("RAYON_NUM_THREADS", "1")
import llguidance  # noqa: E402


class ByteVocab:
    """256 one-byte tokens and an end-of-sequence token, for llguidance's TokenizerWrapper."""

    def __init__(self):
        self.tokens = [bytes([i]) for i in range(256)] + [b"<eos>"]
        self.eos_token_id = 256
        self.bos_token_id = None
        self.special_token_ids = [256]

    def __call__(self, s):
        return list(s.encode("utf-8") if isinstance(s, str) else s)


TOKENIZER = llguidance.LLTokenizer(llguidance.TokenizerWrapper(ByteVocab()), slices=[])


def llg_accepts(schema, text):
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        schema, defaults={"whitespace_flexible": False})
    m = llguidance.LLMatcher(TOKENIZER, grammar, log_level=0)
    if m.is_error():
        return None
    return all(m.consume_token(b) for b in text.encode("utf-8")) and m.is_accepting()


def tandem_accepts(tandem, schema, text, work):
    sp, ip = os.path.join(work, "schema.json"), os.path.join(work, "instance.json")
    with open(sp, "w", encoding="utf-8") as f:
        f.write(schema)
    with open(ip, "w", encoding="utf-8") as f:
        f.write(text)
    args = [tandem, "grammar", "check", "--schema", sp, "--instance", ip]
    return subprocess.run(args, capture_output=True).returncode == 0


def make_schema(seed):
    """A schema of properties beside another schema with properties, and its names."""
    r = random.Random(seed)
    names = list("abcdefg")
    own = r.sample(names, r.randint(2, 5))
    other = r.sample(names, r.randint(1, 4))
    for n in names:
        if len(set(own) | set(other)) >= 5:
            break
        if n not in own:
            own.append(n)
    kind = r.choice(["anyOf", "oneOf", "allOf", "$ref"])
    branch = {"properties": {k: {} for k in other}}
    parts = [("properties", {k: {} for k in own})]
    if r.random() < 0.6:
        parts.append(("additionalProperties", r.choice([True, False, {}])))
    if r.random() < 0.4:
        parts.append(("type", "object"))
    if r.random() < 0.4:
        parts.append(("required", [own[0]]))
    if kind == "$ref":
        parts += [("$ref", "#/$defs/d"), ("$defs", {"d": branch})]
    else:
        parts.append((kind, [branch]))
    r.shuffle(parts)
    return json.dumps(dict(parts)), sorted(set(own) | set(other))


def main():
    tandem = sys.argv[1]
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 25
    total = llg_only = tandem_only = 0
    with tempfile.TemporaryDirectory() as work:
        for seed in range(rounds):
            schema, names = make_schema(seed)
            for order in itertools.permutations(names):
                text = json.dumps({k: 1 for k in order}, separators=(",", ":"))
                lg, td = llg_accepts(schema, text), tandem_accepts(tandem, schema, text, work)
                total += 1
                if lg and not td:
                    llg_only += 1
                    print("ONLY LLGUIDANCE: schema %s instance %s" % (schema, text))
                tandem_only += td and not lg
    print("grammar_order_llg: %d schemas, %d instances: %d orders only llguidance accepts, "
          "%d only Tandem" % (rounds, total, llg_only, tandem_only))
    return 1 if llg_only else 0


if __name__ == "__main__":
    sys.exit(main())
