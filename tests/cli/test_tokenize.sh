#!/usr/bin/env bash
# test_tokenize.sh - `tandem tokenize` end to end: ids for llama.cpp's test texts on vocabulary-only
# GGUFs, --pieces, --special, --bos, stdin, --chat, and the exit status and message of each error.
# Usage: bash test_tokenize.sh /path/to/tandem   (ctest sets TDM_SHARED_DIR and TDM_SOURCE_DIR)
set -u

TANDEM=${1:?usage: test_tokenize.sh /path/to/tandem}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
SHARED=${TDM_SHARED_DIR:-$HERE/../../../shared}
VOCABS=$SHARED/testdata/tokenizer
GPT2=$VOCABS/ggml-vocab-gpt-2.gguf
SEP=$'\n__ggml_vocab_test__\n'

passed=0
failed=0
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

ok() {
    passed=$((passed + 1))
}
bad() {
    failed=$((failed + 1))
    printf 'FAIL: %s\n' "$1" >&2
}

# expect_out NAME WANT ARGS...: stdout must equal WANT and the status must be 0.
expect_out() {
    local name=$1 want=$2
    shift 2
    local got rc
    got=$("$TANDEM" tokenize "$@" 2>"$TMP/err")
    rc=$?
    if [[ $rc -ne 0 ]]; then
        bad "$name: exit $rc: $(cat "$TMP/err")"
    elif [[ "$got" != "$want" ]]; then
        bad "$name: got '$got', want '$want'"
    else
        ok
    fi
}

# expect_fail NAME STATUS PATTERN ARGS...: the status must be STATUS, stdout empty, and stderr
# must contain PATTERN (a fixed string).
expect_fail() {
    local name=$1 want_rc=$2 pattern=$3
    shift 3
    local rc
    "$TANDEM" tokenize "$@" >"$TMP/out" 2>"$TMP/err"
    rc=$?
    if [[ $rc -ne $want_rc ]]; then
        bad "$name: exit $rc, want $want_rc (stderr: $(cat "$TMP/err"))"
    elif [[ -s "$TMP/out" ]]; then
        bad "$name: printed to stdout: $(head -c 200 "$TMP/out")"
    elif ! grep -qF -- "$pattern" "$TMP/err"; then
        bad "$name: stderr lacks '$pattern': $(cat "$TMP/err")"
    else
        ok
    fi
}

if [[ ! -f "$GPT2" ]]; then
    echo "test vocabularies not found under $VOCABS (set TDM_SHARED_DIR)" >&2
    exit 1
fi

# Splits X.gguf.inp into texts[] and X.gguf.out into want[] (ids without the leading space).
load_vectors() {
    local base=$1 content rest
    texts=()
    want=()
    IFS= read -r -d '' content <"$base.inp"
    rest=$content
    while [[ $rest == *"$SEP"* ]]; do
        texts+=("${rest%%"$SEP"*}")
        rest=${rest#*"$SEP"}
    done
    local line
    while IFS= read -r line || [[ -n $line ]]; do
        line=${line# }
        want+=("$line")
    done <"$base.out"
}

# ---- ids for every llama.cpp test text (via -f FILE: texts are exact bytes) ----
for vocab in gpt-2 starcoder llama-spm; do
    load_vectors "$VOCABS/ggml-vocab-$vocab.gguf"
    if [[ ${#texts[@]} -lt 40 || ${#texts[@]} -ne ${#want[@]} ]]; then
        bad "$vocab: read ${#texts[@]} texts and ${#want[@]} expected lines"
        continue
    fi
    for i in "${!texts[@]}"; do
        printf '%s' "${texts[$i]}" >"$TMP/text"
        expect_out "$vocab vector $i" "${want[$i]}" -m "$VOCABS/ggml-vocab-$vocab.gguf" \
            -f "$TMP/text"
    done
done

# ---- the text as an argument, and from stdin ----
load_vectors "$GPT2"
expect_out "gpt-2 first text as argument" "${want[0]}" -m "$GPT2" "${texts[0]}"
got=$(printf '%s' "${texts[0]}" | "$TANDEM" tokenize -m "$GPT2" -f - 2>&1)
if [[ "$got" == "${want[0]}" ]]; then ok; else bad "stdin: got '$got', want '${want[0]}'"; fi
expect_out "empty text" "" -m "$GPT2" ""
expect_out "options after the text" "15496 995" "Hello world" -m "$GPT2"

# ---- --pieces ----
expect_out "pieces" $'15496\t"Hello"\n995\t" world"' -m "$GPT2" --pieces "Hello world"
expect_out "pieces escapes" $'1\t"\\""\n59\t"\\\\"\n198\t"\\n"\n197\t"\\t"' \
    -m "$GPT2" --pieces $'"\\\n\t'
# U+1F600 is two byte-level tokens in GPT-2 (3 + 1 bytes): neither is a whole UTF-8 character
expect_out "pieces bytes" $'47249\t"\\xf0\\x9f\\x98"\n222\t"\\x80"' \
    -m "$GPT2" --pieces $'\xf0\x9f\x98\x80'
expect_out "pieces utf-8" $'2634\t"\xc3\xa9"' -m "$GPT2" --pieces $'\xc3\xa9'

# ---- --special and --bos ----
expect_out "special" "15496 50256" -m "$GPT2" --special "Hello<|endoftext|>"
got=$("$TANDEM" tokenize -m "$GPT2" "Hello<|endoftext|>" 2>&1)
if [[ " $got " != *" 50256 "* && "$got" == "15496 "* ]]; then ok; else
    bad "special as text: got '$got' (want plain-text tokens, no 50256)"; fi
expect_out "bos" "50256 15496 995" -m "$GPT2" --bos "Hello world"
expect_out "spm bos pieces" $'1\t"<s>"\n15043\t" Hello"' \
    -m "$VOCABS/ggml-vocab-llama-spm.gguf" --bos --pieces "Hello"

# ---- --chat ----
expect_fail "chat without a template" 1 "--chat-template" -m "$GPT2" --chat "Hi"
got=$("$TANDEM" tokenize -m "$GPT2" --chat "Hi" --chat-template chatml 2>&1)
if [[ $? -eq 0 && -n "$got" ]]; then ok; else bad "chat with --chat-template: '$got'"; fi
model=${TANDEM_MODEL:-${XDG_CACHE_HOME:-$HOME/.cache}/tandem/models/SmolLM2-135M-Instruct.Q4_1.gguf}
if [[ -f "$model" ]]; then
    # tests/golden/smollm2_tokenizer.json, chat case 0: the default system message is added
    default_sys="2683 359 253 5356 5646 11173 3365 3511 308 34519 28 7018 411 407 19712 8182"
    user_hi="1 4093 198 26843 2 198 1 520 9531 198"
    expect_out "chat smollm2" "1 9690 198 $default_sys 2 198 $user_hi" -m "$model" --chat "Hi"
    expect_out "chat smollm2 system" "1 9690 198 6077 1890 30 2 198 $user_hi" \
        -m "$model" --chat "Hi" --system "Be short."
    # the default model is used without -m
    expect_out "default model" "19556 905" "Hello world"
else
    bad "default model $model is missing: run scripts/setup"
fi

# ---- errors: status 1 for failures, 2 for bad usage; the message names the problem ----
expect_fail "missing model" 1 "$TMP/none.gguf" -m "$TMP/none.gguf" "Hello"
expect_fail "not a gguf" 1 "not a GGUF file" -m "$GPT2.inp" "Hello"
expect_fail "missing input file" 1 "$TMP/none.txt" -m "$GPT2" -f "$TMP/none.txt"
expect_fail "unknown option" 2 "--bogus" -m "$GPT2" --bogus "Hello"
expect_fail "unknown short option" 2 "'-q'" -m "$GPT2" -q "Hello"
expect_fail "option without value" 2 "needs a value" -m
expect_fail "nothing to tokenize" 2 "nothing to tokenize" -m "$GPT2"
expect_fail "text and file" 2 "only one of" -m "$GPT2" -f "$TMP/text" "Hello"
expect_fail "two texts" 2 "one argument" -m "$GPT2" "Hello" "world"
expect_fail "system without chat" 2 "--system" -m "$GPT2" --system "S" "Hello"
expect_fail "bad chat template" 2 "'nope'" -m "$GPT2" --chat "Hi" --chat-template nope

# ---- --help ----
got=$("$TANDEM" tokenize --help)
if [[ $? -eq 0 && "$got" == *"usage: tandem tokenize"* && "$got" == *"--pieces"* ]]; then ok; else
    bad "--help"; fi

echo "$passed passed, $failed failed"
[[ $failed -eq 0 ]]
