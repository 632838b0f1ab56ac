#!/usr/bin/env python3
"""bench/grammar_setup.py - the setup step of the grammar benchmark (bench/bench_grammar.c).

For every MaskBench file in DIR (each: "schema" and "tests", a list of {"data", "valid"}),
writes each test instance's compact JSON text exactly as
json.dumps(data, separators=(",", ":"), ensure_ascii=False) writes it, once, to
CACHE/<file stem>.<i>.json, so no other serializer (jansson writes reals with 17 digits)
changes the text; and CACHE/index.json: {"dir": DIR, "files": {name: [{"valid": bool,
"ooo": bool}, ...]}}, where "ooo" marks a valid instance that lists properties out of the
schema's definition order (what a definition-order grammar rejects; reported on its own line).
Idempotent: a file already there with the same content is left alone.

usage: grammar_setup.py DIR CACHE
"""
import json
import os
import sys


def resolve(schema, root, depth=0):
    """The schema a local $ref points to (a few hops), else the schema itself."""
    while isinstance(schema, dict) and isinstance(schema.get("$ref"), str) and depth < 16:
        ref = schema["$ref"]
        if not ref.startswith("#"):
            return schema
        node = root
        for tok in [t for t in ref[1:].split("/") if t]:
            tok = tok.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and tok in node:
                node = node[tok]
            elif isinstance(node, list) and tok.isdigit() and int(tok) < len(node):
                node = node[int(tok)]
            else:
                return schema
        schema, depth = node, depth + 1
    return schema


def out_of_order(schema, data, root, depth=0):
    """Whether data lists an object's defined properties out of the schema's definition order,
    anywhere the schema describes it (allOf: in any branch; anyOf / oneOf: in every branch)."""
    schema = resolve(schema, root)
    if depth > 64 or not isinstance(schema, dict):
        return False
    for key, combine in (("allOf", any), ("anyOf", all), ("oneOf", all)):
        branches = schema.get(key)
        if isinstance(branches, list) and branches:
            if combine(out_of_order(b, data, root, depth + 1) for b in branches):
                return True
    props = schema.get("properties")
    if isinstance(data, dict) and isinstance(props, dict):
        order = list(props)
        seen = [order.index(k) for k in data if k in props]
        if seen != sorted(seen):
            return True
        for k, v in data.items():
            if k in props and out_of_order(props[k], v, root, depth + 1):
                return True
    items = schema.get("items")
    if isinstance(data, list) and isinstance(items, dict):
        return any(out_of_order(items, v, root, depth + 1) for v in data)
    return False


def write_if_changed(path, text):
    data = text.encode("utf-8")
    try:
        with open(path, "rb") as f:
            if f.read() == data:
                return
    except OSError:
        pass
    with open(path + ".tmp", "wb") as f:
        f.write(data)
    os.replace(path + ".tmp", path)


def main():
    if len(sys.argv) != 3:
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    src, cache = sys.argv[1], sys.argv[2]
    os.makedirs(cache, exist_ok=True)
    index = {"dir": os.path.abspath(src), "files": {}}
    n = 0
    for name in sorted(os.listdir(src)):
        if not name.endswith(".json"):
            continue
        with open(os.path.join(src, name), encoding="utf-8") as f:
            doc = json.load(f)
        stem, tests = name[: -len(".json")], []
        for i, t in enumerate(doc.get("tests", [])):
            text = json.dumps(t["data"], separators=(",", ":"), ensure_ascii=False)
            write_if_changed(os.path.join(cache, "%s.%d.json" % (stem, i)), text)
            valid = bool(t["valid"])
            ooo = valid and out_of_order(doc["schema"], t["data"], doc["schema"])
            tests.append({"valid": valid, "ooo": ooo})
            n += 1
        index["files"][name] = tests
    write_if_changed(os.path.join(cache, "index.json"), json.dumps(index, indent=0))
    n_ooo = sum(t["ooo"] for ts in index["files"].values() for t in ts)
    print("grammar_setup: %d files, %d instances (%d valid ones out of definition order) in %s"
          % (len(index["files"]), n, n_ooo, cache))
    return 0


if __name__ == "__main__":
    sys.exit(main())
