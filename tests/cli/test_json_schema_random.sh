#!/usr/bin/env bash
# test_json_schema_random.sh - the schema compiler against the `jsonschema` package on seeded
# random schemas (tests/cli/json_schema_random.py): fails when a compiled schema accepts an
# instance jsonschema calls invalid. Skipped (77) without the package (pip install jsonschema).
# Usage: bash test_json_schema_random.sh /path/to/tandem
set -u
tandem=${1:?usage: test_json_schema_random.sh /path/to/tandem}
here=$(cd "$(dirname "$0")" && pwd)
if ! python3 -c "import jsonschema" 2>/dev/null; then
    echo "skip: the jsonschema Python package is missing (pip install jsonschema)"
    exit 77
fi
python3 "$here/json_schema_random.py" "$tandem" 120
