#!/usr/bin/env bash
# test_json_schema_suite.sh - the JSON-Schema-Test-Suite conformance check of the schema compiler
# (tests/cli/json_schema_suite.py): every draft 2020-12 and draft 7 schema of the suite through
# `tandem grammar check --schema`, every instance of those that compile fed to the grammar, and
# the optional format tests of draft 2020-12 likewise; fails when any invalid instance is
# accepted. The suite comes from the jsonschema sdist (its json/tests folder); skipped (77) when
# it is not unpacked under ${XDG_CACHE_HOME:-~/.cache}/tandem/jsonschema-sdist:
#   pip download --no-binary jsonschema --no-deps jsonschema==4.23.0 -d DIR
#   tar xzf DIR/jsonschema-4.23.0.tar.gz -C ~/.cache/tandem/jsonschema-sdist
# Usage: bash test_json_schema_suite.sh /path/to/tandem
set -u
tandem=${1:?usage: test_json_schema_suite.sh /path/to/tandem}
here=$(cd "$(dirname "$0")" && pwd)
cache=${XDG_CACHE_HOME:-${HOME:-/nonexistent}/.cache}/tandem/jsonschema-sdist
suite=$(ls -d "$cache"/jsonschema-*/json/tests 2>/dev/null | sort | tail -n 1)
if [ -z "$suite" ] || [ ! -d "$suite/draft2020-12" ]; then
    echo "skip: no JSON-Schema-Test-Suite under $cache (the jsonschema sdist's json/tests)"
    exit 77
fi
python3 "$here/json_schema_suite.py" "$tandem" "$suite"
