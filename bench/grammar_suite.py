#!/usr/bin/env python3
"""bench/grammar_suite.py - the JSON-Schema-Test-Suite as MaskBench files, for the grammar
benchmark (bench/bench_grammar.c, bench/grammar_llg.py): every schema of the files that
tests/cli/json_schema_suite.py runs (draft 2020-12, draft 7, draft 2020-12's optional and
optional/format tests, less the same skipped files) becomes OUT/<draft>--<file>--<n>.json with
"schema" and "tests" ({"data", "valid"}), as MaskBench's files are. Then:

    python3 bench/grammar_setup.py OUT CACHE
    build/bench/tandem-bench-grammar --dir OUT --cache CACHE --check --dump-vocab VOCAB
    python3 bench/grammar_llg.py --vocab VOCAB --dir OUT

usage: grammar_suite.py SUITE_TESTS_DIR OUT   (SUITE_TESTS_DIR: the sdist's json/tests)
"""
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests",
                                "cli"))
from json_schema_suite import SKIP  # noqa: E402

DRAFTS = ("draft2020-12", "draft7", "draft2020-12/optional", "draft2020-12/optional/format")


def main():
    if len(sys.argv) != 3:
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    suite, out = sys.argv[1], sys.argv[2]
    os.makedirs(out, exist_ok=True)
    n = 0
    for draft in DRAFTS:
        d = os.path.join(suite, draft)
        for name in sorted(os.listdir(d)):
            if not name.endswith(".json") or name in SKIP:
                continue
            with open(os.path.join(d, name), encoding="utf-8") as f:
                groups = json.load(f)
            for i, g in enumerate(groups):
                doc = {"schema": g["schema"],
                       "tests": [{"data": t["data"], "valid": t["valid"]} for t in g["tests"]]}
                stem = "%s--%s--%d.json" % (draft.replace("/", "-"), name[:-5], i)
                with open(os.path.join(out, stem), "w", encoding="utf-8") as f:
                    json.dump(doc, f, ensure_ascii=False)
                n += 1
    print("grammar_suite: %d schemas written to %s" % (n, out), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
