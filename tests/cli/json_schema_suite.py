#!/usr/bin/env python3
"""json_schema_suite.py - the JSON-Schema-Test-Suite (as the `jsonschema` sdist vendors it under
json/tests) through `tandem grammar check --schema`: every schema of the draft 2020-12 and draft 7
files, and of draft 2020-12's optional tests (ECMA-262 regexes, big numbers, formats asserted), is
compiled; for each one that compiles, every test instance, written compactly as
json.dumps(..., separators=(",", ":"), ensure_ascii=False) writes it, is fed to the grammar.

The rule it checks is the one docs/structured-output.md states: a compiled schema never accepts an
invalid instance, and rejects a valid one only for a documented departure (DEPARTURES below, the
list in docs/structured-output.md: the cause of each valid instance the grammar rejects, by
suite file, test group and test). Refusals are counted.

Usage: json_schema_suite.py TANDEM SUITE_TESTS_DIR. Prints the counts and the departures, each
cause on its own line; exits 1 when an invalid instance is accepted or a valid one is rejected
for no listed cause, 0 otherwise.
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

# The valid instances a compiled schema rejects on purpose: (file under the tests folder, test
# group's description, test's description or None for every test of the group) -> cause.
ANNOTATION = "format asserted (2020-12 makes it an annotation by default)"
LEAP = "leap second at an offset other than zero (only 23:59:60Z / +00:00 accepted)"
EMAIL = "email: dot-atom local part @ host name (no quoted local part, no address literal)"
DEPARTURES = {
    ("draft2020-12/format.json", None, None): ANNOTATION,
    ("draft2020-12/optional/format/date-time.json", "validation of date-time strings",
     "a valid date-time with a leap second, with minus offset"): LEAP,
    ("draft2020-12/optional/format/time.json", "validation of time strings",
     "valid leap second, positive time-offset"): LEAP,
    ("draft2020-12/optional/format/time.json", "validation of time strings",
     "valid leap second, large positive time-offset"): LEAP,
    ("draft2020-12/optional/format/time.json", "validation of time strings",
     "valid leap second, negative time-offset"): LEAP,
    ("draft2020-12/optional/format/time.json", "validation of time strings",
     "valid leap second, large negative time-offset"): LEAP,
    ("draft2020-12/optional/format/email.json", "validation of e-mail addresses",
     "a quoted string with a space in the local part is valid"): EMAIL,
    ("draft2020-12/optional/format/email.json", "validation of e-mail addresses",
     "a quoted string with a double dot in the local part is valid"): EMAIL,
    ("draft2020-12/optional/format/email.json", "validation of e-mail addresses",
     "a quoted string with a @ in the local part is valid"): EMAIL,
    ("draft2020-12/optional/format/email.json", "validation of e-mail addresses",
     "an IPv4-address-literal after the @ is valid"): EMAIL,
    ("draft2020-12/optional/format/email.json", "validation of e-mail addresses",
     "an IPv6-address-literal after the @ is valid"): EMAIL,
    ("draft2020-12/type.json", "integer type matches integers",
     "a float with zero fractional part is an integer"): "an integer written with a fraction (1.0)",
    ("draft7/type.json", "integer type matches integers",
     "a float with zero fractional part is an integer"): "an integer written with a fraction (1.0)",
    ("draft2020-12/const.json", "const with object",
     "same object with different property order is valid"):
        "an enum / const object's members in another order than written",
    ("draft7/const.json", "const with object",
     "same object with different property order is valid"):
        "an enum / const object's members in another order than written",
    ("draft7/ref.json", "ref overrides any sibling keywords", "ref valid, maxItems ignored"):
        "keywords beside $ref applied in drafts 4-7 too (2019-09 semantics)",
}


def departure(rel, group, test):
    """The documented cause of rejecting this valid instance, or None."""
    for key in ((rel, group, test), (rel, group, None), (rel, None, None)):
        if key in DEPARTURES:
            return DEPARTURES[key]
    return None


def check(tandem, schema_path, instance_path=None):
    """0: compiled (and the instance accepted); 1: refused or rejected."""
    args = [tandem, "grammar", "check", "--schema", schema_path]
    if instance_path:
        args += ["--instance", instance_path]
    return subprocess.run(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode


def run_file(tandem, path, rel, tmp):
    """The counts, the invalid instances accepted and the valid ones rejected (with their cause,
    None when undocumented) of one suite file (rel: its path under the tests folder; tmp: its
    own folder)."""
    st = dict(groups=0, refused=0, tests=0, right=0, valid_rejected=0)
    bad, rejected = [], []
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
            if not accepted and t["valid"]:
                st["valid_rejected"] += 1
                rejected.append(("%s: %s: %s" % (rel, g["description"], t["description"]),
                                 departure(rel, g["description"], t["description"])))
            st["right"] += accepted == t["valid"]
    return st, bad, rejected


def main():
    tandem, suite = sys.argv[1], sys.argv[2]
    st = dict(groups=0, refused=0, tests=0, right=0, valid_rejected=0)
    bad, rejected = [], []
    files = []
    for draft in ("draft2020-12", "draft7", "draft2020-12/optional",
                  "draft2020-12/optional/format"):
        d = os.path.join(suite, draft)
        files += [(os.path.join(d, name), draft + "/" + name) for name in sorted(os.listdir(d))
                  if name.endswith(".json") and name not in SKIP]
    # each `tandem` start of a CUDA build costs ~0.15-0.35 s (the CUDA libraries), so the files
    # run four at a time, each in a folder of its own; results are merged in file order
    with tempfile.TemporaryDirectory() as tmp, \
            concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
        jobs = []
        for i, (path, rel) in enumerate(files):
            sub = os.path.join(tmp, str(i))
            os.mkdir(sub)
            jobs.append(pool.submit(run_file, tandem, path, rel, sub))
        for job in jobs:
            one, one_bad, one_rejected = job.result()
            for k in st:
                st[k] += one[k]
            bad += one_bad
            rejected += one_rejected
    print("json-schema-test-suite: %d schemas, %d refused; %d instances judged, %d right, "
          "%d valid rejected, %d invalid accepted" % (st["groups"], st["refused"], st["tests"],
                                                      st["right"], st["valid_rejected"], len(bad)))
    causes = {}
    for _, cause in rejected:
        if cause:
            causes[cause] = causes.get(cause, 0) + 1
    for cause, n in sorted(causes.items(), key=lambda x: (-x[1], x[0])):
        print("  valid rejected, documented departure: %d %s" % (n, cause))
    undocumented = [what for what, cause in rejected if not cause]
    for what in undocumented:
        print("VALID REJECTED (no documented departure): " + what)
    for b in bad:
        print("INVALID ACCEPTED: " + b)
    return 1 if bad or undocumented else 0


if __name__ == "__main__":
    sys.exit(main())
