#!/usr/bin/env bash
# test_json_schema_random.sh - the schema compiler against the `jsonschema` package on seeded
# random schemas (tests/cli/json_schema_random.py): fails when a compiled schema accepts an
# instance jsonschema calls invalid. Uses the venv scripts/setup makes (it installs jsonschema),
# else python3; fails, saying so, when the package is missing.
# Usage: bash test_json_schema_random.sh /path/to/tandem
set -u
tandem=${1:?usage: test_json_schema_random.sh /path/to/tandem}
here=$(cd "$(dirname "$0")" && pwd)
py=${XDG_CACHE_HOME:-$HOME/.cache}/tandem/venv/bin/python3
[ -x "$py" ] || py=python3
if ! "$py" -c "import jsonschema" 2>/dev/null; then
    echo "FAIL: the jsonschema Python package is missing: run scripts/setup" >&2
    exit 1
fi
"$py" "$here/json_schema_random.py" "$tandem" 120
