#!/usr/bin/env python3
"""json_schema_suite.py - the JSON-Schema-Test-Suite (as the `jsonschema` sdist vendors it under
json/tests) through `tandem grammar check --schema`: every schema of the draft 2020-12 and draft 7
files, and of draft 2020-12's optional tests (ECMA-262 regexes, big numbers, formats asserted), is
compiled; for each one that compiles, every test instance, written compactly as
json.dumps(..., separators=(",", ":"), ensure_ascii=False) writes it, is fed to the grammar.

The rule it checks is the one docs/structured-output.md states: a compiled schema never accepts an
invalid instance. Valid instances rejected are counted, not failed (property order, the form an
escape or a number is written in are documented departures), and so are refusals.

Usage: json_schema_suite.py TANDEM SUITE_TESTS_DIR. Prints the counts; exits 1 when an invalid
instance is accepted, 0 otherwise.
"""
import concurrent.futures
import json
import os
import subprocess
import sys
import tempfile

# Files whose schemas need what a single document cannot have (remote references) or that test
# the validator's vocabulary handling rather than values.
SKIP = {"refRemote.json", "vocabulary.json", "dynamicRef.json"}


def check(tandem, schema_path, instance_path=None):
    """0: compiled (and the instance accepted); 1: refused or rejected."""
    args = [tandem, "grammar", "check", "--schema", schema_path]
    if instance_path:
        args += ["--instance", instance_path]
    return subprocess.run(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode


def run_file(tandem, path, tmp):
    """The counts and the invalid instances accepted of one suite file (tmp: its own folder)."""
    st = dict(groups=0, refused=0, tests=0, right=0, valid_rejected=0)
    bad = []
    with open(path, encoding="utf-8") as f:
        groups = json.load(f)
    for g in groups:
        schema_path = os.path.join(tmp, "schema.json")
        with open(schema_path, "w", encoding="utf-8") as f:
            json.dump(g["schema"], f, ensure_ascii=False)
        st["groups"] += 1
        if check(tandem, schema_path) != 0:
            st["refused"] += 1
            continue
        for t in g["tests"]:
            inst = os.path.join(tmp, "instance.json")
            with open(inst, "w", encoding="utf-8") as f:
                f.write(json.dumps(t["data"], separators=(",", ":"), ensure_ascii=False))
            accepted = check(tandem, schema_path, inst) == 0
            st["tests"] += 1
            if accepted and not t["valid"]:
                bad.append("%s: %s: %s" % (os.path.relpath(path), g["description"],
                                           t["description"]))
            st["valid_rejected"] += (not accepted) and t["valid"]
            st["right"] += accepted == t["valid"]
    return st, bad


def main():
    tandem, suite = sys.argv[1], sys.argv[2]
    st = dict(groups=0, refused=0, tests=0, right=0, valid_rejected=0)
    bad = []
    files = []
    for draft in ("draft2020-12", "draft7", "draft2020-12/optional",
                  "draft2020-12/optional/format"):
        d = os.path.join(suite, draft)
        files += [os.path.join(d, name) for name in sorted(os.listdir(d))
                  if name.endswith(".json") and name not in SKIP]
    # each `tandem` start of a CUDA build costs ~0.15-0.35 s (the CUDA libraries), so the files
    # run four at a time, each in a folder of its own; results are merged in file order
    with tempfile.TemporaryDirectory() as tmp, \
            concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
        jobs = []
        for i, path in enumerate(files):
            sub = os.path.join(tmp, str(i))
            os.mkdir(sub)
            jobs.append(pool.submit(run_file, tandem, path, sub))
        for job in jobs:
            one, one_bad = job.result()
            for k in st:
                st[k] += one[k]
            bad += one_bad
    print("json-schema-test-suite: %d schemas, %d refused; %d instances judged, %d right, "
          "%d valid rejected, %d invalid accepted" % (st["groups"], st["refused"], st["tests"],
                                                      st["right"], st["valid_rejected"], len(bad)))
    for b in bad:
        print("INVALID ACCEPTED: " + b)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
