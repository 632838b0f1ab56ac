#!/usr/bin/env python3
"""json_schema_random.py - a differential check of the schema compiler against the `jsonschema`
package (the reference validator): seeded random schemas built from the keywords whose
interplay is easy to get wrong (enum / const beside bounds and lengths, nested anyOf / oneOf /
allOf / not, keywords no value of one type fits without `type`, member counts with optional
and additional properties, properties in any order),
each compiled with `tandem grammar check --schema`, and every instance of a fixed set (and, for
objects, the members in shuffled orders) fed to the grammar when it compiles.

The rule it checks: a compiled schema never accepts an instance jsonschema calls invalid.
Valid instances rejected are counted and printed, not failed (property order in counted or
large objects is a documented departure). Deterministic: fixed seeds.

Usage: json_schema_random.py TANDEM [ROUNDS]. Exits 1 when an invalid instance is accepted.
"""
import concurrent.futures
import json
import os
import random
import subprocess
import sys
import tempfile

import jsonschema

VALUES = [None, 0, 1, 2, 3, -1, 1.5, "a", "", "ab", "abc", True, [], [1], [1, 2], {}, {"a": 1}]


def leaf(r):
    return r.choice([{"type": "integer"}, {"type": "string"}, {"const": 1},
                     {"enum": [1, "a", None]}, {"minimum": 2},
                     {"type": "string", "maxLength": 1}, {"type": "null"},
                     {"maximum": 0}, {"enum": [1, 5, "a", "bb", [1], [1, 2]], "minimum": 2,
                                      "minLength": 2, "minItems": 2},
                     {"minItems": 1}, {"type": "array", "items": {"type": "integer"}},
                     # no type, and no value of one type fits: the other types stay allowed
                     {"minimum": 3, "maximum": 1}, {"minLength": 2, "maxLength": 1},
                     {"properties": {"a": False}, "required": ["a"]},
                     {"items": {"type": "string", "minLength": 2, "maxLength": 1}},
                     {"additionalProperties": {"minimum": 3, "maximum": 1, "type": "number"}}])


def combo(r, depth):
    if depth == 0 or r.random() < 0.3:
        return leaf(r)
    k = r.choice(["anyOf", "oneOf", "not", "allOf"])
    if k == "not":
        return {"not": combo(r, depth - 1)}
    return {k: [combo(r, depth - 1) for _ in range(r.randint(1, 3))]}


def obj_schema(r):
    props = {k: {"type": "integer"} for k in "abc"}
    s = {"type": "object", "properties": props}
    req = [k for k in props if r.random() < 0.35]
    if req:
        s["required"] = req
    ap = r.choice([True, False, {"type": "integer"}, None])
    if ap is not None:
        s["additionalProperties"] = ap
    if r.random() < 0.5:
        s["minProperties"] = r.randint(0, 4)
    if r.random() < 0.5:
        s["maxProperties"] = r.randint(0, 4)
    return s


def obj_instances(r):
    out = []
    for sub in range(8):
        keys = [k for i, k in enumerate("abc") if sub >> i & 1]
        for nx in range(3):
            r.shuffle(keys)
            inst = {k: 1 for k in keys}
            for x in "xy"[:nx]:
                inst[x] = 2
            out.append(inst)
    return out


def accepts(tandem, schema_path, text, work):
    path = os.path.join(work, "instance.json")
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    args = [tandem, "grammar", "check", "--schema", schema_path, "--instance", path]
    return subprocess.run(args, capture_output=True).returncode == 0


def check_seed(tandem, seed, root):
    """One seeded schema and its instances: (schema, refused, [(text, accepted, valid)])."""
    r = random.Random(seed)
    if seed % 2:
        schema, instances = combo(r, 3), VALUES
    else:
        schema, instances = obj_schema(r), obj_instances(r)
    work = os.path.join(root, str(seed))
    os.mkdir(work)
    sp = os.path.join(work, "schema.json")
    with open(sp, "w", encoding="utf-8") as f:
        json.dump(schema, f)
    if subprocess.run([tandem, "grammar", "check", "--schema", sp],
                      capture_output=True).returncode != 0:
        return schema, True, []
    validator = jsonschema.Draft202012Validator(schema)
    judged = []
    for inst in instances:
        text = json.dumps(inst, separators=(",", ":"))
        judged.append((text, accepts(tandem, sp, text, work), validator.is_valid(inst)))
    return schema, False, judged


def main():
    tandem = sys.argv[1]
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 120
    counts = dict(schemas=0, refused=0, instances=0, invalid_accepted=0, valid_rejected=0)
    # four schemas at a time (each `tandem` start of a CUDA build costs 0.1-0.35 s), results
    # counted in seed order
    with tempfile.TemporaryDirectory() as root, \
            concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
        for schema, refused, judged in pool.map(lambda s: check_seed(tandem, s, root),
                                                range(rounds)):
            counts["schemas"] += 1
            counts["refused"] += refused
            for text, acc, valid in judged:
                counts["instances"] += 1
                if acc and not valid:
                    counts["invalid_accepted"] += 1
                    print("INVALID ACCEPTED: schema %s instance %s" % (json.dumps(schema), text))
                elif valid and not acc:
                    counts["valid_rejected"] += 1
    print("json-schema-random: %(schemas)d schemas, %(refused)d refused; %(instances)d instances, "
          "%(valid_rejected)d valid rejected, %(invalid_accepted)d invalid accepted" % counts)
    return 1 if counts["invalid_accepted"] else 0


if __name__ == "__main__":
    sys.exit(main())
