#!/usr/bin/env bash
# test_tokenizer_export.sh - `tandem tokenizer export` checked with Hugging Face `tokenizers`
# (tokenizer_export_check.py beside this file, run with scripts/setup's venv python): exported
# folders give exactly Tandem's ids on a tiny GGUF, on llama.cpp's vectors and on the default
# model; plus the usage errors. Skips (77) when the venv has no `tokenizers`.
# Usage: bash test_tokenizer_export.sh /path/to/tandem   (ctest sets TDM_SHARED_DIR, TDM_SOURCE_DIR)
set -u

TANDEM=${1:?usage: test_tokenizer_export.sh /path/to/tandem}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
SHARED=${TDM_SHARED_DIR:-$HERE/../../../shared}
SOURCE=${TDM_SOURCE_DIR:-$HERE/../..}
PY=${XDG_CACHE_HOME:-$HOME/.cache}/tandem/venv/bin/python3
[ -x "$PY" ] || PY=python3

status=0
"$TANDEM" tokenizer >/dev/null 2>&1
[ $? -eq 2 ] || { echo "FAIL: 'tandem tokenizer' without a subcommand should exit 2" >&2; status=1; }
"$TANDEM" tokenizer export only-one >/dev/null 2>&1
[ $? -eq 2 ] || { echo "FAIL: 'tandem tokenizer export' with one operand should exit 2" >&2; status=1; }
"$TANDEM" tokenizer export --help | grep -q "tokenizer_config.json" ||
    { echo "FAIL: 'tandem tokenizer export --help'" >&2; status=1; }
out=$("$TANDEM" tokenizer export /nonexistent.gguf /tmp/unused-dir 2>&1)
rc=$?
if [ $rc -ne 1 ] || [[ $out != *"/nonexistent.gguf"* ]]; then
    echo "FAIL: a missing model should exit 1 naming it (status $rc): $out" >&2
    status=1
fi

"$PY" "$HERE/tokenizer_export_check.py" "$TANDEM" "$SHARED" "$SOURCE"
rc=$?
[ $rc -eq 0 ] || exit $rc
exit $status
